"""jaxptd's one place that reads or sets the varying-manual-axes (vma) type of values inside
the step's manual shard_map, and the data dependences it uses to order XLA's work.

Inside the step's manual shard_map, values carry JAX's vma type: `varying_axes` reads it
(whichever field this JAX names it by), `mark_varying` sets it, `gather_invariant`
all-gathers into an invariant value (with a fallback for a JAX without the typed gather)
and `reduce_to` undoes it by reduction; `after` makes an index depend on values (an order
XLA must keep), reducing over the axes they vary over, and `rewritten_at` and `waiting`
an array.
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxptd.parallel.sharding import is_spec


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
        _first(leaf), jnp.int32), 31) for leaf in jax.tree.leaves(values))
    extra = tuple(sorted(varying_axes(signs) - varying_axes(like) - varying_axes(index)))
    return jnp.maximum(index, (lax.psum(signs, extra) if extra else signs) - 1)


def _first(leaf):
    """leaf's first element, float32, on the device: a leaf in host memory (offload.optimizer's
    gradients) is sliced there and the element moved, since XLA's GPU compiler runs
    arithmetic on host memory on the host, and could not lay out a reshape of it."""
    corner = lax.slice(leaf, (0,) * leaf.ndim, (1,) * leaf.ndim)
    if jax.typeof(leaf).memory_space == jax.memory.Space.Host:
        corner = jax.device_put(corner, jax.memory.Space.Device)
    return corner.reshape(()).astype(jnp.float32)


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


def reduce_to(tree, have, want, axes: tuple[str, ...], dtype=None, largest=None):
    """Reduces each leaf, sharded as `have` (a spec tree), over `axes` into `want`: summed
    (all-reduce) over the axes neither shards, reduce-scattered over those only `want`
    shards (ZeRO-1's gradients), left alone over those `have` shards (already reduced,
    e.g. by FSDP's reduce-scatter). dtype: the reductions' dtype (None: the leaf's).
    largest(path): the leaves whose maximum is taken instead of the sum, over every axis
    they vary over that `have` does not shard (not scattered: model/fp8.py's amax
    histories)."""
    def reduce(path, x, have_spec, want_spec):
        old, new = _axes_of(have_spec), _axes_of(want_spec)
        if largest is not None and largest(path):
            return largest_over(x, tuple(sorted(varying_axes(x) - set(old))))
        out_dtype = x.dtype
        x = x.astype(dtype or x.dtype)
        for axis in (a for a in axes if a in new and a not in old):
            x = lax.psum_scatter(x, axis, scatter_dimension=new[axis], tiled=True)
        over = tuple(a for a in axes if a not in new and a not in old)
        return (lax.psum(x, over) if over else x).astype(out_dtype)
    return jax.tree_util.tree_map_with_path(reduce, tree, have, want, is_leaf=is_spec)


def largest_over(x, axes: tuple[str, ...]):
    """x's maximum over those of the manual `axes` it varies over (invariant over them)."""
    over = tuple(a for a in axes if a in varying_axes(x))
    return lax.pmax(x, over) if over else x
