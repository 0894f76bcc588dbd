"""The order a layer stack's backward runs in, where XLA left free would pick a worse one
on a GPU: the identities whose backward makes one gradient wait for others, the
dependence made data (jaxptd/parallel/varying.py's `after`, `rewritten_at`, `waiting`).
`weights_first` says when a stack uses them (jaxptd/model/apply.py's layers).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxptd.config import ModelConfig
from jaxptd.model.tensor import ATTENTION_OUT, Layout
from jaxptd.parallel.varying import after, rewritten_at, varying_axes, waiting


def weights_first(cfg: ModelConfig, layout: Layout, taped: bool) -> bool:
    """Whether a layer's backward runs its weight gradients before it passes its input
    gradient on (`weight_gradients_first`) and, where the step reduces each layer's
    gradients in its backward, a layer's input gradient waits for those of a layer above
    it, reduced (`reduced_ahead`)."""
    return layout.platform == "gpu" and (layout.offload_activations or (
        cfg.remat == "full" and not taped and layout.context == 1))


@jax.custom_vjp
def _gradient_after(x, tree):
    """The identity on x and a tree, whose backward makes x's gradient depend on every
    leaf of the tree's (the dependence is data: varying.after and rewritten_at):
    `weight_gradients_first` and `reduced_ahead`."""
    return x, tree


def _gradient_after_bwd(_, grads):
    dx, dtree = grads
    return rewritten_at(dx, after(jnp.int32(0), dtree, like=dx)), dtree

_gradient_after.defvjp(lambda x, tree: ((x, tree), None), _gradient_after_bwd)


def weight_gradients_first(x, params):
    """The identity on a layer's input and parameters, whose backward makes the input
    gradient it passes on depend on the layer's parameter gradients: the layer below starts
    its backward only once this layer's weight-gradient GEMMs have run. Left free, XLA
    runs the input-gradient chain first (the critical path) and defers every layer's
    weight gradients, each keeping its inputs: with offload.activations most layers'
    recomputed activations at once; with model.remat=full and the layers unrolled, a
    stage's layers recomputed at once (this saves that memory at the same static time).
    Not with model.remat=minimal, whose matmul outputs are kept anyway, nor for a
    zero-bubble B slot (`perturbations`: its dense() weights' gradients are the W slot's;
    made a dependence here, XLA computed them in the B slot too, at a cost in time), nor
    with context parallelism (the ring's last backward send of a layer then overlapped
    nothing: tests/test_h100.py). The dependence is data (`_gradient_after`). GPU programs
    only: XLA's CPU schedule is another, which this made larger (the PyTorch FSDP runs'
    proxies). Figures: BENCHMARKS.md and the git log."""
    return _gradient_after(x, params)


# reduced_ahead's distance: layer i's input gradient waits for the reduced gradients of
# layer i + AHEAD, so each reduction has the backward of the AHEAD - 1 layers between to
# run beside (1 layer at 1: none left where XLA's all-reduce combiner merges two layers'
# reductions into one, as it does below 128 MiB a layer: in the H100 compile of a small
# offload step most all-reduces then had no GEMM in flight, at 2 most had).
AHEAD = 2


def reduced_ahead(x, ahead):
    """The identity on layer i's input and layer i + AHEAD's stored parameters (what `prepare`
    turns into what that layer computes with), whose backward makes layer i's input
    gradient wait for the gradient of those parameters (`_gradient_after`), by then past
    prepare's transpose: all-reduced over data (the step's hook). So each layer's
    reduction runs beside the backward of the layers between it and the one that waits
    for it. Left free, XLA's scheduler queued them, one at a time, behind the last
    layers' backward, so that about half of offload.activations' all-reduces had no GEMM
    in flight; with this nearly all do (the two bottom layers', which nothing waits for,
    have only the embedding's gradient after them), at the same static time. Only with
    `weights_first` and no FSDP (in the H100 compile, (2,1,4) SP without recomputation
    took more time, its all-reduces split where they had been combined; FSDP lost overlap
    of its reduce-scatters)."""
    return _gradient_after(x, ahead)


def waiting_attention_out(params, deps):
    """A layer's weights with its attention output projection (tensor.ATTENTION_OUT, the
    first matmul after the attention: what XLA runs just before it is the attention and
    the QKV projection) made to wait for `deps` (varying.waiting), where it varies over
    every mesh axis the leaves of deps do (no reduction needed)."""
    axes = frozenset().union(*map(varying_axes, jax.tree.leaves(deps)))
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({
        k: waiting(w, deps) if k[-1] in ATTENTION_OUT and axes <= varying_axes(w) else w
        for k, w in flat.items()})
