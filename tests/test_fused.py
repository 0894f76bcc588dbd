"""The lean ops of jaxptd/model/fused.py: values and gradients equal autodiff of the plain
formulas (float32, float64 reference), and what their backward keeps is their inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxptd.model import fused


def _layer_norm(x, scale, bias, eps):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def _rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps) * scale


def _gelu(u):
    return 0.5 * u * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (u + 0.044715 * u ** 3)))


CASES = {
    "layer_norm": (lambda x, s, b: fused.layer_norm(x, s, b, 1e-5, jnp.float32),
                   lambda x, s, b: _layer_norm(x, s, b, 1e-5)),
    "rms_norm": (lambda x, s, b: fused.rms_norm(x, s, 1e-5, jnp.float32),
                 lambda x, s, b: _rms_norm(x, s, 1e-5)),
    "bias_gelu": (lambda x, s, b: fused.bias_gelu(x, b), lambda x, s, b: _gelu(x + b)),
    "bias_gelu_erf": (lambda x, s, b: fused.bias_gelu(x, b, exact=True),
                      lambda x, s, b: jax.nn.gelu(x + b, approximate=False)),
    "swiglu": (lambda x, s, b: fused.swiglu(x, x[..., ::-1] * 0.7),
               lambda x, s, b: jax.nn.silu(x) * x[..., ::-1] * 0.7),
}


@pytest.mark.parametrize("name", CASES)
def test_values_and_gradients_equal_autodiff_of_the_formula(name):
    ours, formula = CASES[name]
    rng = np.random.default_rng(0)
    x = rng.normal(1.5, 2.0, (3, 5, 64))  # a mean away from 0: the variance's cancellation
    scale, bias = rng.normal(1.0, 0.3, 64), rng.normal(0.0, 0.3, 64)
    cot = rng.normal(size=x.shape)

    def grads(fn, dtype):
        args = [jnp.asarray(a, dtype) for a in (x, scale, bias)]
        y, vjp = jax.vjp(fn, *args)
        return (y, *vjp(jnp.asarray(cot, dtype)))

    with jax.enable_x64(True):
        expected = grads(formula, jnp.float64)
    got = grads(ours, jnp.float32)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-5)


def test_backward_keeps_only_the_inputs():
    """jax.vjp's residuals of bias_gelu are x and the bias (no [.., n] intermediate), and a
    norm's are x plus [.., 1] row statistics."""
    x = jnp.ones((4, 8, 32), jnp.bfloat16)
    b = jnp.zeros((32,), jnp.float32)

    def residual_shapes(fn, *args):
        _, vjp = jax.vjp(fn, *args)
        return sorted(leaf.shape for leaf in jax.tree.leaves(vjp))

    assert residual_shapes(fused.bias_gelu, x, b) == sorted([x.shape, b.shape])
    kept = residual_shapes(lambda x, s, b: fused.layer_norm(x, s, b, 1e-5, jnp.bfloat16),
                           x, b + 1, b)
    assert [s for s in kept if s[-1] == 32 and len(s) == 3] == [x.shape]  # x once
    assert all(s[-1] in (1, 32) for s in kept)  # else: statistics [.., 1] and the params


def test_softmax_keeps_its_output_and_matches_autodiff():
    """fused.softmax: values and the scores' gradient equal autodiff of the plain masked
    softmax (float64 reference), masked keys take no probability and no gradient; its
    backward keeps the output only (and a scalar of the scores' dtype)."""
    rng = np.random.default_rng(1)
    scores = rng.normal(0, 3, (2, 3, 8, 8))
    keep = np.tril(np.ones((8, 8), bool)) & (rng.random((2, 1, 1, 8)) > 0.2)
    keep[..., 0] = True  # every row keeps a key
    cot = rng.normal(size=scores.shape)

    def plain(s, keep):
        return jax.nn.softmax(jnp.where(keep, s * 0.5, -jnp.inf), axis=-1)
    with jax.enable_x64(True):
        y, vjp = jax.vjp(lambda s: plain(s, jnp.asarray(keep)), jnp.asarray(scores))
        expected = (y, vjp(jnp.asarray(cot))[0])
    y, vjp = jax.vjp(lambda s: fused.softmax(s, 0.5, jnp.asarray(keep), jnp.float32),
                     jnp.asarray(scores, jnp.float32))
    got = (y, vjp(jnp.asarray(cot, jnp.float32))[0])
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(got[0])[~np.broadcast_to(keep, scores.shape)] == 0)
    kept = [leaf.shape for leaf in jax.tree.leaves(vjp)]
    assert sorted(kept) == sorted([(), scores.shape]), kept
