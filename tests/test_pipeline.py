"""Pipeline executor: parity with the single-device program for every schedule, stash mode
and round form (gradients, training steps, dropout masks), the ends' slots and the head
spread over the pipe ranks. The unrolled layers, the forward-only eval, bounded memory,
the point-to-point traffic and the CUDA-lowered rounds: tests/test_pipeline_program.py
(a file of its own, so that pytest-xdist's --dist loadfile balances the two). (A
pipelined `python -m jaxptd.train` run against the plain one: tests/test_memory.py's
command-line test.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_grads_match_single_device, assert_steps_match_single_device,
                     assert_trees_close, fixed_batches, make_setup, placed_state,
                     reference_loss_and_grads)
from jaxptd.config import ConfigError, load_config
from jaxptd.train.step import build_train_step


# (data, pipe, tensor, schedule, chunks, microbatches, layers): m = 1, m < p, m = p, m not a
# multiple of p, p up to 8, v from 1 to 4, with data and tensor parallelism inside the
# stages. (Each case compiles its own step: the grid is what the suite's time allows.)
CASES = [
    (1, 2, 1, "1f1b", 1, 1, 4),
    (2, 2, 2, "1f1b", 1, 4, 4),
    (1, 8, 1, "gpipe", 1, 3, 8),
    (2, 2, 2, "gpipe", 1, 2, 4),
    (1, 4, 2, "interleaved", 2, 5, 8),
    (1, 2, 1, "interleaved", 3, 3, 6),
    (2, 2, 2, "interleaved", 4, 2, 8),
]
# Zero-bubble, 8 layouts of each (zb-h1: 10): m = p, m < p, m not a multiple of p, data
# and tensor inside the stages; zb-h1 with one action a round (2 <= m < 2p - 2: p = m = 3,
# p = m = 4, p = 4 m = 5, p = 5 m = 6, p = m = 8, p = 4 m = 2) and with W's in the slots.
# zb-v at p = 4 (its (2, 2, 2) with SP: SPREAD's; with FSDP and context: tests/
# test_context.py's; with experts: tests/test_moe.py's).
ZB_CASES = [
    (1, 2, 1, "zb-h1", 1, 2, 4),
    (1, 4, 1, "zb-h1", 1, 4, 4),
    (1, 4, 2, "zb-h1", 1, 5, 4),
    (2, 2, 2, "zb-h1", 1, 3, 4),
    (1, 2, 4, "zb-h1", 1, 6, 4),
    (1, 8, 1, "zb-h1", 1, 8, 8),
    (2, 4, 1, "zb-h1", 1, 2, 4),
    (1, 4, 1, "zb-h1", 1, 1, 4),
    (1, 3, 1, "zb-h1", 1, 3, 3),
    (1, 5, 1, "zb-h1", 1, 6, 5),
    (1, 2, 4, "zb-interleaved", 2, 4, 4),
    (1, 4, 2, "zb-interleaved", 2, 5, 8),
    (1, 4, 1, "zb-interleaved", 2, 4, 8),
    (1, 2, 1, "zb-interleaved", 3, 3, 6),
    (2, 2, 2, "zb-interleaved", 4, 2, 8),
    (1, 2, 2, "zb-interleaved", 2, 2, 4),
    (2, 2, 1, "zb-interleaved", 2, 5, 4),
    (1, 4, 1, "zb-interleaved", 2, 1, 8),
    (1, 4, 1, "zb-v", 2, 8, 8),  # m 8: its two-round scans' head in one phase of the two
]
FAST = {CASES[1], ZB_CASES[11]}  # kept activations, auto form; the rest: -m slow


def _param(stash, case, form="auto"):
    fast = case in FAST and form == "auto" and stash == "activations"
    marks = () if fast else (pytest.mark.slow,)
    return pytest.param(stash, case, form, marks=marks,
                        id="-".join(map(str, (stash, form) + case)))


# the layouts whose lowering and simulation tests/test_lowering.py and test_schedules.py
# check as data, left out of the executor's grid (the suite's time): interleaved v = 3 (the
# unrolled grid's); zb-h1 at p = m = 2 (p = m = 4 and p = 2 m = 3 run), p = 2 t = 4, p = 4
# m = 2 with data, p = m = 3, p = 5 m = 6; zb-interleaved at p = 4 m = 4 (m = 5 with t = 2
# runs, kept and recomputed), p = 2 t = 4, v = 3, p = 2 t = 2, m = 5 with data, and m = 1 at
# p = 4
OMITTED = {CASES[5], *(ZB_CASES[i] for i in (0, 4, 6, 8, 9, 10, 12, 13, 15, 16, 17))}
# in the masked form only (its own lowering of the same schedule): GPipe with data and tensor
# (the cond form's GPipe: p = 8), zb-interleaved at v = 4 (the cond form's v = 4:
# interleaved's)
MASKED_ONLY = {CASES[3], ZB_CASES[14]}
# in the steady form only (a GPU's, in the tests with its layers unrolled): zb-v at p = 4,
# whose odd ranks hold their chunks swapped (pipeline/static_chunks.py)
STEADY_ONLY = {ZB_CASES[18]}
PARITY = ([_param("activations", c) for c in CASES + ZB_CASES
           if c not in OMITTED | MASKED_ONLY | STEADY_ONLY]
          + [_param("inputs", c) for c in (CASES[4], ZB_CASES[1], ZB_CASES[11])]
          + [_param("activations", c, "steady") for c in (CASES[1], ZB_CASES[3], ZB_CASES[18])]
          + [_param("inputs", ZB_CASES[2], "steady"), _param("activations", CASES[3], "masked"),
             # p = 8: the last stage's B's that run again read the head's kept gradient
             _param("activations", ZB_CASES[5], "steady"), _param("inputs", ZB_CASES[5], "steady"),
             _param("activations", ZB_CASES[14], "masked")])


def pipelined_setup(data, pipe, tensor, schedule, chunks, micro, layers, extra=()):
    return make_setup(data, pipe, tensor, [
        f"parallel.schedule={schedule}", f"parallel.chunks={chunks}",
        f"parallel.microbatches={micro}", f"model.num_layers={layers}",
        f"train.global_batch={2 * data * micro}", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("form", ["cond", "steady"])
def test_ends_live_where_they_are_read_and_stay_there(form):
    """Pipelined, each ends leaf is held in the slot of the stage that reads it: after two
    optimizer steps (weight decay on, gradients clipped) GPT's tied embedding is equal in
    the first and last stage's slots, positions in the first only, the final norm in the
    last only, every other slot still exactly zero, and the step's gradient norm is the
    single-device one (the tied gradient counted once); also where every rank runs the
    head on its rows (steady, b = p: the head's gradients go back to the last slot)."""
    from jaxptd.train.step import pipeline_context
    import optax

    p = 4
    setup = pipelined_setup(1, p, 1, "1f1b", 1, 4, 4, [
        "optimizer.clip_norm=0.5", f"parallel.round_form={form}", "train.global_batch=16"])
    assert pipeline_context(setup).spread_head == (form == "steady")
    state, step = placed_state(setup), build_train_step(setup)
    batches = fixed_batches(setup.config, 2)
    _, ref_grads = reference_loss_and_grads(
        setup.config, setup.vocab, jax.device_get(setup.state_layout.to_logical(state["params"])),
        batches[0])
    norms = []  # (the step's own: StateLayout.grad_norm of the first step's gradients)
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_allclose(norms[0], float(optax.tree.norm(ref_grads)), rtol=1e-5)
    params = jax.device_get(state["params"])
    wte, wpe = params["embed"]["wte"], params["embed"]["wpe"]  # [p, ...]
    np.testing.assert_array_equal(wte[0], wte[p - 1])
    for leaf, held in [(wte, {0, p - 1}), (wpe, {0}), (params["final_norm"]["scale"], {p - 1})]:
        assert all(np.any(leaf[r]) == (r in held) for r in range(p)), leaf.reshape(p, -1)[:, :3]


@pytest.mark.parametrize("stash, case, form", PARITY)
def test_pipelined_gradients_match_single_device(stash, case, form):
    # zb-v with its layers unrolled: its rounds' scans two rounds a step, the chunks static
    unrolled = ["model.scan_layers=false"] if case[3] == "zb-v" else []
    setup = pipelined_setup(*case, extra=[f"parallel.stash={stash}",
                                          f"parallel.round_form={form}", *unrolled])
    assert_grads_match_single_device(setup)



def test_unwritten_buffers_hold_garbage_and_gradients_stay_exact(monkeypatch):
    """The buffers a GPU leaves unwritten (lax.empty: what F keeps for B, under the
    lowering's b_reads_written) are zeros on CPU, so the parity tests cannot see a slot
    read before any F wrote it. Filled with NaN (integers with their maximum), the
    lockstep round form's idle slots, which run on every rank and are masked, must still
    give the single-device gradients: no NaN reaches a sum."""
    from jaxptd.pipeline.executor import rounds_for
    from jaxptd.train.step import pipeline_context

    def garbage(shape, dtype):
        fill = jnp.nan if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max
        return jnp.full(shape, fill, dtype)

    monkeypatch.setattr(jax.lax, "empty", garbage)
    # zb-h1 with data and tensor inside the stages (B's and W's slots, 1F1B's B)
    setup = pipelined_setup(2, 2, 2, "zb-h1", 1, 3, 4, extra=["parallel.round_form=steady"])
    c = pipeline_context(setup)
    # the buffers are left unwritten
    assert rounds_for(c.schedule, c.pipe, c.microbatches, c.chunks, c.round_form).b_reads_written
    assert_grads_match_single_device(setup)

# The head spread over the pipe ranks (round forms without conditionals, b % p == 0:
# jaxptd/pipeline/head.py; PARITY's steady and masked cases at p = 2 spread it too): p = 4
# with interleaving (the last rank's B slots of its other chunk run no head), the stage
# recomputed (the head inside the B slot's vjp: BERT's and the packed pieces' cases), zb-v
# (the head, the last stage's, on rank 0) with data, tensor and SP, its layers unrolled
# (static_chunks' held chunks), FSDP
# with sequence parallelism, the untied head of Llama (its embedding read by the first stage
# alone), BERT's heads, and context parallelism (each rank's rows hold s/c of their tokens)
# with SP.
LLAMA = ["model.arch=llama", "model.ffn_size=24", "model.num_kv_heads=4"]
SPREAD = [
    pytest.param((1, 4, 1, "interleaved", 2, 8, 8), "activations", [], id="interleaved-p4"),
    pytest.param((2, 2, 2, "1f1b", 1, 2, 4), "activations",
                 ["parallel.fsdp=true", "parallel.sequence_parallel=true"], id="fsdp-sp",
                 marks=pytest.mark.slow),
    pytest.param((2, 2, 2, "zb-v", 2, 2, 4), "activations",
                 ["parallel.sequence_parallel=true", "model.scan_layers=false"], id="zb-v-sp",
                 marks=pytest.mark.slow),
    pytest.param((1, 2, 2, "zb-h1", 1, 3, 4), "activations", LLAMA, id="llama-zb",
                 marks=pytest.mark.slow),
    pytest.param((1, 2, 1, "1f1b", 1, 2, 4), "inputs", ["model.arch=bert"], id="bert",
                 marks=pytest.mark.slow),
    pytest.param((1, 2, 2, "1f1b", 1, 2, 4), "activations",
                 ["parallel.context=2", "parallel.sequence_parallel=true"], id="context-sp",
                 marks=pytest.mark.slow),
    # fewer rows than ranks: each row cut into pieces of its tokens (b 2 at p 4; b 1 at p 4
    # with SP, a piece's tokens split over tensor again, packed rows' masks by piece, the
    # stage recomputed from its stashed input)
    pytest.param((1, 4, 1, "1f1b", 1, 4, 4), "activations", ["train.global_batch=8"],
                 id="pieces-b2-p4", marks=pytest.mark.slow),
    pytest.param((1, 4, 2, "zb-h1", 1, 4, 4), "inputs",
                 ["train.global_batch=4", "parallel.sequence_parallel=true",
                  "model.document_end=7"], id="pieces-b1-sp-packed", marks=pytest.mark.slow)]


@pytest.mark.parametrize("case, stash, extra", SPREAD)
def test_spread_head_matches_single_device(case, stash, extra):
    """Each pipe rank runs the head on 1/p of the last stage's rows, or of pieces of them
    (an all-to-all in the program, none in the cond form's): the single-device loss and
    gradients."""
    from jaxptd.train.step import pipeline_context

    data, pipe, micro = case[0], case[1], case[5]
    setup = pipelined_setup(*case, extra=[
        f"parallel.stash={stash}", "parallel.round_form=steady",
        f"train.global_batch={pipe * data * micro}", *extra])
    context = pipeline_context(setup)
    rows = setup.config.microbatch_size
    assert context.head_pieces == (1 if rows % pipe == 0 else pipe // rows)
    assert_grads_match_single_device(setup)


@pytest.mark.slow
def test_uncut_steady_scans_match_single_device(monkeypatch):
    """SPREAD's interleaved-p4 with the stretches of rounds that need no head left in their
    scans (scans.HEAD_SHARE above any head's share, as at PTD-P's sizes): every steady
    round runs the head, the rounds without the last stage's B discarding it."""
    from jaxptd.pipeline import scans
    from jaxptd.train.step import pipeline_context

    monkeypatch.setattr(scans, "HEAD_SHARE", float("inf"))
    setup = pipelined_setup(1, 4, 1, "interleaved", 2, 8, 8, extra=[
        "parallel.round_form=steady", "train.global_batch=32"])
    assert pipeline_context(setup).headless == 0
    assert_grads_match_single_device(setup)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, chunks, extra", [
    ("interleaved", 2, "optimizer.zero1=true"),
    ("zb-interleaved", 2, "optimizer.overlap_grad_reduce=true")])
def test_pipelined_training_steps_match_single_device(schedule, chunks, extra):
    """Three optimizer steps (ZeRO-1, or all-reduced) give the single-device losses; with
    v = 2 each chunk's gradients reduced as soon as its backwards are done. Two layers a
    chunk: ZeRO-1 splits a layer leaf [v, 1, Lc, ...] on Lc (StateLayout.grads_specs), so
    each chunk's reduce-scatter, the update and the gather of the masters run on it."""
    setup = pipelined_setup(2, 2, 2, schedule, chunks, 2, 8, [extra])
    assert setup.config.reduces_chunks_early
    if setup.config.optimizer.zero1:
        spec = setup.state_layout.grads_specs["layers"]["mlp"]["w_fc1"]
        assert spec[2] == "data", spec
    assert_steps_match_single_device(setup)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, chunks", [("zb-interleaved", 2)])
def test_kept_backward_uses_each_microbatchs_dropout_masks(schedule, chunks):
    """With dropout, the kept backward (stash=activations) reads each microbatch's own
    boolean dropout masks: its gradients equal the stage recomputation's (stash=inputs),
    which draws them again from the microbatch's key. A backward that kept one trace's
    masks for every microbatch (what jax.closure_convert does to boolean values) fails
    this by far (measured: elements off by 20x and more)."""
    from jaxptd.train.step import build_grads

    def grads(stash):
        setup = pipelined_setup(1, 2, 1, schedule, chunks, 3, 4, [
            "model.dropout=0.2", f"parallel.stash={stash}"])
        state = placed_state(setup)
        batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
        out = jax.jit(build_grads(setup, deterministic=False))(
            state["params"], batch, state["rng"], state["step"], jnp.float32(1))
        return jax.device_get(setup.state_layout.to_logical(out[0])), float(out[1])

    (kept, kept_loss), (recomputed, loss) = grads("activations"), grads("inputs")
    np.testing.assert_allclose(kept_loss, loss, rtol=1e-6)
    assert_trees_close(kept, recomputed)


def test_bad_pipeline_configs_are_refused():
    with pytest.raises(ConfigError, match="model.num_layers=4: must be divisible"):
        load_config(None, ["parallel.pipe=4", "parallel.chunks=2",
                           "parallel.schedule=interleaved", "model.num_layers=4"])
    with pytest.raises(ConfigError, match="parallel.chunks=2: more than one chunk"):
        load_config(None, ["parallel.pipe=2", "parallel.chunks=2", "model.num_layers=4"])
