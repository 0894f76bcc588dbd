"""Fused scale + mask + softmax over attention scores (Megatron's fused softmax), fwd and bwd.

Owns: the Pallas kernels, their jitted wrappers, the plain-JAX reference and the
custom_vjp that joins them.

Invariants:
- One program per score row: the whole row of sk keys, padded to the next power of two
  (Triton blocks must be), is loaded once with a bounds mask, reduced in registers and
  stored once. Backward reads y and dy once each and writes dx once.
- Masking: `causal` is bottom-right aligned (query i sees keys j <= i + sk - sq, the
  convention of KV-cache decoding and of `jax.nn.dot_product_attention`); `mask` is
  boolean, True = masked out (Megatron's convention), broadcastable to the scores.
- A row with every key masked gives the uniform distribution 1/sk (as Megatron's kernels
  do), never NaN, and zero gradient (its output does not depend on x).
- Math in f32; output and dx in the input dtype.
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend

_MASKED = 1  # int8 value of a masked-out key in the kernel's mask operand


def reference_fused_softmax(x, *, scale=1.0, causal=False, mask=None):
    """Plain-JAX softmax(scale * x) with masking; same contract as `fused_softmax`."""
    scores = x.astype(jnp.float32) * scale                       # [b, h, sq, sk]
    masked = _combined_mask(x.shape, causal, mask)
    if masked is None:
        return jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    dead_row = jnp.all(masked, axis=-1, keepdims=True)            # [b, h, sq, 1]
    scores = jnp.where(dead_row, 0.0, jnp.where(masked, -jnp.inf, scores))
    return jax.nn.softmax(scores, axis=-1).astype(x.dtype)


def _combined_mask(shape, causal, mask):
    """Boolean [.., sq, sk] mask (True = masked) from causal and `mask`, or None."""
    sq, sk = shape[-2:]
    combined = None if mask is None else jnp.broadcast_to(mask, shape)
    if causal:
        future = jnp.arange(sk)[None, :] > jnp.arange(sq)[:, None] + (sk - sq)  # [sq, sk]
        combined = future if combined is None else combined | future
    return combined


def fused_softmax(x, *, scale=1.0, causal=False, mask=None, interpret=None):
    """softmax(scale * x) over the last axis with causal and/or explicit masking.

    Args:
      x: [batch, heads, sq, sk] attention scores, f32 or bf16.
      scale: multiplies x before the softmax (1/sqrt(head_dim) in attention).
      causal: bottom-right aligned causal mask: query i sees keys j <= i + (sk - sq).
      mask: optional boolean array broadcastable to x; True means masked out.
      interpret: None = interpret on CPU, compiled on GPU; True/False force it.
    Returns:
      [batch, heads, sq, sk] probabilities in x.dtype; fully masked rows are uniform.
    """
    assert x.ndim == 4, f"fused_softmax wants [batch, heads, sq, sk], got {x.shape}"
    how = backend.mode(interpret)
    if how == "reference":
        return reference_fused_softmax(x, scale=scale, causal=causal, mask=mask)
    kernel_mask = None if mask is None else _kernel_mask(mask, x.shape)
    return _softmax(x, kernel_mask, float(scale), bool(causal), how == "interpret")


def _kernel_mask(mask, shape):
    """int8 [mb, mh, msq, sk] mask, each leading dim 1 (broadcast) or full; 1 = masked."""
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    assert all(m in (1, s) for m, s in zip(mask.shape, shape)), (mask.shape, shape)
    mask = jnp.broadcast_to(mask, mask.shape[:3] + shape[3:])     # keys are never broadcast
    return mask.astype(jnp.int8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax(x, mask, scale, causal, interpret):
    return _forward(x, mask, scale=scale, causal=causal, interpret=interpret)


def _softmax_fwd(x, mask, scale, causal, interpret):
    y = _forward(x, mask, scale=scale, causal=causal, interpret=interpret)
    return y, (y, mask)


def _softmax_bwd(scale, causal, interpret, residuals, dy):
    y, mask = residuals
    dx = _backward(y, dy, mask, scale=scale, causal=causal, interpret=interpret)
    return dx, None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _row_keep(i, sq, sk, sk_pad, mask_ref, causal):
    """Which of the sk_pad block columns of query row i are live keys; [sk_pad] bool."""
    cols = jnp.arange(sk_pad)                                     # [sk_pad]
    keep = cols < sk
    if causal:
        keep &= cols <= i + (sk - sq)
    if mask_ref is not None:
        masked = backend.load(mask_ref.at[_head(sk_pad)], mask=cols < sk, other=_MASKED)
        keep &= masked != _MASKED
    return keep


def _head(size):
    """The [0, size) slice of a row ref; size may exceed the ref, so accesses are masked."""
    return backend.pl.ds(0, size)


def _forward_kernel(x_ref, *rest, sq, sk, sk_pad, scale, causal):
    mask_ref, y_ref = rest if len(rest) == 2 else (None, rest[0])
    i = backend.pl.program_id(2)                                  # query row
    in_row = jnp.arange(sk_pad) < sk                              # [sk_pad]
    x = backend.load(x_ref.at[_head(sk_pad)], mask=in_row, other=0.0)
    keep = _row_keep(i, sq, sk, sk_pad, mask_ref, causal)
    live = jnp.max(keep.astype(jnp.int32)) > 0                    # any key visible
    scores = jnp.where(keep, x.astype(jnp.float32) * scale, -jnp.inf)     # [sk_pad] f32
    scores = jnp.where(live, scores, jnp.where(in_row, 0.0, -jnp.inf))   # dead row: uniform
    unnorm = jnp.exp(scores - jnp.max(scores))
    y = unnorm / jnp.sum(unnorm)
    backend.store(y_ref.at[_head(sk_pad)], y.astype(y_ref.dtype), mask=in_row)


def _backward_kernel(y_ref, dy_ref, *rest, sq, sk, sk_pad, scale, causal):
    mask_ref, dx_ref = rest if len(rest) == 2 else (None, rest[0])
    i = backend.pl.program_id(2)
    in_row = jnp.arange(sk_pad) < sk                              # [sk_pad]
    y = backend.load(y_ref.at[_head(sk_pad)], mask=in_row, other=0.0).astype(jnp.float32)
    dy = backend.load(dy_ref.at[_head(sk_pad)], mask=in_row, other=0.0).astype(jnp.float32)
    dx = y * (dy - jnp.sum(y * dy)) * scale
    if causal or mask_ref is not None:  # a fully masked row's output is constant in x
        keep = _row_keep(i, sq, sk, sk_pad, mask_ref, causal)
        dx = jnp.where(jnp.max(keep.astype(jnp.int32)) > 0, dx, 0.0)
    backend.store(dx_ref.at[_head(sk_pad)], dx.astype(dx_ref.dtype), mask=in_row)


def _row_call(kernel, rows, n_rows_in, mask, interpret, **params):
    """pallas_call of a row kernel on a [b, h, sq] grid; `n_rows_in` [b,h,sq,sk] inputs.

    The output has the shape, dtype and mesh variance of `rows`.
    """
    pl = backend.pl
    b, h, sq, sk = rows.shape
    sk_pad = pl.next_power_of_2(sk)
    row_spec = pl.BlockSpec((None, None, None, sk), lambda bi, hi, i: (bi, hi, i, 0))
    in_specs = [row_spec] * n_rows_in
    if mask is not None:  # broadcast dims of the mask always read its block 0
        mb, mh, msq, _ = mask.shape
        in_specs.append(pl.BlockSpec(
            (None, None, None, sk),
            lambda bi, hi, i: (bi if mb > 1 else 0, hi if mh > 1 else 0,
                               i if msq > 1 else 0, 0)))
    call = pl.pallas_call(
        functools.partial(kernel, sq=sq, sk=sk, sk_pad=sk_pad, **params),
        out_shape=backend.out_struct(rows.shape, rows.dtype, rows),
        grid=(b, h, sq),
        in_specs=in_specs,
        out_specs=row_spec,
        compiler_params=backend.compiler_params(backend.warps_for(sk_pad)),
        interpret=interpret,
        name=kernel.__name__.strip("_"),
    )
    return call


@functools.partial(jax.jit, static_argnames=("scale", "causal", "interpret"))
def _forward(x, mask, *, scale, causal, interpret):
    """[b, h, sq, sk] x -> [b, h, sq, sk] probabilities (one kernel launch)."""
    call = _row_call(_forward_kernel, x, 1, mask, interpret,
                     scale=scale, causal=causal)
    operands = (x,) if mask is None else (x, mask)
    return backend.call(call, *operands, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "interpret"))
def _backward(y, dy, mask, *, scale, causal, interpret):
    """dx = y * (dy - sum(dy * y)) * scale, zero on fully masked rows; [b, h, sq, sk]."""
    call = _row_call(_backward_kernel, y, 2, mask, interpret,
                     scale=scale, causal=causal)
    operands = (y, dy.astype(y.dtype)) + (() if mask is None else (mask,))
    return backend.call(call, *operands, interpret=interpret)
