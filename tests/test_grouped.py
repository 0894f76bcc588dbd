"""pallas_kernels.grouped: the grouped GEMM against an einsum per group (values and
gradients, empty groups, rows past the groups), on CPU both ways it runs there: the
`lax.ragged_dot` path, and the GPU path's padding, masking and custom_vjp with the Mosaic
kernels replaced by stand-ins that refuse what the kernels refuse and leave the rows past
the groups as garbage, as the forward kernel does. The kernels themselves compile in
tests/test_h100.py (deviceless H100); they run only on a Hopper GPU (bench/kernels.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped
from pallas_kernels.grouped import grouped_matmul

# group 1 and group 4 are empty; 3 rows past the groups
SIZES = [5, 0, 7, 3, 0, 2]


def reference(x, w, group_sizes):
    """Group by group: each group's rows (a mask of the row range) times its weight."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(x.shape[0])
    y = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for g in range(w.shape[0]):
        inside = (rows >= ends[g] - group_sizes[g]) & (rows < ends[g])
        y = y + jnp.where(inside[:, None], jnp.einsum(
            "mk,kn->mn", x.astype(jnp.float32), w[g].astype(jnp.float32)), 0.0)
    return y


def _operands(m, k, n, sizes, dtype, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n)).astype(dtype)
    dy = jax.random.normal(kd, (m, n)).astype(dtype)
    return x, w, jnp.array(sizes, jnp.int32), dy


def _value_and_grads(fn, x, w, group_sizes, dy):
    y, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes), x, w)
    return (y, *vjp(dy.astype(y.dtype)))


def _assert_matches_reference(fn, x, w, group_sizes, dy, tol):
    """y, dx, dw within tol x the largest reference value; zero rows past the groups."""
    got = _value_and_grads(fn, x, w, group_sizes, dy)
    want = _value_and_grads(reference, x, w, group_sizes, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.shape == b.shape and a.dtype == x.dtype, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), name
    past = int(group_sizes.sum())
    assert past < x.shape[0]
    assert not np.asarray(got[0][past:]).any() and not np.asarray(got[1][past:]).any()


def test_cpu_path_matches_einsum_per_group():
    x, w, group_sizes, dy = _operands(20, 6, 5, SIZES, jnp.float32)
    _assert_matches_reference(lambda *a: grouped_matmul(*a, gpu=False), x, w, group_sizes,
                              dy, 1e-5)


def test_float32_on_gpu_falls_back_to_ragged_dot():
    x, w, _, _ = _operands(20, 6, 5, SIZES, jnp.float32)
    assert not grouped.uses_kernels(x, w, gpu=True)
    assert grouped.uses_kernels(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gpu=True)
    assert not grouped.uses_kernels(x.astype(jnp.bfloat16), w, gpu=True)  # mixed


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """The two Mosaic kernels replaced by plain JAX with their shape rules; the forward
    kernel's unwritten rows past the groups filled with NaN."""
    def aligned(*dims):
        assert all(d % grouped.BLOCK == 0 for d in dims), dims

    def ragged_dot(lhs, rhs, group_sizes, transpose_rhs):
        aligned(*lhs.shape, *rhs.shape[1:])
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        y = jax.lax.ragged_dot(lhs, rhs, group_sizes)
        rows = jnp.arange(y.shape[0])[:, None]
        return jnp.where(rows < jnp.sum(group_sizes), y, jnp.nan).astype(lhs.dtype)

    def weight_grad(x, dy, group_sizes):
        aligned(*x.shape, *dy.shape)
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(x, dy, group_sizes, dims).astype(x.dtype)

    monkeypatch.setattr(grouped, "_ragged_dot_kernel", ragged_dot)
    monkeypatch.setattr(grouped, "_weight_grad_kernel", weight_grad)


@pytest.mark.parametrize("m,k,n", [(20, 6, 5), (256, 128, 128)])  # padded; aligned
def test_gpu_path_matches_einsum_per_group(stand_in_kernels, m, k, n):
    x, w, group_sizes, dy = _operands(m, k, n, SIZES, jnp.bfloat16, 1)
    _assert_matches_reference(lambda *a: grouped_matmul(*a, gpu=True), x, w, group_sizes,
                              dy, 1e-2)
