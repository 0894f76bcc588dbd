"""The planner's model of a mixture of experts (jaxptd/plan/) against hand computation on
a tiny MoE config: total and active parameters and their shards from the real shapes,
the rows of a layer (dropless, worst case, capacity), its activations, the MLP's FLOPs a
token, the all-to-all's bytes and seconds, the experts' gradients reduced over their own
replicas, the imbalance headroom, and `--search` trying parallel.expert for a MoE config
only."""
import json

import pytest

from jaxptd import model as models
from jaxptd.config import load_config
from jaxptd.model.moe import active_mlp_flops
from jaxptd.plan import model as plan_model
from jaxptd.plan import real_counts
from jaxptd.plan import timing as plan_time

from test_plan import run_main, verify_in_subprocess

# llama, L = 2, h = 64, E = 4 routed experts of width fe = 32, top 2, a shared expert of
# fs = 48; 4 data ranks of b = 2 rows of s = 32 tokens: T = 64 tokens, A = 128 routed rows
L, H, E, K, FE, FS, B_ROWS, S = 2, 64, 4, 2, 32, 48, 2, 32
TINY = ["model.arch=llama", f"model.num_layers={L}", f"model.hidden_size={H}",
        "model.num_heads=4", f"model.seq_len={S}", "model.vocab_size=256",
        "train.global_batch=8", "parallel.data=4"]
MOE = [f"model.moe_experts={E}", f"model.moe_top_k={K}", f"model.moe_ffn={FE}",
       f"model.moe_shared_ffn={FS}"]
T, A = B_ROWS * S, B_ROWS * S * K
FLAT = ["--device-tflops", "494.5"]  # the flat time model: the links at their given rates


def moe(**kw):
    return plan_model.Moe(experts=E, top_k=K, ffn=FE, shared_ffn=FS, **kw)


def report(capsys, *overrides):
    return json.loads(run_main(capsys, TINY + MOE + list(overrides)
                               + ["--intra-gbs", "100", "--json", *FLAT], status=None))


def test_parameters_total_active_and_shards_from_the_real_shapes():
    """The MoE llama is the dense one of ffn = fs (its MLP the shared expert) plus, a
    layer, the router h E and E SwiGLU experts 3 h fe: 84288 + 2 (256 + 24576) = 133952,
    of which a token uses all but (E - k)/E of the experts' 49152: 109376. On a device the
    experts' leaves are split over parallel.expert (and over tensor by their width), the
    rest not; ZeRO-1 splits the moments over the mesh's data axis, d / e = 2 replicas."""
    def counts(*extra):
        return real_counts(load_config(None, TINY + MOE + list(extra)))
    dense = real_counts(load_config(None, TINY + [f"model.ffn_size={FS}"]))["params_model"]
    experts = L * E * 3 * H * FE
    one = counts()
    assert one["params_model"] == dense + L * (H * E + experts // L) == 133952
    assert one["params_experts"] == experts
    assert one["params_active"] == one["params_model"] - experts * (E - K) / E == 109376
    assert one["weight_params"] == one["params_model"]
    two = counts("parallel.expert=2")
    assert two["expert_weight_params"] == experts / 2
    assert two["weight_params"] == one["params_model"] - experts / 2
    tensor = counts("parallel.expert=2", "parallel.tensor=2")
    assert tensor["expert_weight_params"] == experts / 4
    zero1 = counts("parallel.expert=2", "optimizer.zero1=true")
    assert zero1["moment_params"] == 2 * two["weight_params"] / 2
    assert zero1["expert_moment_params"] == 2 * experts / 2 / 2


def test_rows_dropless_worst_case_and_capacity():
    """Dropless, balanced: A = 128 rows a rank's experts take; with 2 expert ranks the
    layer's buffers hold all of both ranks' rows, 256. Capacity factor 1.25: each of the
    4 experts ceil(1.25 x 128 / 4) = 40 slots, 160 whatever e and the routing."""
    assert plan_model.moe_rows(T, moe()) == {"routed": 128, "balanced": 128, "allocated": 128}
    assert plan_model.moe_rows(T, moe(ep=2)) == {
        "routed": 128, "balanced": 128, "allocated": 256}
    assert plan_model.moe_rows(T, moe(ep=2, capacity=1.25)) == {
        "routed": 128, "balanced": 160, "allocated": 160}
    assert plan_model.moe_rows(T, moe(capacity=1.3))["allocated"] == 4 * 42  # ceil(41.6)


def test_moe_layer_activations_by_hand():
    """t = 2, bfloat16, SwiGLU, e = 2: the router's float32 logits and scores [64, 4] and
    its float32 input [64, 64]: 18 KiB; the experts' rows [256, 64] x 2 bytes = 32 KiB and
    their gate, up and product [256, 16] x 3 = 24 KiB (balanced: 128 rows, half); the
    outputs back [128, 64] 16 KiB; the shared expert's gate and up [64, 24] x 2 = 6 KiB.
    The layer keeps that in place of the dense MLP's [b s, ffn/t] x 2."""
    allocated = 18432 + 32768 + 24576 + 16384 + 6144
    assert plan_model.moe_mlp_bytes(T, H, 2, 2, moe(ep=2), gated=True) == allocated
    assert plan_model.moe_mlp_bytes(T, H, 2, 2, moe(ep=2, balanced=True), gated=True) \
        == allocated - 16384 - 12288
    # GeLU experts keep fc1's float32 output and the GeLU's [128, 16], the shared fc1's
    assert plan_model.moe_mlp_bytes(T, H, 2, 2, moe(), gated=False) \
        == 18432 + 16384 + 128 * 16 * (4 + 2) + 16384 + 3072
    # float32: the router reads the norm output itself
    assert plan_model.moe_mlp_bytes(T, H, 1, 4, moe(), gated=True) \
        == 2048 + 32768 + 128 * 32 * 12 + 32768 + 64 * 48 * 2 * 4
    layer = plan_model.layer_activation_bytes
    dense = layer(B_ROWS, S, H, 4, 2, 2, ffn=FE, gated=True)
    assert layer(B_ROWS, S, H, 4, 2, 2, ffn=FE, gated=True, moe=moe(ep=2)) == pytest.approx(
        dense - T * FE / 2 * 2 * 2 + allocated)
    # full recomputation keeps the layer input only, MoE or not
    assert layer(B_ROWS, S, H, 4, 2, 2, remat="full", moe=moe()) == layer(
        B_ROWS, S, H, 4, 2, 2, remat="full")


def test_moe_flops_from_active_parameters(capsys):
    """A token through one MoE MLP: router 2 h E = 512, 2 SwiGLU experts of 6 h fe = 12288
    each, the shared expert 6 h fs = 18432: 43520 (GeLU experts 4 h fe, 4 h fs: 34816;
    Qwen2-MoE's shared gate 2 h more). The families' forward_flops put it in place of the
    dense MLP's 6 h f (GeLU 4 h f), and the plan's FLOPs are 3 B s of those a layer."""
    cfg = load_config(None, TINY + MOE).model
    assert active_mlp_flops(cfg, 6) == 512 + 2 * 12288 + 18432
    assert active_mlp_flops(cfg, 4) == 512 + 2 * 8192 + 12288
    gate = load_config(None, TINY + MOE + ["model.moe_shared_gate=true"]).model
    assert active_mlp_flops(gate, 6) == 43520 + 128
    for arch, per_width in (("llama", 6), ("gpt", 4)):
        moe_cfg = load_config(None, TINY + MOE + [f"model.arch={arch}"]).model
        dense = load_config(None, TINY + [f"model.arch={arch}", "model.ffn_size=1"]).model
        layer = models.get(moe_cfg).forward_flops(moe_cfg, 256)["layer"]
        assert layer - models.get(dense).forward_flops(dense, 256)["layer"] == \
            active_mlp_flops(moe_cfg, per_width) - per_width * H
    r, d = report(capsys), json.loads(run_main(capsys, TINY + ["--json"]))
    assert r["flops_per_iteration"] - d["flops_per_iteration"] == pytest.approx(
        3 * 8 * S * L * (43520 - 6 * H * 4 * H))  # the dense MLP: ffn = 4h


def test_every_other_layer_a_mixture(capsys):
    """model.moe_every = 2 (L = 2: a dense layer of ffn 4h, then the mixture): half the
    experts' parameters and all-to-all bytes; a layer's FLOPs and activations the mean of
    the dense layer's and the mixture's (full recomputation: a unit keeps its input)."""
    every, full = (report(capsys, "parallel.expert=2", *extra) for extra in
                   (["model.moe_every=2"], []))
    assert every["moe"]["every"] == 2 and full["moe"]["every"] == 1
    assert every["moe"]["params_experts"] == full["moe"]["params_experts"] / 2
    assert every["comm_bytes"]["expert_per_microbatch"] == \
        full["comm_bytes"]["expert_per_microbatch"] / 2
    flops = {name: models.get(cfg).forward_flops(cfg, 256)["layer"] for name, cfg in (
        (name, load_config(None, TINY + extra).model) for name, extra in
        (("every", MOE + ["model.moe_every=2"]), ("moe", MOE), ("dense", [])))}
    assert flops["every"] == (flops["moe"] + flops["dense"]) / 2
    layer, f = plan_model.layer_activation_bytes, 4 * H
    assert layer(B_ROWS, S, H, 4, 2, 2, ffn=f, gated=True, moe=moe(ep=2, every=2)) == (
        layer(B_ROWS, S, H, 4, 2, 2, ffn=f, gated=True, moe=moe(ep=2))
        + layer(B_ROWS, S, H, 4, 2, 2, ffn=f, gated=True)) / 2
    assert layer(B_ROWS, S, H, 4, 2, 2, remat="full", moe=moe(every=2)) == layer(
        B_ROWS, S, H, 4, 2, 2, remat="full") / 2


def test_all_to_all_bytes_and_time_by_hand(capsys):
    """Each of the 2 layers sends A h = 128 x 64 float32 = 32 KiB four times a microbatch
    (dispatch, combine, forward and backward), half of it to the other expert rank: 128
    KiB; over 100 GB/s intra-node links (e t = 2 <= 8 GPUs) 1.31 us, not overlapped. Full
    recomputation runs the forward's two again; a capacity factor sends its buffer's E C
    rows; one expert rank sends nothing."""
    message = A * H * 4
    volumes = plan_time.moe_volumes(rows=A, h=H, e=4, ep=2, layers_per_stage=L)
    assert volumes == {"message": message, "per_microbatch": L * 4 * message / 2}
    r = report(capsys, "parallel.expert=2")
    assert r["comm_bytes"]["expert_per_microbatch"] == L * 4 * message / 2
    assert r["step_time_s"]["expert"] == pytest.approx(L * 4 * message / 2 / 100e9)
    assert r["moe"]["all_to_all_s"] == r["step_time_s"]["expert"]
    assert r["moe"]["link"] == "intra" and r["moe"]["overlapped"] is False
    full = report(capsys, "parallel.expert=2", "model.remat=full")
    assert full["comm_bytes"]["expert_per_microbatch"] == L * 6 * message / 2
    capacity = report(capsys, "parallel.expert=4", "model.moe_capacity=1.25")
    assert capacity["comm_bytes"]["expert_per_microbatch"] == L * 4 * 160 * H * 4 * 3 / 4
    assert report(capsys)["comm_bytes"]["expert_per_microbatch"] == 0
    # 16 expert ranks x 1 context x 1 tensor do not fit an 8-GPU node (a) over inter links
    wide = json.loads(run_main(capsys, TINY[:-1] + MOE[1:] + [
        "model.moe_experts=16", "parallel.data=16", "train.global_batch=32",
        "parallel.expert=16", "--intra-gbs", "100", "--inter-gbs", "10", "--json", *FLAT],
        status=None))
    assert wide["moe"]["link"] == "inter"
    assert wide["step_time_s"]["expert"] == pytest.approx(
        wide["comm_bytes"]["expert_per_microbatch"] / 10e9)


def test_experts_gradients_reduce_over_their_replicas(capsys):
    """Of 100 gradient bytes on 8 data ranks 40 are the experts', which 2 expert ranks
    split: the 60 all-reduced over 8 replicas (2 x 7/8 x 60 = 105), the 40 over the 2
    ranks that hold the same experts (2 x 1/2 x 40 = 40). The tiny config with e = 2 of
    4 data ranks: its 84800 float32 other parameters over 4, its 24576 experts' over 2."""
    volumes = plan_time.comm_volumes(b=1, s=8, h=4, t=1, e=2, layers_per_stage=1,
                                     grad_bytes=100, replicas=8, expert_grad_bytes=40,
                                     expert_replicas=2)
    assert volumes["data_per_step"] == pytest.approx(105 + 40)
    r = report(capsys, "parallel.expert=2")
    assert r["comm_bytes"]["data_per_step"] == pytest.approx(
        2 * 3 / 4 * 4 * 84800 + 2 * 1 / 2 * 4 * 24576)


def test_imbalance_headroom_by_hand(capsys):
    """Without recomputation, m = 1: every layer keeps its experts' rows and intermediates
    and the backward holds half a layer more, so the worst routing's e A rows (not A) add
    (L + 1/2) (e - 1) A (h + 3 fe) float32 bytes: 2.5 x 128 x 160 x 4 with e = 2, which the
    plan counts (the layer allocates them). Capacity mode and e = 1: none."""
    r = report(capsys, "parallel.expert=2")
    assert r["moe"]["rows"] == {"routed": A, "balanced": A, "allocated": 2 * A}
    assert r["moe"]["imbalance_headroom"] == pytest.approx((L + 0.5) * A * (H + 3 * FE) * 4)
    assert r["moe"]["balanced_bytes"] == pytest.approx(
        r["memory_bytes_per_device"]["total"] - r["moe"]["imbalance_headroom"])
    assert report(capsys)["moe"]["imbalance_headroom"] == 0
    assert report(capsys, "parallel.expert=2", "model.moe_capacity=1.0"
                  )["moe"]["imbalance_headroom"] == 0


def test_text_report_prints_experts_and_headroom(capsys):
    out = run_main(capsys, TINY + MOE + ["parallel.expert=2"], status=None)
    assert "experts     E=4 top-2" in out and "expert ranks e=2" in out
    assert "params total 0.0001 B, active 0.0001 B" in out
    assert "all-to-all" in out and "not overlapped" in out and "imbalance headroom" in out
    assert "experts " not in run_main(capsys, TINY, status=None)


def test_search_tries_expert_ranks_for_a_moe_config_only(capsys):
    """8 GPUs: the MoE config's rows include expert ranks e > 1 (dividing d and E = 4), with
    parallel.expert among their overrides; the dense config's never."""
    argv = TINY[:-1] + ["--search", "8", "--json", "--top", "10000"]
    rows = json.loads(run_main(capsys, argv[:-5] + MOE + argv[-5:]))
    assert {r["expert"] for r in rows} == {1, 2, 4}
    for r in rows:
        assert r["data"] % r["expert"] == 0 and E % r["expert"] == 0
        assert f"parallel.expert={r['expert']}" in r["overrides"]
    dense = json.loads(run_main(capsys, argv))
    assert dense and {r["expert"] for r in dense} == {1}


@pytest.mark.slow
def test_capacity_moe_memory_matches_compiled_step():
    """--verify on 2 simulated CPU devices, float32: a capacity-mode MoE (its experts one
    batched matmul over [E, C] slots), with and without 2 expert ranks, plans within 20%
    of the compiled step as the dense model of the same size does (measured plan / XLA:
    dense 0.81, MoE 0.83, with e = 2 0.86). The parameters match to the byte's rounding,
    the experts split over e.
    (Dropless, XLA's CPU lowers lax.ragged_dot to a product over every expert, about
    twice the temporaries the plan's grouped GEMMs keep: not what a GPU with grouped
    GEMMs allocates, so not compared here.)"""
    base = ["model.arch=llama", "model.num_layers=2", "model.hidden_size=256",
            "model.num_heads=4", "model.seq_len=512", "model.vocab_size=512",
            "train.global_batch=8", "parallel.data=2", "runtime.cpu_devices=2"]
    moe_keys = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn=512",
                "model.moe_capacity=1.0"]
    reports = verify_in_subprocess([moe_keys, moe_keys + ["parallel.expert=2"]], base=base)
    assert len(reports) == 2
    for r in reports:
        v = r["verify"]
        assert v["memory_ratio"] == pytest.approx(1.0, abs=0.2), r["layout"]
        assert v["planned_arguments"] == pytest.approx(v["xla_memory"]["argument"], rel=1e-3)
    assert reports[1]["verify"]["planned_arguments"] < reports[0]["verify"]["planned_arguments"]
