"""Grouped GEMMs for the mixture of experts: rows sorted by expert, each expert's rows
times its own weight, x [M, K] @ w[g] [K, N] for the g-th run of `group_sizes` rows.

Owns: `grouped_matmul` and the calls into JAX's Pallas Mosaic-GPU (Hopper) kernels behind
it (`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu.ragged_dot`, forward and input
gradient, and `transposed_ragged_dot_mgpu.transposed_ragged_dot`, weight gradient), their
tiles, the padding to those tiles and the custom_vjp that ties the three together. No
kernel of our own, as pallas_kernels/flash.py: JAX's are the maintained ones.

Why not `lax.ragged_dot` on the GPU: XLA:GPU (jax 0.10.2, compiled for an H100) lowers it
to a DENSE product over all experts, x masked per group and laid out [M, G * K] times w
as [G * K, N] (G times the FLOPs), and its backward likewise. It is the reference here and
what runs on CPU, where it is exact and cheap at test sizes.

Contract: x [M, K], w [G, K, N] of one dtype, group_sizes [G] int32 with sum <= M; rows
of x past sum(group_sizes) give zero rows (and get zero gradient). Result [M, N] in x's
dtype, accumulated in float32 (the kernels' wgmma accumulator; lax.ragged_dot's bf16
product on CPU is float32-accumulated too).

GPU path (`gpu=True`, bf16 or f16):
- Tiles for an H100 (not autotuned here: no GPU was at hand; the figures in bench/kernels.py
  say how they do): 128 x 128 output tiles, 64-deep K steps, 4 steps in flight (4 x 32 KiB
  of operand tiles + the 32 KiB output tile: 160 of the 227 KiB shared memory an SM
  offers), 8 N-tiles a row of the space-filling order so the 132 SMs working at once share
  x's rows and w's columns in L2. The 128 x 128 float32 accumulator is 128 registers a
  thread of the kernels' one warpgroup; 128 x 256 would be all 255.
- Shapes: every one of M, K, N is padded up to a multiple of 128 where it is not (the
  kernels refuse K and N off their blocks; M off the 128-row block is padded too, as the
  row tiles' TMA reads past the end are then never needed). The cost where it happens: a
  copy of x (M x K) and, for K or N, of w (G x K x N, the big one: 940 MB for Mixtral's
  up-projection) every call, plus the FLOPs of the zero rows and columns. Mixtral's and
  Llama's sizes are multiples of 128, so none is paid there; the MoE layer should size
  its token buffer (M) to a multiple of 128.
- Rows past the groups: the forward kernel never writes them (its output buffer is
  uninitialised there), so the forward and input gradient are masked with a `where` on
  the row index: one elementwise pass over [M, N] / [M, K] that XLA fuses into the
  consumer where it can.
- float32 (or mixed dtypes) falls back to `lax.ragged_dot`: the kernels are written for
  16-bit wgmma operands (their tiles and swizzles assume 2-byte elements; float32 would be
  tf32 wgmma, which JAX's kernels neither tile for nor test).
- The weight-gradient kernel reads `jax.devices()[0].core_count` (the number of SMs, its
  persistent grid) at trace time. In the deviceless H100 compile (shared/DESIGN.md) the
  process's devices are CPUs, which have no such field; no argument or public API sets
  it (jax 0.10.2). `_transposed_ragged_dot` is therefore JAX's own function rebuilt from
  its code with one global changed: `jax` is `_FixedCores`, jax whose `devices()`, when
  the process has no GPU, is one device with the H100 SXM's 132 cores (the grid JAX's
  forward kernel hardcodes); with GPUs it is the GPUs, their own SM count. JAX's module
  is not touched.
- Inside `jax.shard_map` (check_vma on) it compiles as alone (measured: expert-sharded
  x, w and group sizes over 8 deviceless H100s, forward and both gradients: three
  kernels, no dot): the calls go through `backend.call` unchecked, as flash.py's.

For the dispatch around it (measured, jax 0.10.2, not used here): `lax.ragged_all_to_all`
has a transpose. jax.grad through a shard_map over 8 deviceless H100s of one
ragged_all_to_all compiles to an async `ragged-all-to-all-start`/`-done` pair forward and
another backward (the cotangent sent back the reverse way: operands and output swapped,
send and receive sizes swapped), plus two 8-element `all-to-all`s (async too) exchanging
the offsets, which the transpose needs in the senders' terms. XLA:CPU has no
ragged-all-to-all, so it only compiles and runs on the GPU.
"""
import functools
import types

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as _forward
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as _transposed

from jaxptd.parallel.varying import mark_varying, varying_axes
from jaxptd.runtime.target import TARGETS
from pallas_kernels import backend

BLOCK = 128  # output tile rows and columns, and what M, K, N are padded to
BLOCK_K = 64  # contraction step (128 bytes of bf16: one swizzled row)
STEPS = 4  # contraction steps in flight (shared-memory stages)
GRID_BLOCK_N = 8  # N-tiles a band of the space-filling tile order
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
_TILES = dict(block_m=BLOCK, block_n=BLOCK, block_k=BLOCK_K, max_concurrent_steps=STEPS,
              grid_block_n=GRID_BLOCK_N)


class _FixedCores:
    """`jax` as JAX's transposed kernel sees it: jax, except that `devices()` without a
    GPU (the deviceless compile: CPU devices, no SM count) is one device with the H100's
    SM count (the module docstring says why); on GPUs, the GPUs."""
    cores = TARGETS["h100"].chip.cores

    def devices(self, *args, **kwargs):
        found = jax.devices(*args, **kwargs)
        if found and hasattr(found[0], "core_count"):
            return found
        return [types.SimpleNamespace(core_count=self.cores)]

    def __getattr__(self, name):
        return getattr(jax, name)


_transposed_ragged_dot = types.FunctionType(
    _transposed.transposed_ragged_dot.__code__,
    {**vars(_transposed), "jax": _FixedCores()}, "transposed_ragged_dot",
    _transposed.transposed_ragged_dot.__defaults__,
    _transposed.transposed_ragged_dot.__closure__)
_transposed_ragged_dot.__kwdefaults__ = _transposed.transposed_ragged_dot.__kwdefaults__


def _ragged_dot_kernel(lhs, rhs, group_sizes, transpose_rhs):
    """lhs [M, C] @ rhs[g] (rhs [G, C, O], or [G, O, C] transposed) -> [M, O]; rows past
    the groups unwritten."""
    def run(lhs, rhs, group_sizes):
        return _forward.ragged_dot(lhs, rhs, group_sizes=group_sizes,
                                   transpose_rhs=transpose_rhs, **_TILES)
    return backend.call(run, lhs, rhs, group_sizes, interpret=False, checked=False)


def _weight_grad_kernel(x, dy, group_sizes):
    """x [M, K], dy [M, N] -> [G, K, N]: group g's rows of x transposed times dy's (zero
    for an empty group; rows past the groups left out)."""
    def run(x, dy, group_sizes):
        return _transposed_ragged_dot(x, dy, group_sizes=group_sizes, **_TILES)
    return backend.call(run, x, dy, group_sizes, interpret=False, checked=False)


def _in_groups(y, group_sizes):
    """y [M, ...] with the rows past sum(group_sizes) set to zero."""
    rows = jnp.arange(y.shape[0]).reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def _mosaic(x, w, group_sizes):
    """The GPU grouped GEMM on tile-aligned shapes (M, K, N multiples of BLOCK)."""
    return _in_groups(_ragged_dot_kernel(x, w, group_sizes, False), group_sizes)


def _mosaic_fwd(x, w, group_sizes):
    return _mosaic(x, w, group_sizes), (x, w, group_sizes)


def _mosaic_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    # dx = dy [M, N] @ w[g]^T: the same kernel reading w [G, K, N] as [G, out=K, in=N].
    dx = _in_groups(_ragged_dot_kernel(dy, w, group_sizes, True), group_sizes)
    # dw[g] = x_g^T [K, rows] @ dy_g [rows, N]: ragged over the contraction.
    dw = _weight_grad_kernel(x, dy, group_sizes)
    return dx, dw, None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)


def _pad_to(a, axis, multiple):
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def uses_kernels(x, w, gpu: bool) -> bool:
    """Whether grouped_matmul runs the Mosaic-GPU kernels for these operands."""
    return gpu and x.dtype == w.dtype and any(x.dtype == d for d in KERNEL_DTYPES)


@functools.partial(jax.jit, static_argnames="gpu")
def grouped_matmul(x, w, group_sizes, *, gpu: bool):
    """y [M, N]: y[rows of group g] = x[rows of group g] @ w[g]; zero past the groups.

    Args:
      x: [M, K], rows sorted by group.
      w: [G, K, N].
      group_sizes: [G] int32, rows of each group in order; sum <= M.
      gpu: the Mosaic-GPU kernels (an H100 or another Hopper GPU, or a deviceless compile
        for one) for bf16/f16; otherwise, and for float32, `lax.ragged_dot`.
    """
    if not uses_kernels(x, w, gpu):
        return jax.lax.ragged_dot(x, w, group_sizes)
    # inside a shard_map: both operands typed as varying over the axes either does (rows
    # the same on every tensor rank meet a tensor rank's expert slice), so the kernels'
    # gradients have their operands' types; the casts' transposes sum over those axes
    axes = tuple(sorted(varying_axes(x) | varying_axes(w)))
    x, w = mark_varying(x, axes), mark_varying(w, axes)
    (m, k), n = x.shape, w.shape[2]
    x_tiled = _pad_to(_pad_to(x, 0, BLOCK), 1, BLOCK)
    w_tiled = _pad_to(_pad_to(w, 1, BLOCK), 2, BLOCK)
    return _mosaic(x_tiled, w_tiled, group_sizes.astype(jnp.int32))[:m, :n]
