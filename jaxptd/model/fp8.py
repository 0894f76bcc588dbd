"""FP8 GEMMs for the layers' linears (model.fp8): `einsum(spec, axes)`, the matmul of an
input x and a weight w with both in float8_e4m3fn forward and the output gradient in
float8_e5m2 backward (the "hybrid" format of Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", and of Transformer Engine), float32 accumulation, the output in x's dtype.

Scaling (model.fp8):
- `tensorwise`, current: each operand is divided by amax / the format's largest value,
  its amax taken over this step's whole tensor, so no state; each operand is read twice
  (its amax, then its cast).
- `delayed`, Transformer Engine's recipe (`delayed_einsum`): each linear keeps a parameter
  `<weight>_amax` [3, model.fp8_history] float32 (`history`): the amaxes of its input,
  weight and output gradient over the last steps, newest first. An operand is divided by
  max(its history) x 2^model.fp8_margin / the format's largest value, known before the
  operand exists, so its cast and its amax may be one pass and an FSDP shard can be cast
  before its gather; this step's amaxes leave through the history's "gradient" (a
  cotangent [3, H] with the amaxes in column 0), which the step combines over
  microbatches and ranks by maximum (`accumulate`; `spread` and varying.reduce_to's
  `largest`: once a step, not a scalar all-reduce a GEMM) and rolls into the history
  (`advance`) in place of an optimizer update. A history of zeros (a fresh run, or FP8
  switched on at resume) scales by 1 for one step, as Transformer Engine starts.
Under tensorwise scaling a tensor split over mesh axes (a rank's weight shard, its heads of
a row-parallel input, its tokens under context parallelism, its experts) takes the maximum
over the ranks that share it (`lax.pmax` over the manual axes it varies over among `axes`);
under delayed scaling the histories are the same on every rank. Either way every rank
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

from jaxptd.parallel.varying import largest_over, mark_varying, varying_axes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# the layers' linears that model.fp8 makes FP8 GEMMs (tensor.DENSE names, and EXPERTS: a
# mixture's expert GEMMs with a capacity, moe_dispatch.py); the untied head (w_head) and
# BERT's heads stay in the compute dtype, as the embedding does, and so do the dropless
# mixture's grouped GEMMs (pallas_kernels/grouped.py takes 16-bit operands)
EXPERTS = "experts"
HISTORY = "_amax"  # a linear's amax history: the parameter f"{weight name}{HISTORY}"
OPERANDS = 3  # a history's rows: the input, the weight, the output gradient
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
    amax = _amax(x, axes)
    scale = jnp.where(amax > 0, amax / _largest(dtype), jnp.float32(1))
    return _cast(x, scale, dtype), scale


def _largest(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _amax(x, axes: tuple[str, ...]):
    """max |x| (float32 []) over the ranks sharing x among `axes` (`quantize`)."""
    return largest_over(jnp.max(jnp.abs(x)).astype(jnp.float32), axes)


def _column_amax(g, axes: tuple[int, ...]):
    """max |g| (float32 []) of an output gradient, first over its token `axes` in g's dtype
    (exact): the reduction a bias gradient makes of g, so that XLA makes the two and g's
    cast one kernel reading g once (a whole-array maximum was a kernel of its own)."""
    return jnp.max(jnp.max(jnp.abs(g), axis=axes).astype(jnp.float32))


def _token_axes(spec: str) -> tuple[int, ...]:
    """The axes of an einsum 'X,W->Y''s output that come from X alone (its tokens)."""
    operands, out = spec.split("->")
    x, w = operands.split(",")
    return tuple(i for i, c in enumerate(out) if c in x and c not in w)


def _cast(x, scale, dtype):
    """x / scale in the 8-bit `dtype`, clipped to its largest value."""
    largest = _largest(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype)


def delayed_scales(history, margin: int) -> tuple:
    """A linear's amax history [3, H] -> the scales (float32 [] each) of its input, weight
    (e4m3) and output gradient (e5m2): max over the history x 2^margin / the format's
    largest value; 1 where the history holds no amax yet. Three values, each from its own
    row: sliced from one [3] array, the casts of x and of w shared it as an operand, and
    XLA fused those two casts with each other instead of x's cast with x's amax."""
    largest = (_largest(E4M3), _largest(E4M3), _largest(E5M2))
    amax = [jnp.max(history[row]) for row in range(OPERANDS)]
    return tuple(jnp.where(a > 0, a * 2.0 ** margin / top, jnp.float32(1))
                 for a, top in zip(amax, largest))


def is_history(path) -> bool:
    """Whether a parameter (or gradient) leaf, by its tree path, is an amax history."""
    last = path[-1] if path else None
    return str(getattr(last, "key", last)).endswith(HISTORY)


def _by_path(fn, *trees):
    """fn(is_history(path), *leaves) over trees of flax's or JAX's paths."""
    return jax.tree_util.tree_map_with_path(lambda p, *xs: fn(is_history(p), *xs), *trees)


def spread(params, axes: tuple[str, ...]):
    """params with the amax histories cast to varying over `axes` too (inside the step's
    shard_map, before its gradient): each rank's amaxes then stay its own until the step
    takes their maximum (varying.reduce_to's `largest`, Reduction)."""
    return _by_path(lambda h, p: mark_varying(p, axes) if h else p, params)


def accumulate(a, b):
    """Two gradient trees' sum, their amax histories' "gradients" combined by maximum (the
    largest amax of the microbatches, of the uses)."""
    return _by_path(lambda h, x, y: jnp.maximum(x, y) if h else x + y, a, b)


def observed(grads):
    """(grads with the histories' entries zero: what the optimizer sees, grads: whose
    histories' entries hold this step's amaxes in column 0, for `advance`)."""
    return _by_path(lambda h, g: jnp.zeros_like(g) if h else g, grads), grads


def advance(params, old, grads):
    """The updated params with each amax history [..., 3, H] the one in `old` rolled one
    step, this step's amaxes (column 0 of its gradient entry, `observed`) first; kept as it
    was where an amax is not finite (an overflowed step, which dynamic loss scaling
    skips)."""
    def one(h, p, o, g):
        if not h:
            return p
        rolled = jnp.concatenate([g[..., :1], o[..., :-1]], axis=-1)
        return jnp.where(jnp.all(jnp.isfinite(g[..., :1]), axis=-2, keepdims=True), rolled, o)
    return _by_path(one, params, old, grads)


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


def _maxed_to(value, axes: frozenset):
    """An amax cotangent typed as its primal (varying over `axes`): the maximum over the
    manual axes it varies over and the primal does not, cast to varying over the others."""
    value = largest_over(value, tuple(sorted(varying_axes(value) - axes)))
    return mark_varying(value, tuple(sorted(axes)))


@functools.lru_cache(maxsize=None)
def delayed_einsum(spec: str, axes: tuple[str, ...] = (), margin: int = 0,
                   gather: tuple | None = None):
    """(x, w, history [3, H]) -> einsum(spec, x, w) as an FP8 GEMM scaled from the history
    (model.fp8=delayed, the module docstring), in x's dtype; the gradients in x's and w's
    dtypes, the history's: [3, H] with this use's amaxes of x, w and the output gradient in
    column 0, zeros elsewhere. Each amax is this rank's, the maximum over ranks taken only
    where the history does not vary as the amax does: the step passes the histories in
    varying over every axis (`spread`) and takes the maximum once, after the backward, not
    an all-reduce of a scalar a GEMM. (`axes`: for tensorwise's signature; unused.)

    twin (optional, not differentiated): x computed again from its inputs (a barrier
    between, so XLA does not merge the two), whose amax is taken in x's place: an input
    that an expensive elementwise kernel makes (the MLP's GeLU) has then a single user, the
    cast, which XLA fuses into that kernel, and the twin's amax is a second kernel reading
    those inputs; with two users XLA wrote x in float32 and read it again for both.

    gather (FSDP per matmul, model/tensor.py): (axis, dim, dtype) for w a shard split on
    `dim` over `axis`: the shard is cast to e4m3 with the history's scale and gathered as
    its bytes, half of a 16-bit gather, forward and again in the backward (only the shard's
    bytes are kept); w's gradient is reduce-scattered into the shard in `dtype`. Optimization
    barriers tie the forward's gather to x and the backward's to the output gradient, as
    the 16-bit FSDP matmul's do."""
    to_x, to_w = transposed(spec)
    tokens = _token_axes(spec)

    def whole(q):  # a shard's bytes -> the whole weight in e4m3
        if gather:
            q = lax.all_gather(q, gather[0], axis=gather[1], tiled=True)
        return lax.bitcast_convert_type(q, E4M3)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
    def product(x, w, history, twin, dtypes, vma):
        return forward(x, w, history, twin, dtypes, vma)[0]

    def forward(x, w, history, twin, dtypes, vma):
        if gather:
            x, w = lax.optimization_barrier((x, w))
        scales = delayed_scales(history, margin)  # x, w, the output gradient
        qx, qw = _cast(x, scales[0], E4M3), _bits(_cast(w, scales[1], E4M3))
        y = _product(spec, qx, whole(qw), scales[0] * scales[1], dtypes[0])
        return y, (_bits(qx), qw, scales, _amax(twin, ()), _amax(w, ()), history)

    def backward(dtypes, vma, kept, g):
        qx, qw, scales, amax_x, amax_w, history = kept
        if gather:
            g, qw = lax.optimization_barrier((g, qw))
        qx, qg = lax.bitcast_convert_type(qx, E4M3), _cast(g, scales[2], E5M2)
        dx = _product(to_x, qg, whole(qw), scales[2] * scales[1], dtypes[0])
        dw = _product(to_w, qx, qg, scales[0] * scales[2], gather[2] if gather else dtypes[1])
        if gather:
            dw = lax.psum_scatter(dw, gather[0], scatter_dimension=gather[1], tiled=True)
        amax_g = _column_amax(g, tokens)
        amaxes = jnp.stack([_maxed_to(a, vma[2]) for a in (amax_x, amax_w, amax_g)])
        dh = jnp.zeros_like(history).at[:, 0].set(amaxes)
        return _reduced_to(dx, vma[0]), _reduced_to(dw.astype(dtypes[1]), vma[1]), dh, None

    product.defvjp(forward, backward)
    return lambda x, w, history, twin=None: product(
        x, w, history, x if twin is None else twin, (x.dtype, w.dtype),
        tuple(varying_axes(v) for v in (x, w, history)))
