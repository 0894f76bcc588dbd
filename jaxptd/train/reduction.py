"""How parameters enter the step's shard_map and how their gradients leave it: FSDP's
all-gathers of parameter shards where they are used (`fsdp_gathers`), a use's preparation
of its parameters (`compose`: brought from host memory, the reduction hook, the gather),
and the reduction of the gradients over data and pipe (`Reduction`): all-reduced, or with
ZeRO-1 reduce-scattered into the optimizer state's shards, once after the step's backward
or, unpipelined, layer by layer inside the last microbatch's backward."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd import model as models
from jaxptd.model import fp8
from jaxptd.parallel.mesh import DATA, FSDP, PIPE, TENSOR, TOKENS
from jaxptd.model.tensor import Layout
from jaxptd.parallel.sharding import GATHERED, fsdp_dims, is_spec
from jaxptd.parallel.varying import largest_over, mark_varying, reduce_to
from jaxptd.pipeline.schedules import V_SHAPED, head_rank
from jaxptd.train.state import StateLayout

REDUCED = (*TOKENS, PIPE)  # the axes gradients are reduced over


def fsdp_gathers(state: StateLayout, layout: Layout):
    """(gather the ends, gather a layer's subtree) for use inside the shard_map: FSDP's
    all-gathers of parameter shards in optimizer.grad_reduce_dtype, named GATHERED so
    the layer's backward gathers them again rather than keeping them; their transpose
    reduce-scatters the gradients. With parallel.fsdp_unit=matmul a layer's dense()
    weights are left to `dense`, which gathers each for its own matmul
    (layout.fsdp), and this gathers the rest of the layer (biases, norms: O(h)).
    (None, None) without FSDP."""
    if state.config.parallel.fsdp_size == 1:
        return None, None
    dtype = jnp.dtype(state.config.optimizer.grad_reduce_dtype)
    compute = jnp.dtype(state.config.model.dtype)

    def gatherer(dims_tree, layers: bool):
        flat_dims = {path: None if path[-1] in dict(layout.fsdp) else dim
                     for path, dim in traverse_util.flatten_dict(dims_tree).items()}

        def gather(tree):  # any subtree of dims_tree, matched by path
            flat = traverse_util.flatten_dict(tree)
            for path, x in flat.items():
                dim = flat_dims[path]
                if dim is not None and layers and path[-1] in models.DENSE:
                    gathered = _gather_for_matmul(dim, compute, dtype, x.dtype)
                    flat[path] = checkpoint_name(gathered(x), GATHERED)
                elif dim is not None:
                    whole = lax.all_gather(x.astype(dtype), FSDP, axis=dim, tiled=True)
                    flat[path] = checkpoint_name(whole.astype(x.dtype), GATHERED)
            return traverse_util.unflatten_dict(flat)
        return gather

    return (gatherer(fsdp_dims(models.ends(state.param_specs), 0), False),
            gatherer(fsdp_dims(state.param_specs["layers"], state.stacked), True))


@functools.lru_cache(maxsize=None)
def _gather_for_matmul(dim: int, compute, reduce, dtype):
    """shard (a layer's dense() weight, `dtype`) -> the whole weight as its matmul uses it,
    gathered over fsdp on `dim`: cast to the compute dtype before the gather (the values
    of a gather in grad_reduce_dtype, `reduce`, the bytes of the compute dtype), so that
    nothing between the gather and the layer's use is a value sharding.regather lets the
    layer's jax.checkpoint keep (the cast after it was: every layer's whole weights kept
    from the forward to the backward, which FSDP exists to avoid); the
    gradient reduce-scattered in optimizer.grad_reduce_dtype (`reduce`), as the gather's
    transpose did."""
    @jax.custom_vjp
    def gathered(shard):  # (rounded through grad_reduce_dtype, as the gather in it did)
        return lax.all_gather(shard.astype(reduce).astype(compute), FSDP, axis=dim,
                              tiled=True)

    def backward(_, g):
        part = lax.psum_scatter(g.astype(reduce), FSDP, scatter_dimension=dim, tiled=True)
        return (part.astype(dtype),)

    gathered.defvjp(lambda shard: (gathered(shard), None), backward)
    return gathered


def compose(gather, hook, fetch: bool = False):
    """The parameter preparation of one use (the ends, or one layer and its slice of the
    extra values), None when there is nothing to do: with `fetch` (offload.optimizer
    unpipelined: step.Policy.streams) the stored values brought from host memory to the
    device, then the reduction hook, then FSDP's gather."""
    if hook is None and gather is None and not fetch:
        return None

    def prepare(tree, *more):
        if fetch:  # (the transpose sends the gradient back to host memory)
            tree, more = jax.device_put((tree, more), jax.memory.Space.Device)
            tree = jax.tree.map(lambda x: checkpoint_name(x, GATHERED), tree)  # not kept
        if hook is not None:
            tree = hook(tree, *more)
        return tree if gather is None else gather(tree)
    return prepare


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_to_gradient(p, acc, largest: bool = False):
    """p; its gradient gets acc added (the microbatches before the last), or with `largest`
    (an amax history's, model/fp8.py) their maximum taken."""
    return p


_add_to_gradient.defvjp(lambda p, acc, largest: (p, acc),
                        lambda largest, acc, g: (jnp.maximum(g, acc) if largest else g + acc,
                                                 jnp.zeros_like(acc)))


def _reduce_scatter_gradient(axis: str, dim: int, dtype):
    """p -> p, whose gradient is reduce-scattered over `axis` on `dim` in its backward,
    this rank's part placed where it belongs in a zero gradient of p's shape (ZeRO-1: the
    step keeps only that part)."""
    @jax.custom_vjp
    def hook(p):
        return p

    def backward(_, g):
        part = lax.psum_scatter(g.astype(dtype), axis, scatter_dimension=dim, tiled=True)
        where = lax.axis_index(axis) * part.shape[dim]
        return (lax.dynamic_update_slice_in_dim(jnp.zeros_like(g), part.astype(g.dtype),
                                                where, dim),)
    hook.defvjp(lambda p: (p, None), backward)
    return hook


class Reduction:
    """How the step reduces gradients over data (and pipe): once, after everything
    (`after`), or, unpipelined, inside the last microbatch's backward (`hooks`): each
    parameter's gradient, plus the sum of the microbatches before, is all-reduced (the
    transpose of casting the parameter to varying where a layer uses it) or with ZeRO-1
    reduce-scattered as soon as its layer's backward is done (Megatron's
    --overlap-grad-reduce), so it can overlap the backward of the layers below."""

    def __init__(self, state: StateLayout, streams: bool):
        self.state, self.streams = state, streams
        self.dtype = jnp.dtype(state.config.optimizer.grad_reduce_dtype)
        zero1 = state.config.optimizer.zero1
        self.scatter_dims = jax.tree.map(
            lambda have, want: next((i for i, e in enumerate(want) if e == DATA and (
                len(have) <= i or have[i] != DATA)), None) if zero1 else None,
            state.param_specs, state.grads_specs, is_leaf=is_spec)

    def after(self, grads, part=lambda tree: tree):
        """Local gradient sums -> reduced (and ZeRO-1 scattered), at the end of the step;
        `part`: which subtree of the gradients `grads` is (e.g. models.ends). An ends
        leaf, pipelined, is held over pipe (jaxptd/train/state.py): not reduced over it, but a tied
        one summed over the first and last stage's ranks (the others hold zeros)."""
        state = self.state
        par = state.config.parallel
        last = head_rank(par.schedule in V_SHAPED, par.pipe, par.chunks)
        pair = [(0, last), (last, 0)]

        def tied_sum(path, g):  # [1, ...] this stage's slot
            if state.kind(path) != "both" or last == 0:  # V-shaped: one slot holds both
                return g
            return g + lax.ppermute(g.astype(self.dtype), PIPE, pair).astype(g.dtype)
        grads = jax.tree_util.tree_map_with_path(tied_sum, grads)
        return reduce_to(grads, part(state.param_specs), part(state.grads_specs), REDUCED,
                         self.dtype, largest=fp8.is_history)

    def scattered_varying(self, params):
        """The last microbatch's parameters: the ZeRO-1 leaves varying over data already
        (their hook scatters the gradient; a cast inside would sum it), model.fp8=delayed's
        amax histories varying over every axis (fp8.spread: their maximum in keep_parts),
        the rest invariant (their gradient is summed by the transpose of the cast to varying
        in `hook`)."""
        return fp8.spread(jax.tree.map(lambda p, dim: p if dim is None else mark_varying(
            p, (DATA,)), params, self.scatter_dims), (*REDUCED, TENSOR))

    def hook(self, params, acc, dims):
        """params as the model uses them in the last microbatch; acc the local gradient
        sums of the microbatches before (None: it is the only one); dims: each leaf's
        ZeRO-1 dimension there."""
        def one(path, p, dim, a=None):
            if fp8.is_history(path):  # varying (fp8.spread): its maximum in keep_parts
                return p if a is None else _add_to_gradient(p, a, True)
            if dim is not None:  # scattered over data once fsdp and pipe have summed it
                p = _reduce_scatter_gradient(DATA, dim, self.dtype)(p)
            # summed over the axes p is cast over (the transpose of the cast), acc first
            p = mark_varying(p, REDUCED)
            return p if a is None else _add_to_gradient(p, a)
        return jax.tree_util.tree_map_with_path(one, params, dims,
                                                *(() if acc is None else (acc,)))

    def hooks(self, acc):
        """(the ends' hook, a layer's hook, the layers' values it takes: acc's) of the last
        microbatch, acc the gradient sums of those before (None: the only one)."""
        dims, state = self.scatter_dims, self.state
        layer_dims = jax.tree.map(lambda d: None if d is None else d - state.stacked,
                                  dims["layers"])
        acc_ends = acc and models.ends(acc)
        if acc and self.streams:  # (the layers' slices are brought with their layer)
            acc_ends = jax.device_put(acc_ends, jax.memory.Space.Device)
        return (lambda ends: self.hook(ends, acc_ends, models.ends(dims)),
                lambda layer, acc_layer: self.hook(layer, acc_layer, layer_dims),
                acc and acc["layers"])

    def keep_parts(self, grads):
        """After the hooks: each ZeRO-1 leaf's own part of its full-size gradient (and the
        amax histories' entries their maximum over the ranks)."""
        def part(path, g, dim):
            if fp8.is_history(path):  # this rank's amaxes -> every rank's maximum
                return largest_over(g, (*REDUCED, TENSOR))
            if dim is None:
                return g
            size = g.shape[dim] // self.state.mesh.shape[DATA]
            return lax.dynamic_slice_in_dim(g, lax.axis_index(DATA) * size, size, dim)
        return jax.tree_util.tree_map_with_path(part, grads, self.scatter_dims)
