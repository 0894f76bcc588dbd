"""GEMMs that read their left operand from, or write their output into, one slot of a stash
chosen at run time, in place: the pipeline's stash copies without the copies. A candidate
kernel, measured (bench/kernels.py's slot_gemm rows), not yet called by the executor.

Owns: the Pallas kernels, their wrappers `slot_matmul` (stash[slot] @ w) and
`matmul_into_slot` (stash with stash[slot] = x @ w) and their plain-JAX references.

Why: a pipelined rank stores what each F keeps in a slot of a stash buffer chosen at run
time and its B reads it back. XLA 0.10.2 fuses neither the dynamic slice into the GEMM
that reads the slot nor the dynamic update into the GEMM that writes it (not even at the
loop counter, nor a static slot: BENCHMARKS.md), so every kept GEMM output is copied into
its slot and every GEMM operand out of it. These kernels take the stash whole and the slot
as an int32 operand, and address the slot's rows in their loads and stores.

Invariants:
- stash [K, M, D] (read) or [K, M, N] (write), w [D, N], x [M, D]; M and N multiples of
  BLOCK_M and BLOCK_N, D of BLOCK_K (ValueError otherwise); slot int32 [1], 0 <= slot < K
  (not checked: an index out of range reads or writes out of bounds).
- One program per [BLOCK_M, BLOCK_N] output tile; a float32 accumulator over D, the
  output in the stash's (read) or x's (write) dtype, as the references.
- matmul_into_slot aliases the stash to its output: only stash[slot] is written, and
  inside a loop whose carry holds the stash XLA updates it in place (a stash not donated
  at a jit boundary is copied once first).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # Triton's Hopper GEMM tile, 4 warps, 3 stages


def reference_slot_matmul(stash, slot, w):
    """stash[slot] @ w, float32 accumulation, in the stash's dtype."""
    a = lax.dynamic_index_in_dim(stash, slot[0], 0, keepdims=False)
    return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(stash.dtype)


def reference_matmul_into_slot(stash, slot, x, w):
    """stash with stash[slot] = x @ w (float32 accumulation, in the stash's dtype)."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(stash.dtype)
    return lax.dynamic_update_index_in_dim(stash, y, slot[0], 0)


def _tile_product(a_tile, w_ref, d: int):
    """sum over D of a_tile(k) [BLOCK_M, BLOCK_K] @ w's [BLOCK_K, BLOCK_N] tile, float32."""
    pl = backend.pl
    j = pl.program_id(1)

    def step(k, acc):
        b = w_ref[pl.ds(k * BLOCK_K, BLOCK_K), pl.ds(j * BLOCK_N, BLOCK_N)]
        return acc + jnp.dot(a_tile(k), b, preferred_element_type=jnp.float32)
    return lax.fori_loop(0, d // BLOCK_K, step, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))


def _read_kernel(slot_ref, stash_ref, w_ref, out_ref, *, d: int):
    pl = backend.pl
    i, j, slot = pl.program_id(0), pl.program_id(1), slot_ref[0]
    acc = _tile_product(
        lambda k: stash_ref[slot, pl.ds(i * BLOCK_M, BLOCK_M), pl.ds(k * BLOCK_K, BLOCK_K)],
        w_ref, d)
    out_ref[pl.ds(i * BLOCK_M, BLOCK_M), pl.ds(j * BLOCK_N, BLOCK_N)] = acc.astype(out_ref.dtype)


def _write_kernel(slot_ref, x_ref, w_ref, _stash_in, stash_ref, *, d: int):
    pl = backend.pl
    i, j, slot = pl.program_id(0), pl.program_id(1), slot_ref[0]
    acc = _tile_product(
        lambda k: x_ref[pl.ds(i * BLOCK_M, BLOCK_M), pl.ds(k * BLOCK_K, BLOCK_K)], w_ref, d)
    stash_ref[slot, pl.ds(i * BLOCK_M, BLOCK_M), pl.ds(j * BLOCK_N, BLOCK_N)] = \
        acc.astype(stash_ref.dtype)


def _check(m: int, d: int, n: int):
    if m % BLOCK_M or n % BLOCK_N or d % BLOCK_K:
        raise ValueError(f"slot GEMM [{m}, {d}] x [{d}, {n}]: M and N must be multiples of "
                         f"{BLOCK_M} and {BLOCK_N}, D of {BLOCK_K}")


@functools.partial(jax.jit, static_argnames="interpret")
def slot_matmul(stash, slot, w, *, interpret: bool):
    """stash[slot] @ w: stash [K, M, D], slot int32 [1], w [D, N] -> [M, N] (module
    docstring); interpret: Pallas interpret mode (CPU) or a compiled Triton kernel."""
    _, m, d = stash.shape
    n = w.shape[1]
    _check(m, d, n)
    call = backend.pl.pallas_call(
        functools.partial(_read_kernel, d=d), grid=(m // BLOCK_M, n // BLOCK_N),
        out_shape=backend.out_struct((m, n), stash.dtype, stash),
        compiler_params=backend.compiler_params(4, 3), interpret=interpret)
    return backend.call(call, slot, stash, w, interpret=interpret)


@functools.partial(jax.jit, static_argnames="interpret")
def matmul_into_slot(stash, slot, x, w, *, interpret: bool):
    """stash with stash[slot] = x @ w, in place: stash [K, M, N], slot int32 [1], x [M, D],
    w [D, N] (module docstring)."""
    m, d = x.shape
    n = w.shape[1]
    _check(m, d, n)
    call = backend.pl.pallas_call(
        functools.partial(_write_kernel, d=d), grid=(m // BLOCK_M, n // BLOCK_N),
        out_shape=backend.out_struct(stash.shape, stash.dtype, stash),
        input_output_aliases={3: 0}, compiler_params=backend.compiler_params(4, 3),
        interpret=interpret)
    return backend.call(call, slot, x, w, stash, interpret=interpret)
