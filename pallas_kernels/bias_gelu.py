"""Fused bias add + tanh-approximation GeLU (Megatron's bias_gelu), forward and backward.

Owns: the Pallas kernels, their jitted wrappers, the plain-JAX reference and the
custom_vjp that joins them.

Invariants:
- x is viewed as [rows, n] (a free reshape); programs own power-of-two tiles
  [block_rows, block_n] with bounds-masked loads and stores, so any shape works.
- Forward reads x once and writes y once. Backward reads x and dy once, recomputes
  gelu'(x + bias), writes dx once, and reduces the bias gradient in the same pass: each
  program sums its column strip over `steps` row tiles into one f32 row of a
  [row_programs, n] partial, which the wrapper sums (a tiny XLA reduction, 1/(block_rows
  * steps) of dx's size, instead of re-reading dx).
- Math in f32; y and dx in x's dtype, dbias in bias's dtype.
"""
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import backend

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715
_TILE_ELEMS = 4096   # elements per program tile: 8 warps at 16 elements per thread
_BWD_STEPS = 8       # row tiles per backward program (amortises the bias partial)


def reference_bias_gelu(x, bias):
    """Plain-JAX gelu_tanh(x + bias) computed in f32; x [..., n], bias [n]."""
    u = x.astype(jnp.float32) + bias.astype(jnp.float32)
    return jax.nn.gelu(u, approximate=True).astype(x.dtype)


def bias_gelu(x, bias, *, interpret=None):
    """gelu_tanh(x + bias), fused, with a fused backward.

    Args:
      x: [..., n] activations, f32 or bf16.
      bias: [n] bias.
      interpret: None = interpret on CPU, compiled on GPU; True/False force it.
    Returns:
      [..., n] in x.dtype.
    """
    assert bias.shape == x.shape[-1:], f"bias {bias.shape} does not match x {x.shape}"
    how = backend.mode(interpret)
    if how == "reference":
        return reference_bias_gelu(x, bias)
    y = _bias_gelu(x.reshape(-1, x.shape[-1]), bias, how == "interpret")  # [rows, n]
    return y.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_gelu(x, bias, interpret):
    return _forward(x, bias, interpret=interpret)


def _bias_gelu_fwd(x, bias, interpret):
    return _forward(x, bias, interpret=interpret), (x, bias)


def _bias_gelu_bwd(interpret, residuals, dy):
    x, bias = residuals
    return _backward(x, bias, dy, interpret=interpret)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def gelu_and_grad(u):
    """gelu_tanh(u) and its derivative; u f32 (the kernels' math, and jaxptd.model.fused's
    XLA-fused op's)."""
    t = jnp.tanh(_SQRT_2_OVER_PI * (u + _CUBIC * u * u * u))
    gelu = 0.5 * u * (1.0 + t)
    grad = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _SQRT_2_OVER_PI * (
        1.0 + 3.0 * _CUBIC * u * u)
    return gelu, grad


def _tile(r0, c0, rows, n, block_rows, block_n):
    """Index slices of the tile at (r0, c0) and its in-bounds masks."""
    pl = backend.pl
    col_ok = c0 + jnp.arange(block_n) < n                          # [block_n]
    ok = (r0 + jnp.arange(block_rows) < rows)[:, None] & col_ok[None, :]
    return (pl.ds(r0, block_rows), pl.ds(c0, block_n)), ok, col_ok


def _forward_kernel(x_ref, bias_ref, y_ref, *, rows, n, block_rows, block_n):
    pl = backend.pl
    c0 = pl.program_id(1) * block_n
    at, ok, col_ok = _tile(pl.program_id(0) * block_rows, c0, rows, n, block_rows, block_n)
    x = backend.load(x_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
    bias = backend.load(bias_ref.at[pl.ds(c0, block_n)], mask=col_ok, other=0.0)
    y, _ = gelu_and_grad(x + bias.astype(jnp.float32)[None, :])  # [block_rows, block_n]
    backend.store(y_ref.at[at], y.astype(y_ref.dtype), mask=ok)


def _backward_kernel(x_ref, bias_ref, dy_ref, dx_ref, dbias_ref, *, rows, n,
                     block_rows, block_n, steps):
    pl = backend.pl
    strip, c0 = pl.program_id(0), pl.program_id(1) * block_n
    bias = backend.load(bias_ref.at[pl.ds(c0, block_n)], mask=c0 + jnp.arange(block_n) < n,
                        other=0.0).astype(jnp.float32)            # [block_n]

    def row_tile(step, dbias):
        r0 = (strip * steps + step) * block_rows
        at, ok, _ = _tile(r0, c0, rows, n, block_rows, block_n)
        x = backend.load(x_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        dy = backend.load(dy_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        _, grad = gelu_and_grad(x + bias[None, :])
        dx = jnp.where(ok, dy * grad, 0.0)                         # [block_rows, block_n]
        backend.store(dx_ref.at[at], dx.astype(dx_ref.dtype), mask=ok)
        return dbias + jnp.sum(dx, axis=0)

    dbias = jax.lax.fori_loop(0, steps, row_tile, jnp.zeros((block_n,), jnp.float32))
    backend.store(dbias_ref.at[strip, pl.ds(c0, block_n)], dbias,
                  mask=c0 + jnp.arange(block_n) < n)


def _blocks(rows, n):
    """Power-of-two tile [block_rows, block_n] of about _TILE_ELEMS elements."""
    pl = backend.pl
    block_n = min(pl.next_power_of_2(n), 1024)
    block_rows = min(pl.next_power_of_2(rows), max(1, _TILE_ELEMS // block_n))
    return block_rows, block_n


@functools.partial(jax.jit, static_argnames=("interpret",))
def _forward(x, bias, *, interpret):
    """[rows, n] x, [n] bias -> [rows, n] gelu_tanh(x + bias)."""
    pl = backend.pl
    rows, n = x.shape
    block_rows, block_n = _blocks(rows, n)
    call = pl.pallas_call(
        functools.partial(_forward_kernel, rows=rows, n=n, block_rows=block_rows,
                          block_n=block_n),
        out_shape=backend.out_struct(x.shape, x.dtype, x),
        grid=(pl.cdiv(rows, block_rows), pl.cdiv(n, block_n)),
        compiler_params=backend.compiler_params(backend.warps_for(block_rows * block_n)),
        interpret=interpret,
        name="bias_gelu_forward",
    )
    return backend.call(call, x, bias, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _backward(x, bias, dy, *, interpret):
    """dx [rows, n] (x's dtype) and dbias [n] (bias's dtype) of gelu_tanh(x + bias)."""
    pl = backend.pl
    rows, n = x.shape
    block_rows, block_n = _blocks(rows, n)
    steps = min(_BWD_STEPS, pl.cdiv(rows, block_rows))
    strips = pl.cdiv(rows, block_rows * steps)
    call = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, n=n, block_rows=block_rows,
                          block_n=block_n, steps=steps),
        out_shape=(backend.out_struct(x.shape, x.dtype, x),
                   backend.out_struct((strips, n), jnp.float32, x)),  # bias partials
        grid=(strips, pl.cdiv(n, block_n)),
        compiler_params=backend.compiler_params(backend.warps_for(block_rows * block_n)),
        interpret=interpret,
        name="bias_gelu_backward",
    )
    dx, dbias_partial = backend.call(call, x, bias, dy.astype(x.dtype), interpret=interpret)
    return dx, jnp.sum(dbias_partial, axis=0).astype(bias.dtype)
