"""The products `tensor.matmul` hands a dense() weight to, besides a plain einsum: a layer's
whose backward runs apart from its forward (`apart_einsum`: float32 weight gradients for a
pipeline's sums), the FP8 GEMMs (`fp8_product`, jaxptd/model/fp8.py) and a matmul whose
FSDP shard is gathered for it alone (`fsdp_matmul`). Each takes (x, w, history=None).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.model import fp8
from jaxptd.parallel.varying import mark_varying, varying_axes


_IN_WEIGHT_DTYPE = contextvars.ContextVar("jaxptd_weight_dtype_grads", default=False)


@contextlib.contextmanager
def weight_dtype_grads():
    """Within it, backwards traced give `apart_einsum`'s weight gradients in w's dtype
    (a pipeline's chunks: a chunk index that varies by rank makes every slot read and
    write the sums whole, where float32 gradients double the bytes; figures: the git
    log)."""
    token = _IN_WEIGHT_DTYPE.set(True)
    try:
        yield
    finally:
        _IN_WEIGHT_DTYPE.reset(token)


@functools.lru_cache(maxsize=None)
def apart_einsum(spec: str):
    """(x, w, history=None) -> einsum(spec, x, w) in x's dtype, as `matmul`'s, for a layer
    whose backward runs apart from its forward (Layout.apart: a pipeline's kept backward a
    layer at a time): its weight gradient comes out of the GEMM in float32 whatever w's
    dtype (JAX takes a float32 cotangent of a 16-bit primal), so that the add to the
    pipeline's float32 sums is the GEMM's epilogue (in w's dtype XLA makes the add a
    kernel of its own every slot; figures: BENCHMARKS.md). x and w first vary over the
    same mesh axes (as the einsum made them): the transpose of that (f's all-reduce) stays
    outside."""
    operands, out = spec.split("->")
    xs, ws = operands.split(",")

    @jax.custom_vjp
    def product(x, w):
        return jnp.einsum(spec, x, w.astype(x.dtype))

    def forward(x, w):
        return product(x, w), (x, w)

    def backward(kept, g):
        x, w = kept
        g_w = jnp.einsum(f"{xs},{out}->{ws}", x, g, preferred_element_type=jnp.float32)
        return (jnp.einsum(f"{out},{ws}->{xs}", g, w.astype(x.dtype)),
                g_w.astype(w.dtype) if _IN_WEIGHT_DTYPE.get() else g_w)

    product.defvjp(forward, backward)

    def call(x, w, history=None):
        axes = tuple(sorted(varying_axes(x) | varying_axes(w)))
        return product(*mark_varying((x, w), axes))
    return call


def fp8_product(spec: str, axes: tuple[str, ...], margin: int | None):
    """(x, w, history) -> the FP8 GEMM: fp8.einsum (tensorwise: margin None, no history)
    or fp8.delayed_einsum."""
    if margin is None:
        return lambda x, w, history=None: fp8.einsum(spec, axes)(x, w)
    return fp8.delayed_einsum(spec, axes, margin)


@functools.lru_cache(maxsize=None)
def fsdp_matmul(spec: str, dim: int, axis: str, dtype: str, fp8_axes: tuple | None):
    """einsum(spec, x, w) for w this rank's FSDP shard, split on `dim` over `axis`: the
    weight is all-gathered in `dtype`, cast to x's, for this one matmul, and gathered again
    for its backward, whose weight gradient the gather's transpose reduce-scatters into the
    shard (float32). One matmul's weight (the PyTorch FSDP post wrapped each linear, 4 h^2
    at most, in its own FSDP unit) is whole at a time, not a layer's 12 h^2: optimization
    barriers tie the forward's gather to x and the backward's to the output gradient, so XLA
    cannot gather ahead (no prefetch: the gather is not overlapped with the matmul before
    it). With tensorwise FP8 (`fp8_axes` not None) the gathered weight is quantized for the
    matmul (delayed scaling gathers the shard already in FP8: fp8.delayed_einsum)."""
    def gathered(w, like):
        whole = lax.all_gather(w.astype(dtype), axis, axis=dim, tiled=True)
        if fp8_axes is not None:
            return fp8.einsum(spec, fp8_axes)(like, whole)
        return jnp.einsum(spec, like, whole.astype(like.dtype))

    @jax.custom_vjp
    def gathered_matmul(x, w):
        x, w = lax.optimization_barrier((x, w))
        return gathered(w, x)

    def forward(x, w):
        return gathered_matmul(x, w), (x, w)  # the shard, not the gathered weight, is kept

    def backward(kept, g):
        x, w = kept
        g, w = lax.optimization_barrier((g, w))
        return jax.vjp(lambda x, w: gathered(w, x), x, w)[1](g)  # (its forward: unused)

    gathered_matmul.defvjp(forward, backward)
    return lambda x, w, history=None: gathered_matmul(x, w)  # (no history: 16-bit, tensorwise)
