"""FP8 GEMMs for the layers' linears (model.fp8): `einsum(spec, axes)`, the matmul of an
input x and a weight w with both in float8_e4m3fn forward and the output gradient in
float8_e5m2 backward (the "hybrid" format of Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", and of Transformer Engine), float32 accumulation, the output in x's dtype.

Scaling is tensorwise and current (`model.fp8=tensorwise`): each operand is divided by
amax / the format's largest value, its amax taken over this step's whole tensor, so no
state. A tensor split over mesh axes (a rank's weight shard, its heads of a row-parallel
input, its tokens under context parallelism, its experts) takes the maximum over the ranks
that share it (`lax.pmax` over the manual axes it varies over among `axes`): every rank
scales by the same number, the single device's, so a layout computes what one device does
for the same microbatch. Data and pipe ranks hold other microbatches and layers: theirs
are other tensors.

The dot takes the 8-bit operands themselves (`preferred_element_type` float32, the scales'
product applied to its result): XLA's GPU compiler makes it one GEMM with f8 operands and
the rescale fused. Quantize-dequantize around a 16-bit dot (Flax's fp8_ops pattern) was
compiled into a bf16 GEMM by XLA 0.10.2 for H100 when the dequantized values were 16-bit;
Flax's ops also keep delayed-scaling state as variables and reduce no amax across ranks.
The backward keeps x and w in FP8 (a byte an element) and makes both gradients from them
and the quantized output gradient: x's as the output gradient times w, w's as x times it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.parallel.varying import varying_axes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# the layers' linears that model.fp8 makes FP8 GEMMs (tensor.DENSE names, and EXPERTS: a
# mixture's expert GEMMs with a capacity, moe_dispatch.py); the untied head (w_head) and
# BERT's heads stay in the compute dtype, as the embedding does, and so do the dropless
# mixture's grouped GEMMs (pallas_kernels/grouped.py takes 16-bit operands)
EXPERTS = "experts"
LINEARS = ("w_qkv", "w_out", "w_fc1", "w_fc2", "w_q", "w_kv", "w_o", "w_gate", "w_up",
           "w_down", EXPERTS)


def transposed(spec: str) -> tuple[str, str]:
    """An einsum 'X,W->Y' -> its two gradients' einsums: ('Y,W->X', 'X,Y->W')."""
    operands, out = spec.split("->")
    x, w = operands.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


def quantize(x, dtype, axes: tuple[str, ...]):
    """x -> (x / scale in `dtype`, scale float32 []): scale = amax(|x|) / dtype's largest
    value, amax over the ranks sharing x among `axes`; 1 where x is all zeros."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    shared = tuple(sorted(varying_axes(amax) & set(axes)))
    if shared:
        amax = lax.pmax(amax, shared)
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, jnp.float32(1))
    q = jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype)
    return q, scale


def _product(spec: str, a, b, scale, dtype):
    """einsum(spec) of two 8-bit operands, float32 accumulation, times `scale`, in
    `dtype`."""
    y = jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return (y * scale).astype(dtype)


def _bits(q):
    """An FP8 value kept for the backward as its bytes (uint8). Kept as a float8_e4m3fn,
    a residual of jax.checkpoint (model.remat, FSDP's layer gather, a scan's stacks) went
    through the lax.reduce_precision JAX 0.10.2 puts on every floating residual, with
    float8_e4m3fn's finfo (4 exponent bits, 3 of mantissa) read as IEEE's: magnitudes
    above 240 became infinities, then NaN in e4m3fn (which has no infinity)."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def _reduced_to(grad, axes: frozenset):
    """A cotangent summed over the manual axes it varies over and its primal (varying over
    `axes`) does not: what autodiff's transpose of the broadcast would do."""
    extra = tuple(sorted(varying_axes(grad) - axes))
    return lax.psum(grad, extra) if extra else grad


@functools.lru_cache(maxsize=None)
def einsum(spec: str, axes: tuple[str, ...] = ()):
    """(x, w) -> einsum(spec, x, w) as an FP8 GEMM (module docstring), in x's dtype; the
    gradients in x's and w's dtypes. `axes`: the manual mesh axes over which a tensor may
    be split (amax reduced over those it varies over)."""
    to_x, to_w = transposed(spec)

    # the primals' dtypes and varying axes reach the backward as static arguments
    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
    def product(x, w, dtypes, vma):
        return forward(x, w, dtypes, vma)[0]

    def forward(x, w, dtypes, vma):
        (qx, sx), (qw, sw) = quantize(x, E4M3, axes), quantize(w, E4M3, axes)
        return _product(spec, qx, qw, sx * sw, dtypes[0]), (_bits(qx), sx, _bits(qw), sw)

    def backward(dtypes, vma, kept, g):
        qx, sx, qw, sw = kept
        qx, qw = lax.bitcast_convert_type(qx, E4M3), lax.bitcast_convert_type(qw, E4M3)
        qg, sg = quantize(g, E5M2, axes)
        dx = _product(to_x, qg, qw, sg * sw, dtypes[0])
        dw = _product(to_w, qx, qg, sx * sg, dtypes[1])
        return _reduced_to(dx, vma[0]), _reduced_to(dw, vma[1])

    product.defvjp(forward, backward)
    return lambda x, w: product(x, w, (x.dtype, w.dtype), (varying_axes(x), varying_axes(w)))
