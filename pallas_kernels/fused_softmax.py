"""Fused scale + mask + softmax over attention scores (Megatron's fused softmax), fwd and bwd.

Owns: the Pallas kernels, their jitted wrappers, the plain-JAX reference and the
custom_vjp that joins them.

Invariants:
- One program per score row. A row of sk <= _MAX_BLOCK keys is one block, padded to the
  next power of two (Triton blocks must be): loaded once with a bounds mask, reduced in
  registers, stored once; backward reads y and dy once each and writes dx once. A longer
  row is walked in _MAX_BLOCK blocks twice (online max/sum, then normalise; backward:
  sum(y dy), then dx), so there is no upper limit on sk (Megatron's kernel has 4096) at
  the price of one more read of the row.
- Only live keys are read: the causal and explicit masks are applied to the loads, so a
  causal forward reads about half of x and its backward half of y and dy; every output
  element is written (0 for masked keys).
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

_MASKED = 1       # int8 value of a masked-out key in the kernel's mask operand
_MAX_BLOCK = 16384  # keys one program holds at once (16 warps x 32 lanes x 32 f32 each)


def _row_block(sk: int) -> int:
    """Keys per block: the row padded to a power of two, at most _MAX_BLOCK."""
    return min(backend.pl.next_power_of_2(sk), _MAX_BLOCK)


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
    return _softmax(x, kernel_mask, float(scale), bool(causal), how == "interpret",
                    _row_block(x.shape[-1]))


def _kernel_mask(mask, shape):
    """int8 [mb, mh, msq, sk] mask, each leading dim 1 (broadcast) or full; 1 = masked."""
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    assert all(m in (1, s) for m, s in zip(mask.shape, shape)), (mask.shape, shape)
    mask = jnp.broadcast_to(mask, mask.shape[:3] + shape[3:])     # keys are never broadcast
    return mask.astype(jnp.int8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _softmax(x, mask, scale, causal, interpret, block):
    return _forward(x, mask, scale=scale, causal=causal, interpret=interpret, block=block)


def _softmax_fwd(x, mask, scale, causal, interpret, block):
    y = _forward(x, mask, scale=scale, causal=causal, interpret=interpret, block=block)
    return y, (y, mask)


def _softmax_bwd(scale, causal, interpret, block, residuals, dy):
    y, mask = residuals
    dx = _backward(y, dy, mask, scale=scale, causal=causal, interpret=interpret, block=block)
    return dx, None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _keep(i, c0, sq, sk, block, mask_ref, causal):
    """Live keys among columns [c0, c0 + block) of query row i, and which are in the row.

    Returns two [block] bool arrays. The explicit mask is read only where the causal mask
    leaves a key, so a masked-out key costs no memory traffic.
    """
    cols = c0 + jnp.arange(block)                                 # [block]
    in_row = cols < sk
    keep = in_row
    if causal:
        keep &= cols <= i + (sk - sq)
    if mask_ref is not None:
        masked = backend.load(mask_ref.at[backend.pl.ds(c0, block)], mask=keep,
                              other=_MASKED)
        keep &= masked != _MASKED
    return keep, in_row


def _merge(row_max, total, scores):
    """Online softmax statistics: (max, sum of exp(score - max)) after one more block."""
    new_max = jnp.maximum(row_max, jnp.max(scores))
    safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)          # no key seen yet
    return new_max, total * jnp.exp(row_max - safe) + jnp.sum(jnp.exp(scores - safe))


def _probabilities(scores, row_max, total, sk):
    """exp(score - max) / total; a row with no live key (total 0) is uniform 1/sk."""
    safe = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    return jnp.where(total > 0, jnp.exp(scores - safe) / total, 1.0 / sk)


def _forward_kernel(x_ref, *rest, sq, sk, block, scale, causal):
    mask_ref, y_ref = rest if len(rest) == 2 else (None, rest[0])
    pl, i = backend.pl, backend.pl.program_id(2)                  # query row i

    def scores(c0):  # [block] f32: scale * x on live keys (the only ones read), else -inf
        keep, in_row = _keep(i, c0, sq, sk, block, mask_ref, causal)
        x = backend.load(x_ref.at[pl.ds(c0, block)], mask=keep, other=0.0)
        return jnp.where(keep, x.astype(jnp.float32) * scale, -jnp.inf), in_row

    def write(c0, probs, in_row):
        backend.store(y_ref.at[pl.ds(c0, block)], probs.astype(y_ref.dtype), mask=in_row)

    start = (jnp.float32(-jnp.inf), jnp.float32(0.0))
    if sk <= block:  # the whole row in registers: read x once
        s, in_row = scores(0)
        write(0, _probabilities(s, *_merge(*start, s), sk), in_row)
        return
    # Longer rows: one pass for the statistics, one to normalise (x read twice).
    row_max, total = jax.lax.fori_loop(
        0, pl.cdiv(sk, block), lambda k, stats: _merge(*stats, scores(k * block)[0]), start)

    def normalise(k, carry):
        s, in_row = scores(k * block)
        write(k * block, _probabilities(s, row_max, total, sk), in_row)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(sk, block), normalise, 0)


def _backward_kernel(y_ref, dy_ref, *rest, sq, sk, block, scale, causal):
    """dx = scale * y * (dy - sum(y * dy)). y is 0 on masked keys, so only live keys are
    read; a fully masked row reads nothing and gets dx = 0 (its output is constant)."""
    mask_ref, dx_ref = rest if len(rest) == 2 else (None, rest[0])
    pl, i = backend.pl, backend.pl.program_id(2)

    def loaded(c0):  # y, dy [block] f32 (0 off the live keys) and the in-row mask
        keep, in_row = _keep(i, c0, sq, sk, block, mask_ref, causal)
        at = pl.ds(c0, block)
        y = backend.load(y_ref.at[at], mask=keep, other=0.0).astype(jnp.float32)
        dy = backend.load(dy_ref.at[at], mask=keep, other=0.0).astype(jnp.float32)
        return y, dy, in_row

    def write(c0, y, dy, dot, in_row):
        dx = y * (dy - dot) * scale
        backend.store(dx_ref.at[pl.ds(c0, block)], dx.astype(dx_ref.dtype), mask=in_row)

    if sk <= block:
        y, dy, in_row = loaded(0)
        write(0, y, dy, jnp.sum(y * dy), in_row)
        return

    def dot_step(k, dot):
        y, dy, _ = loaded(k * block)
        return dot + jnp.sum(y * dy)

    dot = jax.lax.fori_loop(0, pl.cdiv(sk, block), dot_step, jnp.float32(0.0))

    def gradient(k, carry):
        y, dy, in_row = loaded(k * block)
        write(k * block, y, dy, dot, in_row)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(sk, block), gradient, 0)


def _row_call(kernel, rows, n_rows_in, mask, interpret, block, **params):
    """pallas_call of a row kernel on a [b, h, sq] grid; `n_rows_in` [b,h,sq,sk] inputs.

    Each program gets whole rows as its refs and walks them in blocks of `block` keys.
    The output has the shape, dtype and mesh variance of `rows`.
    """
    pl = backend.pl
    b, h, sq, sk = rows.shape
    row_spec = pl.BlockSpec((None, None, None, sk), lambda bi, hi, i: (bi, hi, i, 0))
    in_specs = [row_spec] * n_rows_in
    if mask is not None:  # broadcast dims of the mask always read its block 0
        mb, mh, msq, _ = mask.shape
        in_specs.append(pl.BlockSpec(
            (None, None, None, sk),
            lambda bi, hi, i: (bi if mb > 1 else 0, hi if mh > 1 else 0,
                               i if msq > 1 else 0, 0)))
    call = pl.pallas_call(
        functools.partial(kernel, sq=sq, sk=sk, block=block, **params),
        out_shape=backend.out_struct(rows.shape, rows.dtype, rows),
        grid=(b, h, sq),
        in_specs=in_specs,
        out_specs=row_spec,
        compiler_params=backend.compiler_params(backend.warps_for(block)),
        interpret=interpret,
        name=kernel.__name__.strip("_"),
    )
    return call


@functools.partial(jax.jit, static_argnames=("scale", "causal", "interpret", "block"))
def _forward(x, mask, *, scale, causal, interpret, block):
    """[b, h, sq, sk] x -> [b, h, sq, sk] probabilities (one kernel launch)."""
    call = _row_call(_forward_kernel, x, 1, mask, interpret, block,
                     scale=scale, causal=causal)
    operands = (x,) if mask is None else (x, mask)
    return backend.call(call, *operands, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "interpret", "block"))
def _backward(y, dy, mask, *, scale, causal, interpret, block):
    """dx = y * (dy - sum(dy * y)) * scale, zero on fully masked rows; [b, h, sq, sk]."""
    call = _row_call(_backward_kernel, y, 2, mask, interpret, block,
                     scale=scale, causal=causal)
    operands = (y, dy.astype(y.dtype)) + (() if mask is None else (mask,))
    return backend.call(call, *operands, interpret=interpret)
