"""The pipelined step as a program (tests/test_pipeline.py's executor parity, split off so
that pytest-xdist's --dist loadfile balances the two files): unrolled layers (a GPU
target's default) against the single-device program with each recomputation policy, the
forward-only eval's loss and its rounds, the layers each rank holds, bounded memory for
1f1b, interleaved and zero-bubble, the point-to-point traffic the schedule implies, no
conditional in the steady-state rounds of the CUDA-lowered step, and no matmul that waits
for a message of its own round."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from helpers import assert_grads_match_single_device, fixed_batches, reference_loss
from jaxptd.parallel.mesh import PIPE
from jaxptd.pipeline.executor import rounds_for
from jaxptd.pipeline.scans import segments
from jaxptd.pipeline.schedules import make_schedule
from jaxptd.pipeline.simulate import simulate
from jaxptd.train.step import build_eval_step, build_train_step
from test_pipeline import CASES, LLAMA, ZB_CASES, pipelined_setup


# The fast subset keeps two cases (the kept backward a layer at a time with SP, ZeRO-1's
# early reduction and minimal_mlp; the recomputed stage); the full suite runs them all.
@pytest.mark.parametrize("stash, case, remat, more", [
    pytest.param("activations", CASES[1], "none", [], marks=pytest.mark.slow),
    pytest.param("activations", ZB_CASES[11], "minimal", [], marks=pytest.mark.slow),
    pytest.param("activations", CASES[3], "full", [], marks=pytest.mark.slow),
    pytest.param("activations", CASES[1], "minimal", ["parallel.sequence_parallel=true"],
                 marks=pytest.mark.slow),
    pytest.param("activations", CASES[1], "none", ["parallel.sequence_parallel=true"],
                 marks=pytest.mark.slow),
    ("activations", CASES[1], "minimal_mlp", ["parallel.sequence_parallel=true",
                                              "optimizer.zero1=true"]),
    pytest.param("activations", CASES[3], "full", ["parallel.sequence_parallel=true"],
                 marks=pytest.mark.slow),
    pytest.param("activations", CASES[0], "none", ["model.moe_experts=4"],
                 marks=pytest.mark.slow),
    pytest.param("activations", CASES[1], "none", ["model.moe_experts=4"],
                 marks=pytest.mark.slow),
    pytest.param("activations", CASES[5], "minimal", [], marks=pytest.mark.slow),
    ("inputs", CASES[1], "none", []),
    pytest.param("inputs", (1, 2, 2, "interleaved", 2, 4, 4), "none",
                 ["parallel.sequence_parallel=true"], marks=pytest.mark.slow),
    pytest.param("activations", ZB_CASES[3], "minimal", ["parallel.sequence_parallel=true"],
                 marks=pytest.mark.slow),
    pytest.param("inputs", ZB_CASES[3], "none", ["parallel.sequence_parallel=true", *LLAMA],
                 marks=pytest.mark.slow)])
def test_unrolled_layers_match_single_device(stash, case, remat, more):
    """model.scan_layers=false (a GPU target's default: each layer's kept values in buffers of
    their own, the kept backward closing over per-layer weights it is given again) and the
    steady round form: the single-device gradients, with each recomputation policy; with
    sequence parallelism or one tensor rank the kept backward a layer at a time
    (training.kept_by_layer: stored as F makes it, read by B as it goes, a mixture of
    experts' statistics seeded a layer at a time; with ZeRO-1 and minimal_mlp (q, k, v
    recomputed) the layers' gradients reduced once their last backward is done, from the
    per-layer sums the kept backward a layer at a time adds to (the kept backward of the
    whole chunk adds to them too, a mixture of experts' gradients masked); with remat none
    the middle layer's stores, tensor-invariant kept values among them, wait for the
    message in flight and keep their buffers' types); with stash=inputs the recomputed
    stage's middle layer waits for the message in flight, and the message is stored after
    the slot it travelled beside (executor._steady_recomputed); zero-bubble with sequence
    parallelism: W gathers the column-parallel matmuls' inputs, taped before their
    all-gather (Llama: q and k, v, gate and up each from the same), a layer at a time, and
    the kept backward's perturbations are passed in again, not stored."""
    from jaxptd.pipeline.training import kept_by_layer
    from jaxptd.train.step import pipeline_context

    setup = pipelined_setup(*case, extra=[
        f"parallel.stash={stash}", "parallel.round_form=steady", "model.scan_layers=false",
        f"model.remat={remat}", *more])
    split = case[3].startswith("zb")
    by_layer = ("parallel.sequence_parallel=true" in more or case[2] == 1) and not split \
        and stash == "activations"
    assert kept_by_layer(pipeline_context(setup), split) == by_layer
    assert setup.config.reduces_chunks_early == ("optimizer.zero1=true" in more)
    assert_grads_match_single_device(setup)


def random_params(setup, seed=0):
    """Every leaf drawn N(0, 0.1) on the host, norms included (a stage that ran another
    stage's weights would show) -> (in-memory params in their shardings, logical params)."""
    rng = np.random.default_rng(seed)
    logical = jax.tree.map(lambda x: rng.normal(0.0, 0.1, x.shape).astype(x.dtype),
                           jax.eval_shape(setup.state_layout.to_logical, setup.state_layout.abstract_params))
    return jax.device_put(setup.state_layout.to_stacked(logical), setup.state_layout.state_shardings["params"]), logical


@pytest.mark.parametrize("case, form", [
    pytest.param((1, 4, 1, "1f1b", 1, 8, 4), "auto", marks=pytest.mark.slow),
    ((1, 4, 1, "interleaved", 2, 5, 8), "auto"),
    # steady: a stretch of rounds with no last-stage F runs without the head (scans.HEADLESS)
    pytest.param((1, 4, 1, "interleaved", 2, 5, 8), "steady", marks=pytest.mark.slow),
    pytest.param((2, 2, 2, "gpipe", 1, 2, 4), "auto", marks=pytest.mark.slow),
    pytest.param((1, 4, 1, "zb-h1", 1, 8, 4), "steady", marks=pytest.mark.slow)],
    ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)))
def test_pipelined_eval_loss_matches_single_device(case, form):
    """The forward-only pipeline's loss: 1f1b, interleaved with m not a multiple of p,
    data and tensor parallelism inside the stages, and the steady round form."""
    setup = pipelined_setup(*case, extra=[f"parallel.round_form={form}"])
    params, logical = random_params(setup)
    batch = fixed_batches(setup.config, 1)[0]
    loss = build_eval_step(setup)(params, jax.device_put(batch, setup.batch_sharding))
    expected = reference_loss(setup.config, setup.vocab, logical, batch)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_pipelined_eval_runs_no_backward():
    """The eval program sends activations only (one ppermute; the gradient program has a
    second, backwards) and loops over the forward-only rounds, m + p - 1 for 1f1b, not the
    training schedule's."""
    p, m = 4, 8
    setup = pipelined_setup(1, p, 1, "1f1b", 1, m, 4)
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    params = setup.state_layout.abstract_state()["params"]
    eval_step = build_eval_step(setup)
    assert str(jax.make_jaxpr(eval_step)(params, batch)).count("ppermute[") == 1
    text = eval_step.lower(params, batch).compile().as_text()
    trips = [int(n) for n in re.findall(r'known_trip_count[^0-9]*(\d+)', text)]
    assert max(trips) == m + p - 1 < rounds_for("1f1b", p, m, 1, "cond").num_rounds, trips


def test_layer_assignment_follows_virtual_stages():
    """Rank r holds virtual stages r, r + p, ...: with 4 ranks and 2 chunks of 16 layers,
    rank 0 holds layers 1-2 and 9-10 (PTD-P §2.2.2)."""
    setup = pipelined_setup(1, 4, 1, "interleaved", 2, 4, 16)
    logical = jnp.arange(16.0)[:, None] * jnp.ones((16, 3))
    stacked = setup.state_layout.to_stacked({"layers": logical})["layers"]  # [v, p, Lc, 3]
    rank0 = stacked[:, 0, :, 0].reshape(-1)
    assert rank0.tolist() == [0.0, 1.0, 8.0, 9.0]
    assert setup.state_layout.to_logical({"layers": stacked})["layers"].tolist() == logical.tolist()


def compiled_temp_bytes(schedule, micro, chunks=1, stash="activations"):
    setup = pipelined_setup(1, 4, 1, schedule, chunks, micro, 8,
                            [f"train.global_batch={micro}", "model.seq_len=64",
                             "model.hidden_size=64", f"parallel.stash={stash}"])
    batch = jax.ShapeDtypeStruct((micro, 65), jnp.int32, sharding=setup.batch_sharding)
    compiled = build_train_step(setup).lower(setup.state_layout.abstract_state(), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("schedule, chunks, stash", [
    *[pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("interleaved", 2, "activations"), ("zb-h1", 1, "inputs"), ("1f1b", 1, "inputs"))]])
def test_stash_memory_does_not_grow_with_microbatches(schedule, chunks, stash):
    small = compiled_temp_bytes(schedule, 8, chunks, stash)
    large = compiled_temp_bytes(schedule, 32, chunks, stash)
    assert large < 1.25 * small, (small, large)


@pytest.mark.slow
def test_gpipe_memory_grows_with_microbatches():
    """GPipe keeps every microbatch's activations until its backward: about linear in m."""
    small, large = compiled_temp_bytes("gpipe", 8), compiled_temp_bytes("gpipe", 32)
    assert large > 2.5 * small, (small, large)


# "%x = f32[4,16,16]{1,0,2} collective-permute(...), source_target_pairs={{0,2},{2,4}}"
PERMUTE = re.compile(r"= (\w+)\[([\d,]*)\]\S* collective-permute(?:-start)?\(.*?"
                     r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@pytest.mark.parametrize("chunks, schedule", [
    pytest.param(1, "1f1b", marks=pytest.mark.slow),
    pytest.param(2, "interleaved", marks=pytest.mark.slow), (1, "zb-h1")])
def test_point_to_point_traffic_matches_schedule(chunks, schedule):
    """Two collective-permutes per round, each [b, s, h/t] (scatter/gather), along the chain
    (ring when interleaved); rounds x ranks sends cover the schedule's m (p v - 1) messages.
    Once per step the tied embedding's gradient [1, V/t, h] goes between the first and
    the last stage only, both ways (Megatron's embedding group), no reduction over pipe."""
    p, t, m = 4, 2, 4
    setup = pipelined_setup(1, p, t, schedule, chunks, m, 8)
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    text = build_train_step(setup).lower(setup.state_layout.abstract_state(), batch).compile().as_text()
    tied = f"1,{setup.vocab // t},{config.model.hidden_size}"
    permutes = [x for x in PERMUTE.findall(text) if x[1] != tied]
    [(_, _, ends_pairs)] = [x for x in PERMUTE.findall(text) if x[1] == tied]
    pipe_axis = setup.mesh.axis_names.index(PIPE)
    first, last = (sorted(d.id for d in np.take(setup.mesh.devices, [r], pipe_axis).flat)
                   for r in (0, p - 1))
    pairs = {tuple(map(int, pair.split(","))) for pair in re.findall(r"\d+,\d+", ends_pairs)}
    assert pairs == {*zip(first, last), *zip(last, first)}, ends_pairs
    moved = [op for shapes, op in re.findall(  # data = 1: nothing else moves the embedding
        r"= (\(?[^=]*?\)?) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-"
        r"permute)(?:-start)?\(", text) if f"[{tied}]" in shapes or f"[{tied[2:]}]" in shapes]
    assert moved == ["collective-permute"], moved  # (the gradient norm's is per slot)
    assert len(permutes) == 2, permutes
    b = config.train.global_batch // m
    for dtype, dims, pairs in permutes:
        assert dtype == "f32"
        assert [int(d) for d in dims.split(",")] == [b, config.model.seq_len,
                                                      config.model.hidden_size // t]
        assert len(re.findall(r"\d+,\d+", pairs)) == t * (p if chunks > 1 else p - 1)
    rounds = rounds_for(schedule, p, m, chunks, "cond")  # the CPU's round form
    trips = [int(n) for n in re.findall(r'known_trip_count[^0-9]*(\d+)', text)]
    assert rounds.num_rounds in trips
    useful = simulate(make_schedule(schedule, p, m, chunks)).messages
    assert useful == {"forward": m * (p * chunks - 1), "backward": m * (p * chunks - 1)}
    assert rounds.num_rounds * (p if chunks > 1 else p - 1) >= useful["forward"]


# --------------------------------------------------------------------------- GPU shape


def _region(text: str, start: int) -> str:
    """The text from `start` through the brace-balanced block that opens after it."""
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    raise AssertionError("unbalanced braces")


def _with_callees(text: str, region: str, seen=None) -> str:
    """A region plus, recursively, the bodies of the private functions it calls (not the
    custom calls: `custom_call @LayoutConstraint` has no body)."""
    seen = set() if seen is None else seen
    out = [region]
    for name in set(re.findall(r"(?<!custom_)call @([\w.$-]+)", region)) - seen:
        seen.add(name)
        out.append(_with_callees(text, _region(text, text.index(f"func.func private @{name}(")),
                                 seen))
    return "\n".join(out)


def steady_loops(setup):
    """[(rounds, body text with callees)] of the step's round loops lowered for CUDA."""
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    text = build_train_step(setup).trace(setup.state_layout.abstract_state(), batch).lower(
        lowering_platforms=("cuda",)).as_text()
    loops = []
    for match in re.finditer(r"stablehlo\.while\(.*?\) : tensor<(\d+)xi32>", text):
        cond = _region(text, match.start())  # then "do { body }"
        body = _with_callees(text, _region(text, match.start() + len(cond)))
        if "collective_permute" in body:  # a loop over rounds (the layer scans send nothing)
            loops.append((int(match.group(1)), body))
    return loops


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_cuda_lowered_steady_rounds_have_no_conditional(schedule):
    """round_form=steady lowered for CUDA: one loop per run of rounds with the same slot
    usage, the longest with every rank's F, B (and W) unconditional, and no loop holds a
    stablehlo.case (idle slots are masked); round_form=cond's loop does (the test sees
    conditionals where there are some)."""
    p, m = 4, 16
    setup = pipelined_setup(1, p, 2, schedule, 1, m, 4, ["parallel.round_form=steady"])
    runs = segments(rounds_for(schedule, p, m, 1, "steady"), "steady")
    steady = max(runs, key=lambda seg: seg.stop - seg.start)
    assert steady.modes == (("run", "run", "off") if schedule == "1f1b" else ("run",) * 3)
    loops = steady_loops(setup)
    sending = [seg for seg in runs if seg.modes[:2] != ("off", "off")]  # W-only: no sends
    assert [n for n, _ in loops] == [seg.stop - seg.start for seg in sending]
    assert all(body.count("stablehlo.case") == 0 for _, body in loops)
    assert "stablehlo.dot_general" in loops[sending.index(steady)][1]
    cond = steady_loops(pipelined_setup(1, p, 2, schedule, 1, m, 4,
                                        ["parallel.round_form=cond"]))
    assert cond[0][1].count("stablehlo.case") > 0


def _subjaxprs(eqn):
    """The jaxprs inside an equation (scan and call bodies, cond branches)."""
    for param in eqn.params.values():
        for item in param if isinstance(param, (tuple, list)) else (param,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def _round_scans(jaxpr):
    """The bodies of the scans that send over 'pipe' (the round loops), at any depth."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and any(
                e.primitive.name == "ppermute" for e in eqn.params["jaxpr"].jaxpr.eqns):
            yield eqn.params["jaxpr"].jaxpr
        for sub in _subjaxprs(eqn):
            yield from _round_scans(sub)


def _contains_matmul(eqn) -> bool:
    return eqn.primitive.name == "dot_general" or any(
        _contains_matmul(e) for sub in _subjaxprs(eqn) for e in sub.eqns)


@pytest.mark.parametrize("schedule, form", [
    ("1f1b", "cond"), pytest.param("zb-h1", "steady", marks=pytest.mark.slow)])
def test_no_matmul_waits_for_its_rounds_messages(schedule, form):
    """In every round body of the traced step, nothing that computes a matmul (directly or
    inside a cond, scan or call) consumes a value derived from the round's output message
    (sent to r + 1): it is only stored, so its collective-permute overlaps the B and W
    slots. The input gradient (sent to r - 1 at the round's start) is read by the round's
    B slot, but in a round with an F slot a matmul that does not wait for it (the F
    slot's) comes between (cool-down rounds have nothing to run beside it)."""
    setup = pipelined_setup(1, 4, 2, schedule, 1, 8, 4, [f"parallel.round_form={form}"])
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    jaxpr = jax.make_jaxpr(build_train_step(setup))(setup.state_layout.abstract_state(), batch).jaxpr
    bodies = list(_round_scans(jaxpr))
    assert bodies, "no round loop found"
    for body in bodies:
        tainted, covered, senders = {1: set(), -1: set()}, {}, 0
        for eqn in body.eqns:
            uses = {d for d, vs in tainted.items()
                    if any(not isinstance(v, Literal) and v in vs for v in eqn.invars)}
            if eqn.primitive.name == "ppermute":
                senders += 1
                step = 1 if (0, 1) in eqn.params["perm"] else -1
                tainted[step].update(eqn.outvars)
                covered[step] = False
                continue
            assert not (1 in uses and _contains_matmul(eqn)), \
                f"{eqn.primitive.name} waits for the round's output message"
            if -1 in uses and _contains_matmul(eqn) and 1 in covered:  # (F slot runs)
                assert covered[-1], f"{eqn.primitive.name} waits for an input gradient " \
                                    "with no matmul beside it"
            if not uses and _contains_matmul(eqn):
                covered = dict.fromkeys(covered, True)
            for d in uses:
                tainted[d].update(eqn.outvars)
        assert senders >= 1


def test_cond_slots_pass_no_slot_buffer_through():
    """round_form=cond: no slot conditional of the round loop returns a stash-slot buffer
    of the carry ([slots, ...]: the stage inputs, what F keeps for B) whole; a conditional
    that did was copied whole in its branches on XLA:GPU (executor._conditional)."""
    p, m = 4, 8
    setup = pipelined_setup(1, p, 1, "1f1b", 1, m, 4, ["parallel.round_form=cond"])
    config = setup.config
    rounds = rounds_for("1f1b", p, m, 1, "cond")
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    jaxpr = jax.make_jaxpr(build_train_step(setup))(setup.state_layout.abstract_state(),
                                                    batch).jaxpr
    (body,) = _round_scans(jaxpr)
    assert rounds.num_stash_slots > 1
    slotted = {v.aval.shape for v in body.invars
               if v.aval.ndim >= 3 and v.aval.shape[0] == rounds.num_stash_slots}
    assert len(slotted) >= 2, slotted  # the stash and kept values (the test can fail)
    conds = [e for e in body.eqns if e.primitive.name == "cond"]
    assert len(conds) == 2  # the F and B slots
    assert all(v.aval.shape not in slotted for e in conds for v in e.outvars)
