"""The compiled programs hold the collectives of Megatron's partitioning and nothing bigger.

Read from the compiled HLO text (`jax.jit(...).lower(...).compile().as_text()`):

- one transformer layer's forward pass holds exactly two all-reduces, over the tensor
  groups, each carrying the [b, s, h] activation (the g operators after the row-parallel
  attention output and second MLP layer); with tensor = 1 it holds none;
- no collective of the training step (with and without ZeRO-1) carries [tokens, vocab]
  logits or the unsharded weight of a tensor-parallel layer, while the data-parallel
  gradient all-reduce of the local embedding shard is found (so a parser that finds
  nothing cannot pass).

Model sizes are chosen so that every shape of interest is unambiguous: h = 48, 4h = 192,
heads 4 x 12, padded vocabulary 512 (128 per tensor rank), seq 20, 6 sequences (3 per
data rank), 2 layers.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxptd.config import load_config
from jaxptd import model as models
from jaxptd.parallel.mesh import make_mesh
from jaxptd.train.step import Setup, build_train_step

H, HEADS, HEAD_DIM, FFN, SEQ, BATCH, LAYERS = 48, 4, 12, 192, 20, 6, 2
SIZES = [f"model.hidden_size={H}", f"model.num_heads={HEADS}", f"model.seq_len={SEQ}",
         "model.vocab_size=300", f"train.global_batch={BATCH}"]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def make_setup(data, tensor, layers=LAYERS, extra=()):
    config = load_config(None, SIZES + [f"model.num_layers={layers}", f"parallel.data={data}",
                                        f"parallel.tensor={tensor}", *extra])
    return Setup(config, make_mesh(config.parallel, jax.devices()[: config.num_devices]))


def collectives(hlo: str):
    """[(opcode, [result shapes], line)] of every collective (and -start) instruction.

    A tuple result gives all its element shapes; `-done` instructions are skipped (their
    `-start` is counted).
    """
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            shape_text = re.sub(r"/\*.*?\*/", "", match["shape"])
            shapes = [tuple(int(d) for d in dims.split(",") if d)
                      for dims in _ARRAY.findall(shape_text)]
            found.append((match["op"], shapes, line))
    return found


def _iota(reshape, perm):
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm else ids


def replica_groups(line: str) -> set[frozenset[int]]:
    """The replica groups of one collective line, in any of XLA's three spellings."""
    if (m := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)):
        return {frozenset(int(i) for i in g.split(",") if i)
                for g in re.findall(r"\{([\d,]*)\}", m[1])}
    if (m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)):
        dims, reshape = [int(d) for d in m[1].split(",")], [int(d) for d in m[2].split(",")]
        perm = [int(d) for d in m[3].split(",")] if m[3] else None
        return {frozenset(row.tolist())
                for row in _iota(reshape, perm).reshape(dims[0], -1)}
    if (m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:device_ids=\(\[([\d,]+)\]"
                       r"(?:T\(([\d,]+)\))?\)\s*)?\{([^}]*)\}", line)):
        axes = re.findall(r"'(\w+)'=(\d+)", m[1])
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        if m[2]:
            reshape = [int(d) for d in m[2].split(",")]
            perm = [int(d) for d in m[3].split(",")] if m[3] else None
            ids = _iota(reshape, perm).reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m[4])]
        kept = [i for i in range(len(names)) if i not in grouped]
        ids = ids.transpose(kept + grouped).reshape(-1, math.prod(sizes[i] for i in grouped))
        return {frozenset(row.tolist()) for row in ids}
    raise AssertionError(f"replica_groups not understood: {line[:300]}")


def mesh_groups(setup: Setup, axis: str) -> set[frozenset[int]]:
    """Device-id groups along one mesh axis (the other axes fixed)."""
    ids = np.vectorize(lambda d: d.id)(setup.mesh.devices)
    moved = np.moveaxis(ids, setup.mesh.axis_names.index(axis), -1)
    return {frozenset(row.tolist()) for row in moved.reshape(-1, moved.shape[-1])}


# --------------------------------------------------------------------------- one layer


def layer_forward_hlo(setup: Setup) -> str:
    """Compiled forward pass of the one-layer stack inside the manual shard_map."""
    config = setup.config

    def local(layers, x):  # x: [b/d, s, h] on each device
        return models.apply_layers(layers, x, None, jax.random.key(0), config.model,
                                   setup.local_layout, True)

    fn = jax.shard_map(local, mesh=setup.mesh, in_specs=(setup.state_layout.param_specs["layers"], P("data")),
                       out_specs=P("data"))
    x = jax.ShapeDtypeStruct((BATCH, SEQ, H), jnp.float32)
    return jax.jit(fn).lower(setup.state_layout.abstract_params["layers"], x).compile().as_text()


def all_reduces(hlo: str):
    return [(shapes, line) for op, shapes, line in collectives(hlo) if op == "all-reduce"]


@pytest.mark.parametrize("data, tensor, extra", [(2, 4, ()), (1, 8, ["model.num_heads=8"])])
def test_one_layer_forward_has_two_tensor_all_reduces_of_activations(data, tensor, extra):
    setup = make_setup(data, tensor, layers=1, extra=extra)
    reduces = all_reduces(layer_forward_hlo(setup))
    assert len(reduces) == 2, [line[:200] for _, line in reduces]
    for shapes, line in reduces:
        assert replica_groups(line) == mesh_groups(setup, "tensor"), line[:300]
        assert shapes == [(BATCH // data, SEQ, H)], line[:300]  # [b, s, h] activations


def test_one_layer_forward_without_tensor_parallelism_communicates_nothing():
    """Guard against a vacuous count: the two all-reduces come from tensor parallelism.

    With tensor = 1 the psums stay in the HLO as all-reduces over one-device groups
    (no communication); none may reach another device.
    """
    for _, line in all_reduces(layer_forward_hlo(make_setup(2, 1, layers=1))):
        assert all(len(group) == 1 for group in replica_groups(line)), line[:300]


# --------------------------------------------------------------------------- the step


def forbidden_shape(shape: tuple[int, ...], setup: Setup) -> str | None:
    """Why a collective of this result shape would break the partitioning, or None."""
    vocab, tensor, data = setup.vocab, setup.config.parallel.tensor, setup.config.parallel.data
    vocab_dims = {vocab, vocab // tensor}
    token_counts = {BATCH * SEQ, BATCH * SEQ // data}
    has_tokens = bool(token_counts & set(shape)) or (
        SEQ in shape and bool({BATCH, BATCH // data} & set(shape)))
    if vocab_dims & set(shape) and has_tokens:
        return "logits [tokens, vocab]"
    if math.prod(shape) in {t * v for t in token_counts for v in vocab_dims}:
        return "logits (flattened)"
    unsharded = {
        (H, 3, HEADS, HEAD_DIM): "w_qkv", (HEADS, HEAD_DIM, H): "w_out",
        (H, FFN): "w_fc1", (FFN, H): "w_fc2", (vocab, H): "wte",
    }
    for weight_shape, name in unsharded.items():
        if shape in (weight_shape, (LAYERS,) + weight_shape):
            return f"unsharded {name}"
    return None


def step_hlo(setup: Setup) -> str:
    batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32, sharding=setup.batch_sharding)
    return build_train_step(setup).lower(setup.state_layout.abstract_state(), batch).compile().as_text()


def test_forbidden_shape_detector_flags_what_it_should():
    """The checker itself: synthetic collective lines with bad shapes are caught."""
    setup = make_setup(2, 4)
    lines = [
        "  %ag = f32[2,48,192]{2,1,0} all-gather(%p), replica_groups={{0,4}}, dimensions={2}",
        "  %ar = (f32[], f32[3,20,128]{2,1,0}) all-reduce-start(%a, %b), replica_groups={{0,1}}",
        "  ROOT %cp = f32[512,48]{1,0} collective-permute(%w), source_target_pairs={{0,1}}",
        "  %rs = (f32[60,512]{1,0}, /*index=1*/f32[4]{0}) reduce-scatter(%x, %y), dimensions={0}",
    ]
    found = collectives("\n".join(lines))
    assert [op for op, _, _ in found] == ["all-gather", "all-reduce", "collective-permute",
                                          "reduce-scatter"]
    for _, shapes, line in found:
        assert any(forbidden_shape(s, setup) for s in shapes), line


@pytest.mark.slow
@pytest.mark.parametrize("zero1", [False, True])
def test_step_collectives_carry_no_logits_and_no_unsharded_weights(zero1):
    setup = make_setup(2, 4, extra=[f"optimizer.zero1={zero1}"])
    assert setup.vocab == 512
    found = collectives(step_hlo(setup))
    bad = [(why, line[:240]) for _, shapes, line in found for s in shapes
           if (why := forbidden_shape(s, setup))]
    assert not bad, bad
    # The parser really sees the step's collectives: the data-parallel gradient reduction
    # of the local embedding shard [V/t, h] is among them: an all-reduce, or with ZeRO-1
    # a reduce-scatter into its [V/t, h/d] part and an all-gather of the updated weight
    # (and never an all-reduce of it).
    data_groups = mesh_groups(setup, "data")
    local_wte, part = (setup.vocab // 4, H), (setup.vocab // 4, H // 2)

    def over_data(op, shape):
        return [line for o, shapes, line in found if o == op and shape in shapes
                and replica_groups(line) == data_groups]
    if zero1:
        assert over_data("reduce-scatter", part) and over_data("all-gather", local_wte)
        assert not over_data("all-reduce", local_wte)
    else:
        assert over_data("all-reduce", local_wte), "no data-parallel wte all-reduce found"


# --------------------------------------------------------------------------- memory


def layer_grad_hlo(setup: Setup) -> str:
    """Compiled forward and backward of the one-layer stack inside the manual shard_map
    (x [b, s, h], or [b, s/t, h] with sequence parallelism)."""
    config = setup.config
    split = setup.local_layout.split_sequence
    x_spec = P("data", "tensor") if split else P("data")

    def local(layers, x):
        def loss(layers, x):
            y = models.apply_layers(layers, x, None, jax.random.key(0), config.model,
                                    setup.local_layout, True)
            return jnp.sum(y * y)
        return jax.grad(loss, argnums=(0, 1))(layers, x)[1]

    fn = jax.shard_map(local, mesh=setup.mesh, in_specs=(setup.state_layout.param_specs["layers"], x_spec),
                       out_specs=x_spec)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, H), jnp.float32)
    return jax.jit(fn).lower(setup.state_layout.abstract_params["layers"], x).compile().as_text()


def test_sequence_parallel_layer_gathers_and_scatters_activations():
    """SP: one layer's forward and backward move activations only by all-gathers and
    reduce-scatters over tensor, of the tokens in row order [b s/t, h] <-> [b s, h] (contiguous
    blocks, so neither needs a transpose): two of each direction per pass (before QKV / fc1,
    after the output / fc2), no all-reduce of an activation."""
    data, tensor = 2, 4
    setup = make_setup(data, tensor, layers=1, extra=["parallel.sequence_parallel=true"])
    found = collectives(layer_grad_hlo(setup))
    b, tensor_groups = BATCH // data, mesh_groups(setup, "tensor")
    full, part = (b * SEQ, H), (b * SEQ // tensor, H)
    gathers = [line for op, shapes, line in found if op == "all-gather" and full in shapes]
    scatters = [line for op, shapes, line in found if op == "reduce-scatter" and part in shapes]
    assert len(gathers) == 4 and len(scatters) == 4, (len(gathers), len(scatters))
    assert all(replica_groups(line) == tensor_groups for line in gathers + scatters)
    activations = [line for op, shapes, line in found if op == "all-reduce"
                   and any(math.prod(s) >= b * (SEQ // tensor) * H for s in shapes)]
    assert not activations, activations[:2]


@pytest.mark.parametrize("remat", ["none", "selective"])
def test_sequence_parallel_layer_keeps_its_norm_outputs_split(remat):
    """SP: a layer's backward keeps the norm outputs as they were before f, [b, s/t, h],
    and gathers them again for the weight gradients (tensor.entered, as Megatron's backward
    does): no value its vjp keeps is a gathered [b, s, h] (kept, the two gathered norm
    outputs were 1.1 GiB a device of GPT-1.3B at (2,1,4) on H100). Without SP the layer's
    [b, s, h] values are its own (the check sees them). t = 2: the MLP's [b, s, 4h/t]
    is not [b, s, h]."""
    kept = {}
    for sp in (True, False):
        setup = make_setup(1, 2, layers=1, extra=[f"parallel.sequence_parallel={sp}",
                                                  f"model.remat={remat}"])
        split = setup.local_layout.split_sequence

        def local(layers, x):
            def layer(layers, x):
                return models.apply_layers(layers, x, None, jax.random.key(0),
                                           setup.config.model, setup.local_layout, True)
            backward = jax.vjp(layer, layers, x)[1]
            # (scanned layers: [L, ...])
            kept[sp] = [leaf.shape[-3:] for leaf in jax.tree.leaves(backward)]
            return x
        spec = P("data", "tensor") if split else P("data")
        jax.eval_shape(jax.shard_map(
            local, mesh=setup.mesh, in_specs=(setup.state_layout.param_specs["layers"], spec),
            out_specs=spec), setup.state_layout.abstract_params["layers"],
            jax.ShapeDtypeStruct((BATCH, SEQ, H), jnp.float32))
    assert (BATCH, SEQ // 2, H) in kept[True]
    assert (BATCH, SEQ, H) not in kept[True], kept[True]
    assert kept[False].count((BATCH, SEQ, H)) >= 2


def test_fsdp_gathers_each_layer_and_scatters_its_gradient():
    """FSDP over data = 2: inside the layer loop each weight is all-gathered from its half
    (forward, and again in the backward) and its gradient reduce-scattered back."""
    setup = make_setup(2, 4, extra=["parallel.fsdp=true"])
    text = step_hlo(setup)
    found = collectives(text)
    fsdp_groups = mesh_groups(setup, "fsdp")
    qkv_local = (H, 3, HEADS // 4, HEAD_DIM)
    gathers = [line for op, shapes, line in found if op == "all-gather" and qkv_local in shapes
               and replica_groups(line) == fsdp_groups]
    scatters = [line for op, shapes, line in found if op == "reduce-scatter"
                and (H // 2, 3, HEADS // 4, HEAD_DIM) in shapes
                and replica_groups(line) == fsdp_groups]
    assert len(gathers) >= 2 and scatters, (len(gathers), len(scatters))
    # no weight ever travels whole over data: no all-reduce of a layer's full w_qkv
    assert not [line for op, shapes, line in found if op == "all-reduce" and qkv_local in shapes]
