"""The planner's formulas by hand and against the pipeline's own code: Korthikanti et
al.'s activation formulas beside ours (and what XLA's GPU program adds to them), the
buffer slots against the executor's lowering, and the zero-bubble formula against the
lockstep simulator. (The planner as a whole, against the paper and XLA: test_plan.py.)"""
import pytest

from jaxptd.pipeline import schedules
from jaxptd.pipeline.lowering import lower
from jaxptd.pipeline.simulate import simulate
from jaxptd.plan import model as plan_model
from jaxptd.plan import timing as plan_time


def test_korthikanti_formulas_by_hand():
    """Korthikanti et al. 2022, Table 2, for GPT-3 175B at t = 8 (5as/(ht) = 10 here)."""
    b, s, h, a, t = 1, 2048, 12288, 96, 8
    sbh, layer = s * b * h, plan_model.korthikanti_layer_bytes
    assert layer(b, s, h, a, t) == pytest.approx(sbh * (10 + 24 / 8 + 10))
    assert layer(b, s, h, a, t, sp=True) == pytest.approx(sbh / 8 * (34 + 80))
    assert layer(b, s, h, a, t, sp=True, remat="selective") == pytest.approx(sbh / 8 * 34)
    assert layer(b, s, h, a, t, remat="full") == 2 * sbh
    assert layer(b, s, h, a, t, sp=True, remat="full") == 2 * sbh / 8
    # the paper's headline: SP + selective recomputation keep about 5x less than t alone
    assert 5 <= layer(b, s, h, a, t) / layer(b, s, h, a, t, sp=True, remat="selective") < 6


def test_our_layer_is_megatrons_less_what_it_recomputes():
    """Against Megatron's fused 16-bit layer (Korthikanti et al. 2022), by hand: at t = 1
    with flash attention ours keeps 26 sbh bytes, Megatron's 34 sbh without its attention
    term (its selective count) less the GeLU output (8: ours recomputes it from the MLP's
    first output) and the two dropout masks (2: none without dropout) plus a second copy of
    the attention context (2). With SP both divide the stream and the two norm outputs by
    t (both keep the norm outputs as they were before f and gather them again in the
    backward: tensor.entered), 26 sbh / t. remat=minimal drops the norm outputs and the
    context's copy, minimal_mlp q, k and v too; full keeps the layer input."""
    b, s, h, a, e = 1, 2048, 12288, 96, 2
    sbh = s * b * h
    ours, theirs = plan_model.layer_activation_bytes, plan_model.korthikanti_layer_bytes
    flash = plan_model.scores_bytes(b, s, a, 1, e, flash=True)  # [b, a, s] float32
    assert ours(b, s, h, a, 1, e, flash=True) == pytest.approx(26 * sbh + flash)
    assert theirs(b, s, h, a, 1, remat="selective") - 8 * sbh - 2 * sbh + 2 * sbh == 26 * sbh
    t = 8
    split = 2 * (3 + 2 + 4) / t  # q, k, v, context twice, the MLP's first output: split
    assert ours(b, s, h, a, t, e, sp=True, flash=True) == pytest.approx(
        sbh * (4 / t + 4 / t + split) + flash / t)
    assert ours(b, s, h, a, t, e, sp=True, flash=True) * t == pytest.approx(26 * sbh + flash)
    assert ours(b, s, h, a, t, e, sp=True, flash=True, remat="minimal") == pytest.approx(
        sbh * (4 / t + 2 * (3 + 1 + 4) / t) + flash / t)
    assert ours(b, s, h, a, t, e, sp=True, flash=True, remat="minimal_mlp") == pytest.approx(
        sbh * (4 / t + 2 * (1 + 4) / t) + flash / t)
    assert ours(b, s, h, a, t, e, sp=True, remat="full") == pytest.approx(2 * sbh / t)
    # without flash attention: the [b, a/t, s, s] probabilities in the compute dtype
    assert ours(b, s, h, a, t, e) - ours(b, s, h, a, t, e, flash=True) == pytest.approx(
        a * s * s * b / t * e - 4 * b * a / t * s)


def test_xla_attention_on_a_gpu_holds_its_scores_twice():
    """XLA's attention core compiled for a GPU (activation_memory's xla_gpu, measured on
    the H100 compile of GPT-1.3B): one more [b, a/t, s, s] a layer where its forward and
    backward are one program (unpipelined, stash=inputs), two more where the B slot reads
    a layer's from the stash (one layer at a time); nothing more where recomputation drops
    them."""
    b, s, h, a, t, e, layers = 4, 2048, 2048, 16, 2, 2, 12
    scores = a / t * s * s * b * e
    common = dict(b=b, s=s, h=h, a=a, t=t, e=e, layers_per_stage=layers, vocab_local=25216)
    piped = dict(common, pipe=2, slots={"stash": 3, "grad": 1, "w": 0})
    for kwargs, key, extra in ((dict(common, pipe=1), "kept", layers * scores),
                               (dict(piped, keep_activations=False), "kept", layers * scores),
                               (piped, "stash", 2 * scores)):
        cpu = plan_model.activation_memory(remat="none", **kwargs)
        gpu = plan_model.activation_memory(remat="none", xla_gpu=True, **kwargs)
        assert gpu[key] - cpu[key] == pytest.approx(extra)
    for remat in ("selective", "full"):
        assert plan_model.activation_memory(remat=remat, xla_gpu=True, pipe=1, **common) == \
            plan_model.activation_memory(remat=remat, pipe=1, **common)


def _slots(rounds) -> dict:
    return {"stash": rounds.num_stash_slots, "grad": rounds.num_grad_slots,
            "w": rounds.num_w_slots, "tape": rounds.num_tape_slots}


MASKED = (False, True)  # rounds packed and timed as the cond form / a GPU's forms run them


def _lowered(kind, p, m, v, masked):
    costs = schedules.Costs(masked=masked)
    return lower(schedules.make_schedule(kind, p, m, v, costs), costs)


@pytest.mark.parametrize("masked", MASKED, ids=["cond", "masked"])
@pytest.mark.parametrize("kind", schedules.KINDS)
def test_buffer_slots_formula_is_the_lowering(kind, masked):
    """The formula the planner uses for long schedules against the executor's buffers."""
    chunks = (2, 3) if "interleaved" in kind else (2,) if kind == "zb-v" else (1,)
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p):
            for v in chunks:
                assert plan_model.slots_formula(kind, p, m, v, masked) == \
                    _slots(_lowered(kind, p, m, v, masked)), (p, m, v)


@pytest.mark.parametrize("masked", MASKED, ids=["cond", "masked"])
def test_zb_h1_buffer_slots_formula_is_the_lowering_at_every_m(masked):
    """zb-h1 at any m, including 2 <= m < 2p - 2, where it runs one action a round and
    needs fewer W slots than stash slots."""
    for p in (2, 3, 4, 5, 8):
        for m in range(1, 3 * p + 1):
            assert plan_model.slots_formula("zb-h1", p, m, 1, masked) == \
                _slots(_lowered("zb-h1", p, m, 1, masked)), (p, m)


@pytest.mark.parametrize("masked", MASKED, ids=["cond", "masked"])
def test_zero_bubble_formula_is_the_simulated_bubble(masked):
    """The bubble the planner uses for long schedules against the lockstep simulator:
    zb-h1 at every m, zb-interleaved from m = p."""
    costs = schedules.Costs(masked=masked)
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 1):
            got = simulate(schedules.make_schedule("zb-h1", p, m, 1, costs), costs)
            assert plan_time.bubble_formula(p, 1, m, True, masked) == pytest.approx(
                got.bubble_fraction), (p, m)
            if m >= p:
                got = simulate(schedules.make_schedule("zb-interleaved", p, m, 2, costs), costs)
                assert plan_time.bubble_formula(p, 2, m, True, masked) == pytest.approx(
                    got.bubble_fraction), (p, m)


@pytest.mark.parametrize("masked", MASKED, ids=["cond", "masked"])
def test_zb_v_bubble_formula_is_the_simulated_bubble_within_a_forward(masked):
    """zb-v's formula (ZB-H1's) against the lockstep simulator from m = p: the simulated
    time within one t_f of it (m t_f = the ideal time's third), half of it masked."""
    costs = schedules.Costs(masked=masked)
    for p in (2, 3, 4, 8):
        for m in range(p, 3 * p + 1):
            got = simulate(schedules.make_schedule("zb-v", p, m, 2, costs), costs)
            formula = plan_time.bubble_formula(p, 2, m, True, masked, v_shape=True)
            assert abs(got.bubble_fraction - formula) * 3 * m <= 1 - masked / 2 + 1e-9, (p, m)


def test_the_plan_times_the_round_form_its_platform_runs():
    """The planner's bubble and slots are the executor's: a GPU's steady form packs
    zero-bubble W's for masked rounds (2(p-1)/(3m), no W slot, min(m, p - 1) grad slots),
    the CPU's cond form for skipped idle slots ((p-1)/(3m), 2p - 1 W slots);
    parallel.round_form overrides the platform's."""
    from jaxptd.config import load_config
    from jaxptd.plan import schedule_stats

    p, m = 4, 8
    config = load_config(None, [f"parallel.pipe={p}", "parallel.schedule=zb-h1",
                                f"parallel.microbatches={m}", "model.num_layers=8",
                                f"train.global_batch={m}"])
    gpu, cpu = (schedule_stats(config, platform) for platform in ("gpu", "cpu"))
    assert gpu[0] == pytest.approx(2 * (p - 1) / (3 * m)) and gpu[1]["w"] == 0 \
        and gpu[1]["grad"] == p - 1
    assert cpu[0] == pytest.approx((p - 1) / (3 * m)) and cpu[1]["w"] == 2 * p - 1
    forced = load_config(None, [f"parallel.pipe={p}", "parallel.schedule=zb-h1",
                                f"parallel.microbatches={m}", "model.num_layers=8",
                                f"train.global_batch={m}", "parallel.round_form=cond"])
    assert schedule_stats(forced, "gpu")[0] == pytest.approx(cpu[0])


@pytest.mark.parametrize("form, rows", [("steady", 4), ("cond", 4), ("steady", 2)])
def test_the_plan_counts_the_head_where_the_step_runs_it(form, rows):
    """A GPU's round form with b divisible by p spreads the head over the pipe ranks
    (jaxptd/pipeline/head.py): the plan's compute loses the p - 1 heads a lockstep round
    otherwise takes on every rank, its stash gains the broadcast weights (bf16 here) and
    their float32 gradient sums (6 bytes a head parameter), and its pipe link carries the
    rows and their gradients ((p - 1)/p of b s h each way a microbatch) and the weights'
    two ring all-reduces; b = 2 at p = 4 spreads it by pieces of rows, the same bytes; the
    cond form spreads nothing."""
    from jaxptd.config import load_config
    from jaxptd.model import get
    from jaxptd.plan import PlanInputs, executed_flops, plan, real_counts
    from jaxptd.runtime.target import TARGETS

    p, m, t = 4, 8, 2

    def config_in(round_form):
        return load_config(None, [
            f"parallel.pipe={p}", f"parallel.tensor={t}", f"parallel.microbatches={m}",
            "model.num_layers=8", f"train.global_batch={m * rows}", "model.dtype=bfloat16",
            f"parallel.round_form={round_form}"])
    config = config_in(form)
    spread = form == "steady"
    hw = TARGETS["h100"]
    report = plan(config, PlanInputs(hw, 0.5 * hw.peak_bf16, "gpu"))
    counts = real_counts(config)
    model = config.model
    s, h = model.seq_len, model.hidden_size
    head = 3 * m * rows * s * get(model).forward_flops(model, counts["vocab_padded"])["head"]
    flops = (executed_flops(config, counts["vocab_padded"]) + (0 if spread else (p - 1) * head)) \
        / config.num_devices
    bubble = report["bubble_fraction"]
    assert report["step_time_s"]["compute"] == pytest.approx(
        flops / (0.5 * hw.peak_bf16) * (1 + bubble))
    comm = report["comm_bytes"]
    rows_bytes = 2 * (p - 1) / p * rows * s * h * 2
    weights = 2 * 2 * (p - 1) / p * 4 * counts["head_params"]
    assert counts["head_params"] > 0
    assert comm["head_per_microbatch"] == pytest.approx(rows_bytes if spread else 0)
    assert comm["head_per_step"] == pytest.approx(weights if spread else 0)
    without = plan(config_in("cond"), PlanInputs(hw, 0.5 * hw.peak_bf16, "gpu"))  # (1F1B:
    # the same slots in both forms)
    extra = report["memory_bytes_per_device"]["stash"] \
        - without["memory_bytes_per_device"]["stash"]
    assert extra == pytest.approx(6 * counts["head_params"] if spread else 0)
