"""LayerNorm's and RMSNorm's backward in one pass: dx and the scale/bias gradients together.

Owns: the Pallas kernel, its jitted wrapper `norm_backward` and the plain-JAX reference
`reference_norm_backward` (the same math as jaxptd.model.fused's XLA form). The forward
and the custom_vjp stay in jaxptd.model.fused, whose norms' backward calls this.

Why a kernel: the scale and bias gradients are column sums over every row of dy * xhat
and dy. XLA:GPU fuses no broadcast (xhat from x and the row statistics) into a column
reduction, so its backward reads x and dy once for dx and again for the sums; this one
reads them once.

Invariants:
- x, dy are viewed as [rows, n]; each program owns a strip of `steps` row tiles
  [block_rows, block_n] (block_n the power of two at or above n: a whole row, which the
  row means of dx need), bounds-masked so any shape works. Masked elements load as 0:
  their dy is 0, so they add nothing to the row means (divided by n, not block_n) or to
  the column sums.
- Reads x, dy, the row statistics and scale once; writes dx once (x's dtype) and one f32
  row per strip of each column sum ([strips, n] partials), which the wrapper sums: a
  tiny XLA reduction, 1 / (block_rows * steps) of dx's size.
- Math in f32, as the reference: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy
  scale, xhat = (x - mean) rstd; RMSNorm (center=False) has no mean and no mean(g).
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend

_TILE_ELEMS = 4096  # elements of x per row tile: 8 warps at 16 elements per thread
_STRIPS = 128       # programs (about one per H100 SM): few partial rows to sum after


def reference_norm_backward(x, scale, mean, rstd, dy, *, center: bool):
    """(dx in x's dtype, dscale [n] f32, dbias [n] f32 or None) of y = xhat scale (+ bias),
    xhat = (x - mean) rstd; x, dy [..., n]; mean, rstd [..., 1] f32 (mean unused without
    center)."""
    xhat = (x.astype(jnp.float32) - (mean if center else 0.0)) * rstd
    dy = dy.astype(jnp.float32)
    g = dy * scale  # d xhat
    centred = g - jnp.mean(g, axis=-1, keepdims=True) if center else g
    dx = centred - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
    columns = tuple(range(x.ndim - 1))
    dbias = jnp.sum(dy, axis=columns) if center else None
    return (rstd * dx).astype(x.dtype), jnp.sum(dy * xhat, axis=columns), dbias


def _backward_kernel(*refs, rows, n, block_rows, block_n, steps, center):
    """refs: x, scale, rstd, dy, (mean,) dx, dscale, (dbias): the bracketed with center."""
    pl = backend.pl
    x_ref, scale_ref, rstd_ref, dy_ref = refs[:4]
    mean_ref, dx_ref, dscale_ref, dbias_ref = refs[4:] if center else (None, *refs[4:], None)
    strip = pl.program_id(0)
    col_ok = jnp.arange(block_n) < n                                   # [block_n]
    scale = backend.load(scale_ref.at[pl.ds(0, block_n)], mask=col_ok,
                         other=0.0).astype(jnp.float32)[None, :]

    def row_tile(step, sums):
        r0 = (strip * steps + step) * block_rows
        row_ok = r0 + jnp.arange(block_rows) < rows                    # [block_rows]
        ok = row_ok[:, None] & col_ok[None, :]
        at = (pl.ds(r0, block_rows), pl.ds(0, block_n))
        x = backend.load(x_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        dy = backend.load(dy_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        rstd = backend.load(rstd_ref.at[pl.ds(r0, block_rows)], mask=row_ok, other=0.0)
        if center:
            mean = backend.load(mean_ref.at[pl.ds(r0, block_rows)], mask=row_ok, other=0.0)
            x = x - mean[:, None]
        xhat = x * rstd[:, None]                                       # [block_rows, block_n]
        g = dy * scale
        centred = g - jnp.sum(g, axis=1, keepdims=True) / n if center else g
        dx = centred - xhat * (jnp.sum(g * xhat, axis=1, keepdims=True) / n)
        backend.store(dx_ref.at[at], (rstd[:, None] * dx).astype(dx_ref.dtype), mask=ok)
        return sums[0] + jnp.sum(dy * xhat, axis=0), sums[1] + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((block_n,), jnp.float32)
    dscale, dbias = jax.lax.fori_loop(0, steps, row_tile, (zeros, zeros))
    backend.store(dscale_ref.at[strip, pl.ds(0, block_n)], dscale, mask=col_ok)
    if center:
        backend.store(dbias_ref.at[strip, pl.ds(0, block_n)], dbias, mask=col_ok)


def _grid(rows, n):
    """(block_rows, block_n, steps, strips): power-of-two tiles of about _TILE_ELEMS
    elements, and about _STRIPS programs of `steps` tiles each."""
    pl = backend.pl
    block_n = pl.next_power_of_2(n)
    block_rows = min(pl.next_power_of_2(rows), max(1, _TILE_ELEMS // block_n))
    tiles = pl.cdiv(rows, block_rows)
    steps = pl.cdiv(tiles, min(tiles, _STRIPS))
    return block_rows, block_n, steps, pl.cdiv(tiles, steps)


def norm_backward(x, scale, mean, rstd, dy, *, center: bool, interpret: bool):
    """The norm's gradients as `reference_norm_backward`, from one kernel.

    Args:
      x, dy: [..., n] (any float dtypes; dy is read as it comes).
      scale: [n] f32. mean, rstd: [..., 1] f32 (mean unused without center).
      center: LayerNorm (True) or RMSNorm (False).
      interpret: Pallas interpret mode (CPU) or a compiled Triton kernel.
    Returns:
      dx [..., n] in x's dtype, dscale [n] f32, dbias [n] f32 (None without center).
    """
    n = x.shape[-1]
    rows = (-1,)
    stats = (rstd.reshape(rows), mean.reshape(rows)) if center else (rstd.reshape(rows),)
    dx, dscale, dbias = _backward(x.reshape(-1, n), scale, dy.reshape(-1, n), *stats,
                                  center=center, interpret=interpret)
    return dx.reshape(x.shape), dscale, dbias


@functools.partial(jax.jit, static_argnames=("center", "interpret"))
def _backward(x, scale, dy, rstd, *mean, center, interpret):
    """[rows, n] x and dy, [n] scale, [rows] rstd (and mean, with center) -> dx, dscale,
    dbias (None without center)."""
    pl = backend.pl
    rows, n = x.shape
    block_rows, block_n, steps, strips = _grid(rows, n)
    partial = backend.out_struct((strips, n), jnp.float32, x)
    call = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, n=n, block_rows=block_rows,
                          block_n=block_n, steps=steps, center=center),
        out_shape=(backend.out_struct(x.shape, x.dtype, x), partial) + (partial,) * center,
        grid=(strips,),
        compiler_params=backend.compiler_params(backend.warps_for(block_rows * block_n)),
        interpret=interpret,
        name="layer_norm_backward" if center else "rms_norm_backward",
    )
    dx, *sums = backend.call(call, x, scale, rstd, dy, *mean, interpret=interpret)
    sums = [jnp.sum(s, axis=0) for s in sums]  # [strips, n] partials -> [n]
    return dx, sums[0], sums[1] if center else None
