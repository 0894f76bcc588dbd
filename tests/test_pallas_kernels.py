"""pallas_kernels: interpret-mode kernels against the plain-JAX references (values and
gradients, f32 and bf16), CUDA lowering of the compiled kernels, and use inside a
`jax.shard_map(check_vma=True)` over the 8 simulated CPU devices. Shapes stay tiny:
interpret mode runs the grid as a loop.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import bias_gelu, fused_softmax, reference_bias_gelu, reference_fused_softmax

SOFTMAX_MODULE = importlib.import_module("pallas_kernels.fused_softmax")
SLOW = pytest.mark.slow
# f32 atol: XLA:CPU's unoptimised code generation (the suite's, tests/conftest.py) computes
# the interpret-mode kernel's tanh less exactly than the fused reference's: GeLU's input
# gradient measured 1.3e-5 from float64 (the reference 6.3e-6; both 6.3e-6 optimised).
DTYPES = [jnp.float32, pytest.param(jnp.bfloat16, marks=SLOW)]  # the fast subset: f32
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _close(actual, expected, dtype):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               **TOL[dtype])


def _softmax_grads(fn, x, dy, **kw):
    y, vjp = jax.vjp(lambda a: fn(a, **kw), x)
    return y, vjp(dy)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal,masked", [
    pytest.param(2, 1, False, False, marks=SLOW),   # single key
    pytest.param(3, 7, True, False, marks=SLOW),    # causal, sq < sk (bottom-right aligned)
    (5, 5, True, True),                             # causal, sq == sk, plus padding mask
    (4, 33, False, True),                           # padding mask, sk not a power of two
    pytest.param(1, 130, True, False, marks=SLOW),  # one query over 130 keys
])
def test_fused_softmax_matches_reference(dtype, sq, sk, causal, masked):
    kx, kdy, km = jax.random.split(jax.random.key(sq * 1000 + sk), 3)
    x = (3 * jax.random.normal(kx, (2, 2, sq, sk))).astype(dtype)
    dy = jax.random.normal(kdy, x.shape).astype(dtype)
    mask = jax.random.bernoulli(km, 0.3, (2, 1, 1, sk)) if masked else None
    kw = dict(scale=0.7, causal=causal, mask=mask)
    y, dx = _softmax_grads(fused_softmax, x, dy, interpret=True, **kw)
    y_ref, dx_ref = _softmax_grads(reference_fused_softmax, x, dy, **kw)
    assert y.dtype == dx.dtype == dtype
    _close(y, y_ref, dtype)
    _close(dx, dx_ref, dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    """Rows longer than 8 keys take the multi-block path (as rows over 16384 keys do)."""
    monkeypatch.setattr(SOFTMAX_MODULE, "_MAX_BLOCK", 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal,masked", [
    pytest.param(3, 16, False, False, marks=SLOW),  # exactly two blocks
    (6, 21, True, True),  # three blocks, the last one partial; causal + padding mask
    pytest.param(24, 19, True, False, marks=SLOW),  # sq > sk: the first 5 rows see no key
])
def test_fused_softmax_long_rows_match_reference(small_blocks, dtype, sq, sk, causal, masked):
    assert SOFTMAX_MODULE._row_block(sk) == 8
    kx, kdy, km = jax.random.split(jax.random.key(sk), 3)
    x = (3 * jax.random.normal(kx, (1, 2, sq, sk))).astype(dtype)
    dy = jax.random.normal(kdy, x.shape).astype(dtype)
    # Row 0 of the mask hides every key: a fully masked row on top of the causal ones.
    mask = jax.random.bernoulli(km, 0.3, (1, 1, sq, sk)).at[..., 0, :].set(True) if masked else None
    kw = dict(scale=0.7, causal=causal, mask=mask)
    y, dx = _softmax_grads(fused_softmax, x, dy, interpret=True, **kw)
    y_ref, dx_ref = _softmax_grads(reference_fused_softmax, x, dy, **kw)
    _close(y, y_ref, dtype)
    _close(dx, dx_ref, dtype)


@pytest.mark.slow
def test_fully_masked_rows_are_uniform_with_zero_gradient():
    sq, sk = 4, 6
    x = jax.random.normal(jax.random.key(1), (2, 1, sq, sk))
    mask = jnp.zeros((2, 1, sq, sk), bool).at[0, :, 1].set(True)       # batch 0, row 1
    # sq > sk under causal: rows i < sq - sk see no key at all.
    for kw in (dict(mask=mask), dict(causal=True), dict(mask=mask, causal=True)):
        y, dx = _softmax_grads(fused_softmax, x, jnp.ones_like(x), interpret=True, **kw)
        _, dx_ref = _softmax_grads(reference_fused_softmax, x, jnp.ones_like(x), **kw)
        assert np.isfinite(np.asarray(dx)).all()
        _close(dx, dx_ref, jnp.float32)
    y, dx = _softmax_grads(fused_softmax, x, jax.random.normal(jax.random.key(2), x.shape),
                           mask=mask, interpret=True)
    np.testing.assert_allclose(y[0, 0, 1], np.full(sk, 1 / sk), rtol=1e-6)
    np.testing.assert_array_equal(dx[0, 0, 1], np.zeros(sk))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 33), (2, 130), (1, 1)])
def test_bias_gelu_matches_reference(dtype, shape):
    kx, kb, kdy = jax.random.split(jax.random.key(shape[-1]), 3)
    x = (2 * jax.random.normal(kx, shape)).astype(dtype)
    bias = jax.random.normal(kb, shape[-1:]).astype(dtype)
    dy = jax.random.normal(kdy, shape).astype(dtype)
    y, vjp = jax.vjp(lambda a, b: bias_gelu(a, b, interpret=True), x, bias)
    y_ref, vjp_ref = jax.vjp(reference_bias_gelu, x, bias)
    assert y.dtype == dtype
    _close(y, y_ref, dtype)
    for grad, grad_ref in zip(vjp(dy), vjp_ref(dy)):
        assert grad.dtype == dtype
        _close(grad, grad_ref, dtype)


def _cuda_kernel_count(fn, *args):
    """Number of Triton custom calls in fn's StableHLO lowered for CUDA."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("xla.gpu.triton")


def _compiled_softmax_fwd_bwd(x, mask, dy):
    y, vjp = jax.vjp(lambda a: fused_softmax(a, causal=True, mask=mask, interpret=False), x)
    return y, vjp(dy)


def test_kernels_lower_for_cuda():
    x = jnp.zeros((2, 2, 5, 130), jnp.bfloat16)
    mask = jnp.zeros((2, 1, 1, 130), bool)
    assert _cuda_kernel_count(_compiled_softmax_fwd_bwd, x, mask, x) == 2
    h, bias = jnp.zeros((3, 70, 200), jnp.bfloat16), jnp.zeros((200,), jnp.bfloat16)

    def gelu_fwd_bwd(a, b, dy):
        y, vjp = jax.vjp(lambda c, d: bias_gelu(c, d, interpret=False), a, b)
        return y, vjp(dy)

    assert _cuda_kernel_count(gelu_fwd_bwd, h, bias, h) == 2


def test_long_row_kernels_lower_for_cuda(small_blocks):
    x, mask = jnp.zeros((1, 2, 5, 37), jnp.bfloat16), jnp.zeros((1, 1, 5, 37), bool)
    assert _cuda_kernel_count(_compiled_softmax_fwd_bwd, x, mask, x) == 2


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Explicit,))


def _sharded(mesh, array, spec):
    return jax.device_put(array, NamedSharding(mesh, spec))


def test_ops_inside_shard_map_with_check_vma(mesh):
    x = jax.random.normal(jax.random.key(3), (2, 8, 3, 5))              # heads split 8 ways
    h = jax.random.normal(jax.random.key(4), (4, 16))                   # hidden split 8 ways
    bias = jax.random.normal(jax.random.key(5), (16,))

    def local(scores, act, b):  # per-shard: [2, 1, 3, 5] scores, [4, 2] act, [2] bias
        return fused_softmax(scores, scale=0.5, causal=True), bias_gelu(act, b)

    specs = (P(None, "tensor"), P(None, "tensor"), P("tensor"))
    step = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:2],
                         check_vma=True)

    def loss(fn, scores, act, b):
        probs, out = fn(scores, act, b)
        return jnp.sum(probs * probs) + jnp.sum(out * out)

    args = [_sharded(mesh, a, s) for a, s in zip((x, h, bias), specs)]
    probs, out = jax.jit(step)(*args)
    grads = jax.jit(jax.grad(lambda *a: loss(step, *a), argnums=(0, 1, 2)))(*args)

    def reference(scores, act, b):
        return reference_fused_softmax(scores, scale=0.5, causal=True), reference_bias_gelu(act, b)

    _close(jax.device_get(probs), reference(x, h, bias)[0], jnp.float32)
    _close(jax.device_get(out), reference(x, h, bias)[1], jnp.float32)
    grads_ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(x, h, bias)
    for grad, grad_ref in zip(grads, grads_ref):
        _close(jax.device_get(grad), grad_ref, jnp.float32)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=SLOW),
                                    pytest.param(True, marks=SLOW)])
def test_flash_blocks_combine_into_the_whole_attention(causal):
    """pallas_kernels.flash (JAX's Pallas flash attention, interpret mode): queries over
    two key blocks, combined by their log-sum-exps, give the attention over all the keys;
    each block's backward with the whole attention's output and log-sum-exp gives its
    share of the gradients (f32, grouped-query heads). Causal: the first block is the
    diagonal (query i sees key j <= i), the second entirely visible (earlier keys)."""
    from pallas_kernels.flash import flash_block, flash_block_grads
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (1, 64, 4, 16))
    k, v = (jax.random.normal(x, (1, 128, 2, 16)) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape)
    blocks = [(k[:, :64], v[:, :64], causal), (k[:, 64:], v[:, 64:], False)]
    # the reference: causal over the diagonal block, the other block's keys all earlier
    order = jnp.concatenate([k[:, 64:], k[:, :64]], 1), jnp.concatenate([v[:, 64:], v[:, :64]], 1)

    def whole(q, k, v):
        group = q.shape[2] // k.shape[2]
        ks, vs = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, ks) * 0.3
        if causal:  # keys 0..63 (the second block) always; 64 + j for j <= i
            seen = jnp.arange(128)[None, :] < 64 + jnp.arange(64)[:, None] + 1
            scores = jnp.where(seen, scores, -jnp.inf)
        return (jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), vs),
                jnp.swapaxes(jax.nn.logsumexp(scores, -1), 1, 2))
    out_ref, lse_ref = whole(q, *order)
    parts = [flash_block(q, kb, vb, scale=0.3, causal=c) for kb, vb, c in blocks]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * jnp.exp(l - lse)[..., None] for o, l in parts)
    _close(out, out_ref, jnp.float32)
    _close(lse, lse_ref, jnp.float32)
    grads = [flash_block_grads(q, kb, vb, out, lse, d_out, scale=0.3, causal=c)
             for kb, vb, c in blocks]
    dq, dk, dv = jax.vjp(lambda *a: whole(*a)[0], q, *order)[1](d_out)
    _close(grads[0][0] + grads[1][0], dq, jnp.float32)
    _close(jnp.concatenate([grads[1][1], grads[0][1]], 1), dk, jnp.float32)
    _close(jnp.concatenate([grads[1][2], grads[0][2]], 1), dv, jnp.float32)


@pytest.mark.parametrize("slot", [0, 2])
def test_slot_gemms_equal_the_references(slot):
    """pallas_kernels.slot_matmul: stash[slot] @ w, and the stash with stash[slot] = x @ w
    (every other slot as it was), float32, two tiles each way and two steps of D."""
    from pallas_kernels.slot_matmul import (matmul_into_slot, reference_matmul_into_slot,
                                            reference_slot_matmul, slot_matmul)
    k = jax.random.split(jax.random.key(slot), 4)
    stash = jax.random.normal(k[0], (3, 256, 128), jnp.float32)
    outputs = jax.random.normal(k[1], (3, 256, 256), jnp.float32)
    w, x = jax.random.normal(k[2], (128, 256)), jax.random.normal(k[3], (256, 128))
    at = jnp.array([slot], jnp.int32)
    _close(slot_matmul(stash, at, w, interpret=True), reference_slot_matmul(stash, at, w),
           jnp.float32)
    _close(matmul_into_slot(outputs, at, x, w, interpret=True),
           reference_matmul_into_slot(outputs, at, x, w), jnp.float32)
    with pytest.raises(ValueError, match="multiples of 128"):
        slot_matmul(stash, at, w[:, :200], interpret=True)
