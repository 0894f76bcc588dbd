"""Logical axis names, the rules table, and logical -> PartitionSpec.

Owns Megatron's partitioning as data. Every parameter carries logical axis names (set in
the model with `nn.with_logical_partitioning`); `RULES` maps each name to a mesh axis:

- vocab -> tensor: the embedding (and the tied output layer) is vocab-parallel;
- heads -> tensor: QKV is column-parallel (split by heads), the attention output
  projection row-parallel (its input dimension is heads);
- kv_heads -> tensor: Llama's grouped-query key/value projection, column-parallel by
  key/value heads when the tensor size divides them (else the model names them
  kv_heads_replicated, which is replicated);
- mlp -> tensor: the first MLP layer(s) column-parallel, the second row-parallel;
- stages -> pipe: stacked layers are split into pipeline stages;
- experts -> expert: a mixture of experts' routed experts are split over the expert ranks
  (their hidden width, 'mlp', over tensor as the dense MLP's); the router's scores over
  all experts ('router') are replicated;
- everything else (embed, embed_out, kv, qkv, positions, layers, chunks, norm,
  types, router) is replicated.

FSDP (`parallel.fsdp`) shards every parameter (and so its gradient and Adam moments) over
the `fsdp` axis on its first free dimension divisible by the group size, past the layer-
stacking dimensions (`fsdp_spec`); `fsdp_dims` says which dimension of each leaf, as the
layers see it, to all-gather. ZeRO-1 (`optimizer.zero1`) further shards optimizer state
over the `data` axis (the replicas) on the first free dimension divisible by its size.

Inside the step's manual shard_map, values carry JAX's varying-manual-axes (vma) type; the
last helpers here are jaxptd's one place that reads or sets it: `varying_axes` reads it
(whichever field this JAX names it by), `mark_varying` sets it, `gather_invariant`
all-gathers into an invariant value (with a fallback for a JAX without the typed gather)
and `reduce_to` undoes it by reduction; `after` makes an index depend on values (an order
XLA must keep), reducing over the axes they vary over, and `rewritten_at` and `waiting`
an array.
"""
from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd.mesh import DATA, EXPERT, FSDP, PIPE, TENSOR

RULES: dict[str, str | None] = {
    "vocab": TENSOR,
    "heads": TENSOR,
    "kv_heads": TENSOR,  # grouped-query key/value heads, when the tensor size divides them
    "mlp": TENSOR,
    "stages": PIPE,
    "experts": EXPERT,
    "router": None,
    "embed": None,
    "kv": None,
    "qkv": None,
    "positions": None,
    "layers": None,
    "chunks": None,
    "norm": None,
    "kv_heads_replicated": None,  # ... else every rank holds them all
    "embed_out": None,  # BERT's replicated h x h head layers
    "types": None,  # BERT's token types and SOP classes
}


def logical_to_spec(names: tuple[str | None, ...], rules=RULES) -> P:
    """Maps a parameter's logical axis names to a PartitionSpec of mesh axes."""
    for name in names:
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table")
    return P(*(rules[n] if n is not None else None for n in names))


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def specs_from_logical(logical_tree, rules=RULES):
    """A tree of logical-name tuples (as PartitionSpecs) -> a tree of mesh PartitionSpecs."""
    return jax.tree.map(lambda names: logical_to_spec(tuple(names), rules), logical_tree,
                        is_leaf=is_spec)


def _shard_free_dim(spec: P, shape: tuple[int, ...], axis: str, size: int, skip: int = 0):
    """spec with `axis` on the first dimension past `skip` that is unsharded and divisible
    by `size`. A leaf with no such dimension (a scalar, a small bias) stays as it was."""
    if size == 1:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i in range(skip, len(shape)):
        if entries[i] is None and shape[i] % size == 0:
            entries[i] = axis
            return P(*entries)
    return spec


def zero1_spec(spec: P, shape: tuple[int, ...], data_size: int, stacked: int = 0) -> P:
    """Adds the data axis (the replicas) to the first free dimension divisible by it past
    the `stacked` layer-stacking dimensions."""
    return _shard_free_dim(spec, shape, DATA, data_size, stacked)


def fsdp_spec(spec: P, shape: tuple[int, ...], group: int, stacked: int) -> P:
    """Adds the fsdp axis to the first free dimension divisible by the group size past
    the `stacked` layer-stacking dimensions (0 for the ends)."""
    return _shard_free_dim(spec, shape, FSDP, group, stacked)


# the name of a parameter brought to the device for its layer: all-gathered (FSDP) or
# fetched from host memory (offload.optimizer)
GATHERED = "fsdp_gathered"


def regather(prim, *_, **params) -> bool:
    """The jax.checkpoint policy of a layer under FSDP or with its masters in host memory:
    keep every value it computes except the parameters brought for it (the all-gather over
    fsdp and the GATHERED name), which the backward brings again (FSDP's memory: one
    unit's weights whole at a time; offload's: none of the masters kept on the device)."""
    if prim.name == "name":
        return params["name"] != GATHERED
    if prim.name in ("device_put", "pvary"):  # free to redo: the way from the stored
        return False  # parameter to the named one is kept open, nothing of it stacked
    if prim.name == "custom_vjp_call":  # a gradient hook (an identity forward) is free too,
        jaxpr = params["call_jaxpr"].jaxpr  # and so is a gather (reduction.fsdp_gathers)
        gathered = {v for e in jaxpr.eqns if e.primitive.name == "all_gather"
                    and not regather(e.primitive, **e.params) for v in e.outvars}
        return list(jaxpr.outvars) != list(jaxpr.invars) and not set(jaxpr.outvars) <= gathered
    if prim.name == "all_gather":
        names = params["axis_name"]
        return FSDP not in (names if isinstance(names, tuple) else (names,))
    return True


def fsdp_dims(specs, stacked: int):
    """For each leaf (a tree of PartitionSpecs), the dimension sharded over fsdp as the
    layers see the leaf, with its `stacked` leading dimensions gone; None if unsharded."""
    def dim(spec):
        hits = [i for i, entry in enumerate(spec) if entry == FSDP]
        return hits[0] - stacked if hits else None
    return jax.tree.map(dim, specs, is_leaf=is_spec)


def named(mesh, spec_tree, memory_kind: str | None = None):
    """A tree of PartitionSpecs -> a tree of NamedShardings on `mesh` (in `memory_kind`:
    None for the device's default, 'pinned_host' for host memory)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), spec_tree,
                        is_leaf=is_spec)


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which x (a value, or a ShapeDtypeStruct from eval_shape
    inside shard_map) differs between devices (JAX's vma type)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def mark_varying(tree, axes: tuple[str, ...]):
    """Casts each leaf to varying over `axes` (those it is not already varying over), so
    its gradient stays a per-device partial sum until an explicit reduction."""
    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def after(index, values, like):
    """index (int32, >= 0), made to depend on every leaf of `values`: XLA schedules no read
    at it before they are computed. JAX has no control dependencies (and XLA's optimized
    program keeps no optimization barrier), so the dependence is data: max(index,
    sum - 1), the sum over the leaves of their first element's sign bit as an integer (-1
    or 0), which is index whatever the leaves hold, NaN included. The sum is reduced over
    the mesh axes the leaves vary over and `like` does not (a scalar all-reduce; tensor
    for the weight gradients), so that what index reads keeps its type."""
    signs = sum(lax.shift_right_arithmetic(lax.bitcast_convert_type(
        jnp.ravel(leaf)[0].astype(jnp.float32), jnp.int32), 31)
        for leaf in jax.tree.leaves(values))
    extra = tuple(sorted(varying_axes(signs) - varying_axes(like) - varying_axes(index)))
    return jnp.maximum(index, (lax.psum(signs, extra) if extra else signs) - 1)


def tied(values, x):
    """(values, x) through one optimization barrier, so that XLA computes every leaf of
    `values` before what reads x from here: the leaves typed like x (varying over the same
    manual mesh axes; a barrier's outputs share their axes in JAX's types, so another leaf
    would change its type or x's); the others pass untouched."""
    leaves, tree = jax.tree.flatten(values)
    axes = varying_axes(x)
    at = [i for i, leaf in enumerate(leaves) if varying_axes(leaf) == axes]
    held, x = lax.optimization_barrier(([leaves[i] for i in at], x))
    for i, leaf in zip(at, held):
        leaves[i] = leaf
    return jax.tree.unflatten(tree, leaves), x


def rewritten_at(x, index):
    """x with its first element written back to itself at `index` (int32, 0 whatever it
    holds: from `after`): the same values, made to depend on what index depends on."""
    if x.ndim == 0 or x.size == 0:
        return x
    first = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
    return lax.dynamic_update_slice(x, first, (index,) * x.ndim)


def waiting(x, deps):
    """x, made to depend on every leaf of `deps` (`after`): a select of x on a predicate
    that is always true but that XLA cannot fold (index 0 compared equal; `>= 0` it folds),
    so that nothing reads the result before they are computed. It costs a pass over x;
    `rewritten_at` costs none, but its read of x's first element is itself a reader that
    waits for nothing."""
    return jnp.where(after(jnp.int32(0), deps, like=x) == 0, x, jnp.zeros_like(x))


def zeros_as(shapes):
    """Zeros shaped, typed and varying (over manual mesh axes) as each ShapeDtypeStruct of
    `shapes` (from jax.eval_shape inside the shard_map): the start of a sum a loop carries."""
    return jax.tree.map(lambda s: mark_varying(jnp.zeros(s.shape, s.dtype),
                                               tuple(varying_axes(s))), shapes)


# Whether this JAX's all_gather takes `to=` (the typed gather), read from its signature.
_TYPED_GATHER = "to" in inspect.signature(lax.all_gather).parameters


def gather_invariant(x, axis_name: str, axis: int, size: int):
    """All-gathers x's `axis` over `axis_name` (of `size` ranks), typed "the same on every
    rank" (a value that meets replicated parameters must be); its transpose takes each
    rank's own part of the gradient. A JAX without the typed gather: place the part and
    psum (twice the bytes)."""
    if _TYPED_GATHER:
        return lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")
    width = x.shape[axis]
    full = jnp.zeros((*x.shape[:axis], width * size, *x.shape[axis + 1:]), x.dtype)
    placed = lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(axis_name) * width, axis)
    return lax.psum(placed, axis_name)


def _axes_of(spec: P) -> dict:
    """{mesh axis: the dimension it shards} of a PartitionSpec."""
    return {a: i for i, entry in enumerate(spec) if entry
            for a in (entry if isinstance(entry, tuple) else (entry,))}


def reduce_to(tree, have, want, axes: tuple[str, ...], dtype=None):
    """Reduces each leaf, sharded as `have` (a spec tree), over `axes` into `want`: summed
    (all-reduce) over the axes neither shards, reduce-scattered over those only `want`
    shards (ZeRO-1's gradients), left alone over those `have` shards (already reduced,
    e.g. by FSDP's reduce-scatter). dtype: the reductions' dtype (None: the leaf's)."""
    def reduce(x, have_spec, want_spec):
        old, new = _axes_of(have_spec), _axes_of(want_spec)
        out_dtype = x.dtype
        x = x.astype(dtype or x.dtype)
        for axis in (a for a in axes if a in new and a not in old):
            x = lax.psum_scatter(x, axis, scatter_dimension=new[axis], tiled=True)
        over = tuple(a for a in axes if a not in new and a not in old)
        return (lax.psum(x, over) if over else x).astype(out_dtype)
    return jax.tree.map(reduce, tree, have, want, is_leaf=is_spec)
