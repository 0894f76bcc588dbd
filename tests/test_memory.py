"""The memory side (issue 14) against independent references: sequence parallelism, FSDP,
HSDP, ZeRO-1's reduce-scatter and host offload give the single-device program's loss and
gradients (and optimizer steps); FSDP's state really is sharded (XLA's compiled argument
bytes); offloaded state really lives in host memory (the compiled module's entry layout);
the data-parallel reduction of a layer's gradient waits for no layer below it (the traced
step); checkpoints restore across FSDP, ZeRO-1 and plain layouts at other data sizes, and
a pipelined state is saved without a second copy on the device.
HLO-level collectives are in test_hlo.py, the planner's model of all this in test_plan.py.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal

from helpers import (assert_grads_match_single_device, assert_same_state,
                     assert_steps_match_single_device, fixed_batches, make_setup,
                     placed_state, train_cli_records)
from jaxptd import model as models
from jaxptd.checkpoint.store import Checkpointer
from jaxptd.config import load_config
from jaxptd.model.tensor import Layout
from jaxptd.train.step import build_eval_step, build_grads, build_train_step

SP, FSDP = "parallel.sequence_parallel=true", "parallel.fsdp=true"
MATMUL = "parallel.fsdp_unit=matmul"  # FSDP gathers one matmul's weight at a time


def _case(data, pipe, tensor, *extra, slow=True):
    marks = (pytest.mark.slow,) if slow else ()
    return pytest.param(data, pipe, tensor, extra, marks=marks,
                        id="-".join([f"{data}{pipe}{tensor}", *(e.split(".")[-1] for e in extra)]))


PIPE = ["parallel.microbatches=3", "train.global_batch=6"]
# SP with data and FSDP, (4, 1, 2), is test_parity.py's packed d4-t2-fsdp-sp-overlap
# case; SP with data (2, 1, 4) its packed zb-h1 (2, 2, 2) case and the FSDP ones below;
# zb-h1 with SP the (2, 2, 2) FSDP case below and that packed case.
GRADS = [
    _case(1, 1, 4, SP, "parallel.microbatches=2"),
    _case(1, 2, 4, SP, *PIPE, "parallel.schedule=interleaved", "parallel.chunks=2"),
    _case(8, 1, 1, FSDP, MATMUL, slow=False),
    _case(2, 2, 2, FSDP, *PIPE),
    _case(2, 2, 2, FSDP, SP, MATMUL, *PIPE, "parallel.schedule=zb-h1"),
    _case(4, 1, 2, FSDP, "parallel.fsdp_group=2", "optimizer.zero1=true"),
    _case(8, 1, 1, "optimizer.zero1=true", "parallel.microbatches=2",
          "optimizer.overlap_grad_reduce=true"),
    _case(2, 1, 4, "optimizer.zero1=true", "optimizer.overlap_grad_reduce=false"),
]


@pytest.mark.parametrize("data, pipe, tensor, extra", GRADS)
def test_gradients_match_single_device(data, pipe, tensor, extra):
    assert_grads_match_single_device(make_setup(data, pipe, tensor, list(extra)))


@pytest.mark.parametrize("data, pipe, tensor, extra", [
    _case(2, 1, 4, "offload.optimizer=true", "offload.activations=true", SP),
    _case(4, 1, 2, "offload.optimizer=true", FSDP, MATMUL, "parallel.fsdp_group=2"),
    _case(8, 1, 1, "offload.optimizer=true", "optimizer.zero1=true", "parallel.microbatches=2",
          "optimizer.overlap_grad_reduce=true"),
    _case(2, 2, 2, "offload.optimizer=true", *PIPE, "parallel.schedule=interleaved",
          "parallel.chunks=2", "model.num_layers=8"),
    # layers unrolled (a GPU's default): tree.host_layers' transpose writes the gradients
    _case(4, 1, 2, "offload.optimizer=true", "offload.activations=true", FSDP, MATMUL,
          "model.scan_layers=false", "parallel.microbatches=2", slow=False),
])
def test_offloaded_steps_match_single_device(data, pipe, tensor, extra):
    """Three AdamW steps with the masters, moments (and layer inputs) in host memory, the
    update streamed layer by layer (pipelined: [v, p, 1] slices of the stacked layers),
    the gradients accumulated in host memory over microbatches."""
    assert_steps_match_single_device(make_setup(data, pipe, tensor, list(extra)))


def _device_values_of_layer_shape(setup, eval_step=False) -> list:
    """[(shape, primitive)] of the values of the traced train step (or eval step), at any
    depth, that are in device memory and shaped like a stacked layer leaf [L, ...] of the
    state (global, or one device's shard)."""
    state = setup.state_layout.abstract_state()
    shapes = {tuple(shape) for leaf in jax.tree.leaves(state["params"]["layers"])
              for shape in (leaf.shape, leaf.sharding.shard_shape(leaf.shape))}
    batch = jax.ShapeDtypeStruct((setup.config.train.global_batch, 17), jnp.int32,
                                 sharding=setup.batch_sharding)
    step, args = (build_eval_step(setup), (state["params"], batch)) if eval_step else (
        build_train_step(setup), (state, batch))
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.extend((v.aval.shape, eqn.primitive.name) for v in eqn.outvars
                         if tuple(getattr(v.aval, "shape", ())) in shapes
                         and v.aval.memory_space == jax.memory.Space.Device)
            for param in eqn.params.values():
                for item in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(item, "jaxpr", item)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jax.make_jaxpr(step)(*args).jaxpr)
    return found


@pytest.mark.parametrize("extra", [[FSDP], [], ["optimizer.zero1=true", "parallel.microbatches=2",
                                               "optimizer.overlap_grad_reduce=true"],
                                   [FSDP, "model.scan_layers=false"]],
                         ids=["fsdp", "plain", "zero1-m2", "fsdp-unrolled"])
def test_offloaded_layers_are_never_whole_on_the_device(extra):
    """offload.optimizer: the stacked layers' masters, moments and gradients stay in host
    memory for the whole step (the PyTorch FSDP post's 1T run cannot hold 4 bytes a parameter on a
    40 GB device): no value of the traced step shaped like a stacked layer leaf is in
    device memory. Each layer's slice is brought to the device where it is used, forward,
    backward (not kept between them) and update, and its gradient and new state go back.
    Without offload the masters are on the device, as the check sees."""
    model = ["model.num_layers=6", "train.global_batch=8"]  # (no other value [6, ...])
    setup = make_setup(4, 1, 2, [*model, "offload.optimizer=true", *extra])
    assert _device_values_of_layer_shape(setup) == []
    assert _device_values_of_layer_shape(make_setup(4, 1, 2, [*model, *extra]))


def test_offloaded_eval_reads_the_host_layers_one_at_a_time():
    """The validation loss of an offloaded state: the same as the device-resident one's,
    each layer's masters brought from host memory where it is used (none whole)."""
    losses = []
    for extra in ([FSDP], [FSDP, "offload.optimizer=true"]):
        setup = make_setup(4, 1, 2, ["model.num_layers=6", "train.global_batch=8", *extra])
        state = placed_state(setup)
        batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
        losses.append(float(build_eval_step(setup)(state["params"], batch)))
    assert _device_values_of_layer_shape(setup, eval_step=True) == []
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def _compiled(setup):
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    return build_train_step(setup).lower(setup.state_layout.abstract_state(), batch).compile()


MODEL = ["model.hidden_size=64", "model.num_heads=8", "model.num_layers=2",
         "model.vocab_size=1000", "train.global_batch=8"]


@pytest.mark.slow
def test_fsdp_shards_the_state_over_data():
    """Compiled per-device argument bytes (the state) with FSDP at data = 8: at most 1/6
    of the data = 1 program's parameter and optimizer bytes (1/8 but for tiny leaves)."""
    whole = _compiled(make_setup(1, 1, 1, MODEL)).memory_analysis().argument_size_in_bytes
    sharded = _compiled(make_setup(8, 1, 1, [*MODEL, FSDP])).memory_analysis()
    assert sharded.argument_size_in_bytes <= whole / 6, (sharded.argument_size_in_bytes, whole)


def _entry_parameters(text: str) -> list:
    """[(bytes, in host memory)] of the compiled module's parameters, in order."""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
    found = []
    # (a scalar in device memory has no layout braces: f32[])
    for dtype, dims, space in re.findall(r"(\w+)\[([\d,]*)\](?:\{[^}]*?(:S\(\d\))?\})?",
                                         layout):
        size = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}[dtype]
        found.append((size * int(np.prod([int(d) for d in dims.split(",") if d])),
                      space == ":S(5)"))
    return found


@pytest.mark.slow
def test_offloaded_optimizer_lives_in_host_memory():
    """offload.optimizer: in the compiled step's entry layout every state leaf under params
    (the fp32 masters) and opt_state (Adam's moments and counters) is in host memory (XLA's
    memory space 5) and nothing else is: 12 bytes per local parameter on the host. Without
    offload no parameter of the step is on the host."""
    def entry(extra):
        setup = make_setup(2, 1, 4, [*MODEL, *extra])
        leaves = jax.tree_util.tree_leaves_with_path(setup.state_layout.abstract_state())
        found = _entry_parameters(_compiled(setup).as_text())
        assert len(found) == len(leaves) + 1  # the state's leaves, then the batch
        return leaves, found

    leaves, found = entry(["offload.optimizer=true"])
    host = local = 0
    for (path, leaf), (size, in_host) in zip(leaves, found):
        assert size == leaf.dtype.itemsize * np.prod(leaf.sharding.shard_shape(leaf.shape))
        assert in_host == (path[0].key in ("params", "opt_state")), jax.tree_util.keystr(path)
        host += size * in_host * (leaf.ndim > 0)
        local += size * (path[0].key == "params")
    assert host == 3 * local, (host, local)
    assert not any(h for _, h in entry([])[1])


def _fsdp_gathers(jaxpr) -> list:
    """[(shape of the gathered shard, the primitive that produced it)] for every all-gather
    over fsdp of a traced program, at any depth."""
    found, producers = [], {}
    for eqn in jaxpr.eqns:
        producers.update({v: eqn for v in eqn.outvars})
        if eqn.primitive.name == "all_gather" and "fsdp" in eqn.params["axis_name"]:
            source = producers.get(eqn.invars[0])
            found.append((eqn.invars[0].aval.shape, source and source.primitive.name))
        for param in eqn.params.values():
            for item in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    found += _fsdp_gathers(sub)
    return found


def test_fsdp_gathers_one_matmul_weight_at_a_time():
    """parallel.fsdp_unit=matmul: FSDP's unit is one matmul's weight (the PyTorch FSDP post wrapped
    each linear: 4 h^2 at most whole, not a layer's 12 h^2): each dense() weight shard of a
    layer is all-gathered twice, for its forward and for its backward, each time out of an
    optimization barrier with the matmul's input or output gradient (none is gathered
    ahead of its matmul). With the default unit, a layer, none is (the layer's gather may
    run ahead)."""
    setup = make_setup(2, 1, 4, [FSDP, "parallel.fsdp_unit=matmul"])
    state = setup.state_layout.abstract_state()
    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=setup.batch_sharding)
    gathers = _fsdp_gathers(jax.make_jaxpr(build_grads(setup, True))(
        state["params"], batch, state["rng"], state["step"], jnp.float32(1)).jaxpr)
    layers = setup.state_layout.abstract_state()["params"]["layers"]
    for block, name in (("attn", "w_qkv"), ("attn", "w_out"), ("mlp", "w_fc1"),
                        ("mlp", "w_fc2")):
        leaf = layers[block][name]
        shard = leaf.sharding.shard_shape(leaf.shape)[1:]
        sources = [source for shape, source in gathers if shape == shard]
        assert sources == ["optimization_barrier"] * 2, (name, sources)
    layered = make_setup(2, 1, 4, [FSDP])
    state = layered.state_layout.abstract_state()
    gathers = _fsdp_gathers(jax.make_jaxpr(build_grads(layered, True))(
        state["params"], batch, state["rng"], state["step"], jnp.float32(1)).jaxpr)
    assert gathers and "optimization_barrier" not in [source for _, source in gathers]


REDUCTIONS = ("psum", "psum_invariant", "psum_scatter", "reduce_scatter")


def _reduces_over_data(eqn) -> bool:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return eqn.primitive.name in REDUCTIONS and "data" in (
        axes if isinstance(axes, tuple) else (axes,))


def _data_reductions(jaxpr, in_reversed_scan=False):
    """[(equation, inside a reversed scan)] for the psum / reduce-scatter equations over
    the data axis of a traced program, at any depth."""
    found = []
    for eqn in jaxpr.eqns:
        if _reduces_over_data(eqn):
            found.append((eqn, in_reversed_scan))
        inner = in_reversed_scan or (eqn.primitive.name == "scan" and eqn.params["reverse"])
        for param in eqn.params.values():
            for item in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    found += _data_reductions(sub, inner)
    return found


@pytest.mark.parametrize("extra", [[], ["optimizer.zero1=true"]], ids=["all-reduce", "zero1"])
def test_layer_gradient_reduction_waits_for_no_layer_below(extra):
    """overlap_grad_reduce: the data-parallel reduction of each layer's gradient is in the
    body of the backward's reversed layer scan, so layer l's is issued when its own
    backward ends, before the layers below run theirs; no reduction of a stacked [L, ...]
    gradient is left outside it (only the ends': embedding, final norm). With it off,
    every reduction is after the scan, on the stacked gradients."""
    def reductions(overlap):
        setup = make_setup(2, 1, 4, [*extra, f"optimizer.overlap_grad_reduce={overlap}"])
        config = setup.config
        batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                     jnp.int32, sharding=setup.batch_sharding)
        jaxpr = jax.make_jaxpr(build_train_step(setup))(setup.state_layout.abstract_state(), batch)
        layers = setup.config.model.num_layers
        return [(inside, any(getattr(v.aval, "shape", ())[:1] == (layers,) for v in e.invars))
                for e, inside in _data_reductions(jaxpr.jaxpr)]

    overlapped = reductions("true")
    assert any(inside for inside, _ in overlapped)
    assert not any(stacked for inside, stacked in overlapped if not inside)
    after = reductions("false")
    assert not any(inside for inside, _ in after) and any(stacked for _, stacked in after)


def _reductions_after_scans(jaxpr):
    """For the shard_map body of a traced grads program: (number of its scans, [the
    scans each of its data-parallel reductions depends on])."""
    body = next(e.params["jaxpr"] for e in jaxpr.eqns if e.primitive.name == "shard_map")
    deps, scans, found = {}, 0, []
    for eqn in body.eqns:
        d = set().union(*(deps.get(v, set()) for v in eqn.invars if not isinstance(v, Literal)))
        if eqn.primitive.name == "scan":
            d, scans = d | {scans}, scans + 1
        for v in eqn.outvars:
            deps[v] = d
        if _reduces_over_data(eqn):
            found.append(d)
    return scans, found


@pytest.mark.parametrize("kind", ["interleaved", "zb-interleaved"])
def test_pipelined_chunk_reduction_waits_for_no_later_round(kind):
    """Pipelined, v = 2, ZeRO-1 (overlap_grad_reduce auto): chunk 1's layer gradients are
    reduce-scattered over data between the scans, as soon as every rank has run their last
    backward, before the rounds of chunk 0's last backwards: that reduction depends on no
    later scan. With overlap_grad_reduce=false every reduction waits for the last scan."""
    def reductions(overlap):
        setup = make_setup(2, 2, 2, [f"parallel.schedule={kind}", "parallel.chunks=2",
                                     "parallel.microbatches=4", "optimizer.zero1=true",
                                     f"optimizer.overlap_grad_reduce={overlap}"])
        state = setup.state_layout.abstract_state()
        batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=setup.batch_sharding)
        return _reductions_after_scans(jax.make_jaxpr(build_grads(setup, True))(
            state["params"], batch, state["rng"], state["step"], jnp.float32(1)).jaxpr)

    scans, early = reductions("auto")
    assert any(scans - 1 not in d for d in early), early
    assert all(d for d in early)  # (each after the scan that ends its chunk)
    scans, late = reductions("false")
    assert late and all(scans - 1 in d for d in late), late


RESTORES = [  # (writer, reader): (data, pipe, tensor, extra)
    ((2, 2, 2, ("parallel.schedule=interleaved", "parallel.chunks=2")),
     (8, 1, 1, (FSDP, "parallel.fsdp_group=4"))),
    ((8, 1, 1, ("optimizer.zero1=true",)), (2, 2, 2, (FSDP,))),
    # a V's layers (chunk 1's ranks reversed) and ends (the head's on rank 0) to 1F1B's
    ((2, 2, 2, ("parallel.schedule=zb-v", "parallel.chunks=2")), (1, 4, 1, ())),
]


@pytest.mark.slow
@pytest.mark.parametrize("writer, reader", RESTORES, ids=lambda x: "-".join(
    [f"{x[0]}{x[1]}{x[2]}", *(e.split(".")[-1] for e in x[3])]))
def test_checkpoints_restore_across_fsdp_zero1_and_plain(tmp_path, writer, reader):
    """A state saved at one of FSDP / HSDP / ZeRO-1 / plain and one data size restores at
    another with every value equal (the checkpoint holds the logical layout; the padded
    vocabulary rows, 128 x tensor, differ in number and are compared up to the smaller)."""
    source = make_setup(writer[0], writer[1], writer[2], list(writer[3]))
    state = build_train_step(source)(placed_state(source), jax.device_put(
        np.zeros((16, 17), np.int32), source.batch_sharding))[0]  # moments nonzero
    ckpt = Checkpointer(str(tmp_path), every=1, keep=1, async_save=False)
    ckpt.save(1, source.state_layout.state_to_logical(state))
    ckpt.close()
    target = make_setup(reader[0], reader[1], reader[2], list(reader[3]))
    restored, step = Checkpointer(str(tmp_path), every=1, keep=1).restore_latest(
        target.state_layout.abstract_state(logical=True), target.config.model.vocab_size)
    assert step == 1
    expected = jax.device_get(source.state_layout.state_to_logical(state))
    got = jax.device_get(restored)
    vocab = target.config.model.vocab_size
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert all(x == y or min(x, y) >= vocab for x, y in zip(a.shape, e.shape))
        common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, e.shape))
        np.testing.assert_array_equal(a[common], e[common], err_msg=jax.tree_util.keystr(path))
    step_fn = build_train_step(target)  # and it trains from there
    in_memory = target.state_layout.state_from_logical(restored)
    assert np.isfinite(float(step_fn(in_memory, jax.device_put(
        np.zeros((16, 17), np.int32), target.batch_sharding))[1]["loss"]))


def test_pipelined_save_layout_holds_no_second_state_on_the_device():
    """What a save writes of a pipelined (v = 2) state, state_to_logical, adds no device
    bytes: its re-laid leaves live in host memory, equal to the logical reshape done in
    numpy; state_from_logical brings them back equal, freeing each as it goes."""
    setup = make_setup(2, 2, 2, ["parallel.schedule=interleaved", "parallel.chunks=2",
                                 "parallel.microbatches=2", "train.global_batch=8"])
    state = placed_state(setup)
    jax.block_until_ready(state)
    device_bytes = lambda: sum(a.nbytes for a in jax.live_arrays()
                               if a.sharding.memory_kind == "device")
    before = device_bytes()
    logical = jax.block_until_ready(setup.state_layout.state_to_logical(state))
    assert device_bytes() <= before
    assert {x.sharding.memory_kind for x in jax.tree.leaves(logical)} == {"pinned_host"}
    assert_same_state(logical, setup.state_layout.to_logical(jax.device_get(state)))
    back = setup.state_layout.state_from_logical(logical)
    assert_same_state(back, state)
    assert all(x.is_deleted() for x in jax.tree.leaves(logical))


def _train(tmp_path, name, overrides):
    return [r["loss"] for r in train_cli_records(tmp_path, name, overrides)[0]]


@pytest.mark.slow
def test_train_cli_memory_options_and_a_pipeline_equal_the_plain_run(tmp_path):
    """`python -m jaxptd.train` for three steps: HSDP with ZeRO-1, offload and an
    interleaved pipeline (data 2, pipe 2, tensor 2) give the plain (2, 1, 4) run's losses
    (SP and ZeRO-1 alone, and the other schedules: the parity grids'); the pipelined run
    logs its bubble, (p-1)/(v m) (zero-bubble's: tests/test_schedules.py's formulas of the
    same simulation)."""
    plain = _train(tmp_path, "plain", ["parallel.data=2", "parallel.tensor=4",
                                       "parallel.microbatches=2"])
    variants = {
        "hsdp": ["parallel.data=8", FSDP, "parallel.fsdp_group=4", "optimizer.zero1=true"],
        "offload": ["parallel.data=2", "parallel.tensor=4", "offload.optimizer=true",
                    "offload.activations=true"],
        "piped": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                  "parallel.microbatches=2", "parallel.schedule=interleaved",
                  "parallel.chunks=2"],
    }
    for name, overrides in variants.items():
        records, events = train_cli_records(tmp_path, name, overrides)
        np.testing.assert_allclose([r["loss"] for r in records], plain, rtol=1e-5,
                                   err_msg=name)
        if name == "piped":
            assert events[0]["bubble_fraction"] == pytest.approx(1 / 4)  # (p-1)/(v m)


def test_fsdp_layer_keeps_no_gathered_weight(capsys):
    """A layer's dense() weight gathered by FSDP's layer unit (reduction.fsdp_gathers) under
    the layer's jax.checkpoint policy (sharding.regather): the backward gathers it again
    and keeps no gathered weight (JAX's saved residuals). Cast after the gather, the cast
    weight was a value the policy kept: every layer's whole weights from the forward to
    the backward (2.25 GiB at FSDP 8 for GPT-1.3B, the H100 compile)."""
    from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxptd.parallel.mesh import FSDP
    from jaxptd.train.reduction import _gather_for_matmul
    from jaxptd.parallel.sharding import GATHERED, regather

    mesh = Mesh(np.array(jax.devices()[:2]), (FSDP,))

    def layer(x, w):  # w: [8, 16] float32 shard of a [16, 16] weight
        gathered = _gather_for_matmul(0, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                                      jnp.dtype(jnp.float32))
        whole = checkpoint_name(gathered(w), GATHERED)
        return jnp.tanh(x @ whole.astype(x.dtype))

    def loss(x, ws):
        for w in ws:
            x = jax.checkpoint(layer, policy=regather)(x, w)
        return jax.lax.psum(jnp.sum(x.astype(jnp.float32)), FSDP)
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(P(FSDP), P(FSDP)), out_specs=P())
    x, ws = jnp.ones((4, 16), jnp.bfloat16), [jnp.ones((16, 16), jnp.float32)] * 2
    print_saved_residuals(sharded, x, ws)  # shapes as the shard_map's outside sees them
    saved = capsys.readouterr().out
    assert "bf16[4,16]" in saved and "[32,16]" not in saved, saved  # 2 x [16, 16] gathered
    grads = jax.grad(lambda ws: sharded(x, ws))(ws)  # the gather's transpose
    assert all(g.shape == (16, 16) and g.dtype == jnp.float32 for g in grads)


@pytest.mark.parametrize("name", ["weight_gradients_first", "reduced_ahead"])
def test_weight_gradients_first_changes_no_value(name):
    """model.weight_gradients_first (a GPU program's offloaded layers: the input gradient
    waits for the weight gradients) and model.reduced_ahead (it waits for a layer's
    reduced gradients) are the identity, and their gradients are autodiff's, bit for bit,
    whatever the gradients hold (NaN, infinity, negative zero)."""
    tie = getattr(models, name)

    def loss(x, params):
        return jnp.sum(jnp.tanh(x @ params["w"]) * params["b"])
    x = jnp.array([[-0.0, 1.0], [2.0, -3.0]])
    for w in (jnp.array([[0.5, -1.0], [1.5, 2.0]]), jnp.array([[jnp.nan, 1.0], [1.0, 1.0]]),
              jnp.array([[jnp.inf, 0.0], [-0.0, 1.0]])):
        params = {"w": w, "b": jnp.array([1.0, -2.0])}
        tied = jax.jit(jax.grad(lambda x, p: loss(*tie(x, p)), (0, 1)))
        for got, want in zip(jax.tree.leaves(tied(x, params)),
                             jax.tree.leaves(jax.grad(loss, (0, 1))(x, params))):
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
            np.testing.assert_array_equal(got, want)


def test_layers_waiting_for_reduced_gradients_compute_the_same_gradients():
    """The layer stack of a GPU program with full recomputation whose step reduces each
    layer's gradients in its backward (apply_layers' `reduced`: every layer's input
    gradient waits for those of the layer AHEAD above it, model.reduced_ahead) computes,
    run here on the CPU, the loss and gradients of the CPU program (scanned layers, no
    weight_gradients_first, no waits). AHEAD + 1 layers: the bottom layer's input gradient
    waits for the top layer's (more layers only repeat the pin; each tie's gradients are
    autodiff's bit for bit: test_weight_gradients_first_changes_no_value). The same
    unrolled stack without the waits is not compiled on its own: its values are in this
    one's, which adds only the waits to it."""
    cfg = load_config(None, [f"model.num_layers={models.AHEAD + 1}", "model.hidden_size=32",
                             "model.num_heads=4", "model.seq_len=16", "model.vocab_size=64",
                             "model.remat=full"]).model
    vocab = cfg.padded_vocab(1)
    params = jax.jit(functools.partial(models.get(cfg).init_params, cfg, vocab))(
        jax.random.key(0))  # (one compile; eagerly, one per op)
    batch = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab_size)

    def prepare(layer, _):  # (the step's hook: a cast whose transpose reduces over data)
        return layer

    def grads(platform, reduced):
        def loss(p):
            return models.loss_terms(p, batch, jax.random.key(2), cfg,
                                     Layout(vocab, platform=platform), True, prepare=prepare,
                                     reduced=reduced)[0]
        return jax.jit(jax.value_and_grad(loss))(params)
    def signs(reduced):  # sign-bit reads: varying.after's, one a leaf it waits for
        return str(jax.make_jaxpr(jax.grad(lambda p: models.loss_terms(
            p, batch, jax.random.key(2), cfg, Layout(vocab, platform="gpu"), True,
            prepare=prepare, reduced=reduced)[0]))(params)).count("shift_right_arithmetic")
    leaves = len(jax.tree.leaves(params["layers"]))  # a layer's
    assert signs(True) - signs(False) == (cfg.num_layers - models.AHEAD) * leaves
    want = grads("cpu", False)
    for g, w in zip(jax.tree.leaves(grads("gpu", True)), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def test_offloaded_activations_refused_with_a_pipeline():
    from jaxptd.config import ConfigError
    with pytest.raises(ConfigError, match="offload.activations=true: needs parallel.pipe=1"):
        load_config(None, ["parallel.pipe=2", "model.num_layers=4",
                           "offload.activations=true"])
