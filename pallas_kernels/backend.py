"""The one place that chooses the Pallas backend for every kernel in this package.

Choice: Pallas's Triton backend (`jax.experimental.pallas.triton`). The kernels here are
row-wise and element-wise memory-bound ops: one program per row or tile, masked loads of a
power-of-two block, a reduction in registers. Triton expresses exactly that, runs in CPU
interpret mode (so CI tests the kernels themselves) and lowers for CUDA on a CPU machine
(so CI catches lowering errors). Mosaic GPU is the recommended Hopper backend, but its
layout primitives do not run in CPU interpret mode on jax 0.10, and its wins (TMA,
warpgroup MMA) matter for matmul-bound kernels, not for these.

Invariants:
- Only this module imports the backend; kernels use `load`, `store`, `compiler_params`.
- A JAX without the backend (or a default backend that is neither CPU nor GPU) makes
  `mode()` return "reference": the ops run their plain-JAX reference, with one warning.
- `interpret=None` means interpret mode on CPU and compiled kernels on GPU.
"""
import warnings

import jax
from jax.sharding import PartitionSpec as P

from jaxptd.parallel.varying import varying_axes  # the one reading of JAX's varying-axes type

try:  # Triton backend; its CompilerParams was named TritonCompilerParams before 0.5.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as _triton
    from jax.experimental.pallas.triton import load, store

    _COMPILER_PARAMS = getattr(_triton, "CompilerParams", None) or getattr(
        _triton, "TritonCompilerParams")
    _UNAVAILABLE = None
except (ImportError, AttributeError) as error:  # pragma: no cover - depends on the JAX build
    pl = load = store = _COMPILER_PARAMS = None
    _UNAVAILABLE = f"{type(error).__name__}: {error}"

_warned = False


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        warnings.warn(f"pallas_kernels: using the plain-JAX reference ops ({reason})",
                      RuntimeWarning, stacklevel=4)  # the op's caller
        _warned = True


def mode(interpret: bool | None) -> str:
    """How an op runs: "kernel" (compiled Triton), "interpret" or "reference".

    Args:
      interpret: True forces interpret mode, False forces compiled kernels, None picks
        interpret on CPU and compiled on GPU.
    """
    if _UNAVAILABLE is not None:
        _warn_once(f"Pallas Triton backend unavailable: {_UNAVAILABLE}")
        return "reference"
    if interpret is not None:
        return "interpret" if interpret else "kernel"
    platform = jax.default_backend()
    if platform == "cpu":
        return "interpret"
    if platform in ("gpu", "cuda", "rocm"):
        return "kernel"
    _warn_once(f"no Triton kernels for default backend {platform!r}")
    return "reference"


def compiler_params(num_warps: int, num_stages: int = 1):
    """Triton compiler parameters for a pallas_call."""
    return _COMPILER_PARAMS(num_warps=num_warps, num_stages=num_stages)


def warps_for(block_elems: int) -> int:
    """Warps for a program holding `block_elems` elements (Triton softmax tutorial rule)."""
    if block_elems >= 8192:
        return 16
    if block_elems >= 2048:
        return 8
    return 4


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """Kernel output type that varies over the same manual mesh axes as the array `like`.

    Inside `jax.shard_map(..., check_vma=True)` pallas_call refuses an output type that
    does not say how it varies; an elementwise or row kernel's output varies exactly as
    its main input does. jax 0.10 names the field `manual_axis_type`; older JAX `vma`.
    """
    aval = jax.typeof(like)
    if hasattr(aval, "manual_axis_type"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)


def call(kernel_call, *operands, interpret: bool, checked: bool = True):
    """Apply a pallas_call; its result (an array or a tuple) varies over the manual axes any
    operand varies over (a grouped GEMM's weight gradient: over the tensor axis of its
    output gradient, not only its tokens').

    Interpret mode evaluates the kernel at lowering time by re-binding its primitives on
    the (varying) blocks next to its own (invariant) constants; under
    `shard_map(check_vma=True)` jax 0.10 rejects that ("requires varying manual axes to
    match"). So in interpret mode, when an operand varies, the call runs in a nested
    `shard_map` over no new axes with check_vma=False, and the result is cast back to
    the operands' varying axes. Callers sit inside a custom_vjp, so nothing
    differentiates through the cast. Compiled Triton lowering needs none of this when
    the kernel's out_shape says how it varies (`out_struct`: `checked`); a kernel of
    JAX's own (pallas_kernels/flash.py) does not say, so it runs unchecked compiled too.
    """
    axes = set().union(*map(varying_axes, operands))
    if (not interpret and checked) or not axes:
        return kernel_call(*operands)
    def erased(*args):  # under check_vma=False an add's result type has no varying axes
        return kernel_call(*(a + jax.numpy.zeros((), a.dtype) for a in args))

    unchecked = jax.shard_map(
        erased, mesh=jax.sharding.get_abstract_mesh(), in_specs=P(), out_specs=P(),
        axis_names=set(), check_vma=False)
    result = unchecked(*operands)
    varying = tuple(sorted(axes))
    return jax.tree.map(lambda r: jax.lax.pcast(r, varying, to="varying"), result)
