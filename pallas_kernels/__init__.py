"""Fused Pallas kernels for the PTD-P transformer (Megatron's fused ops), one file per op.

    from pallas_kernels import fused_softmax, bias_gelu

Each module holds the kernel, its jitted wrapper, the plain-JAX reference and the
custom_vjp (`norm_backward.py`, imported where used, holds only a backward: the norms'
forward and custom_vjp are jaxptd.model.fused's, which calls it); `flash.py` (imported where used: `from pallas_kernels.flash import ...`) holds
no kernel of its own, only the context ring's calls into JAX's Pallas flash attention, and
`grouped.py` (`from pallas_kernels.grouped import grouped_matmul`) none either, only the
mixture of experts' grouped GEMM on JAX's Mosaic-GPU (Hopper) ragged-dot kernels, which
it calls directly, `lax.ragged_dot` off a GPU; `slot_matmul.py` (imported where used) GEMMs
that read or write a stash slot chosen at run time in place, benchmarked against XLA's
slot copies and not yet called by the pipeline. `backend.py` is the one place that picks the
Pallas backend (Triton) for the kernels of this package and falls back to the references,
with one warning, when it is missing.

No bias_dropout_add kernel, on purpose. Measured on CPU (jax 0.10.2, [8, 512, 1024]
bf16): given the keep mask, XLA compiles residual + dropout(x + bias) into ONE fusion
that touches 29.4 MB, exactly one read of x, residual and mask and one write; with `jax.random.bernoulli` the op touches
260 MB, of which 239 MB is the threefry bit generation alone. The add/scale/select is
already fused; the cost is the RNG, which Pallas's Triton backend has no primitive for.
The lever is the PRNG (e.g. `jax_default_prng_impl=rbg`, XLA's Philox RngBitGenerator on
GPU), not a kernel. XLA:GPU fusion of the threefry path is unmeasured (no GPU here).
"""
from pallas_kernels.bias_gelu import bias_gelu, reference_bias_gelu
from pallas_kernels.fused_softmax import fused_softmax, reference_fused_softmax

__all__ = ["bias_gelu", "fused_softmax", "reference_bias_gelu", "reference_fused_softmax"]
