"""Elementwise and norm ops with hand-written backwards that keep only what they need.

Owns the layer's memory-bound ops: LayerNorm, RMSNorm, bias + tanh-GeLU and SwiGLU's gate.
Autodiff of the plain formulas keeps every intermediate for the backward: a float32
LayerNorm keeps its float32 input, centred and normalised values (12 bytes an element), a
tanh-GeLU six [b, s, ffn] pieces. Each op here is a `jax.custom_vjp` whose residuals are
its inputs as given (the compute dtype) and, for the norms, the float32 per-row statistics
[..., 1]; the backward recomputes the rest in registers of one fused kernel. Math in
float32, outputs in the input's dtype. Korthikanti et al. (2022) count a layer's kept
activations exactly this way (34 s b h bytes: norm and GeLU inputs, not their insides).
"""
from __future__ import annotations

import contextlib
import contextvars
from functools import partial

import jax
import jax.numpy as jnp

from jaxptd.parallel.varying import mark_varying, varying_axes
from pallas_kernels.bias_gelu import _CUBIC, _SQRT_2_OVER_PI, gelu_and_grad  # the GeLU's math
from pallas_kernels.norm_backward import norm_backward, reference_norm_backward

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _varying_like(x, *params):
    """params cast to vary over the manual mesh axes x varies over (inside shard_map): a
    custom backward must return each cotangent typed like its input, so the sum over
    those axes (a norm's scale with sequence parallelism: each tensor rank holds other
    tokens) is left to autodiff of this cast, which is that psum."""
    return mark_varying(params, tuple(sorted(varying_axes(x))))


# set while a backward is traced that runs apart from its forward (`backward_apart`)
_APART = contextvars.ContextVar("jaxptd_backward_apart", default=False)


@contextlib.contextmanager
def backward_apart():
    """Within it, the backwards traced run in another program slot than their forwards (a
    pipeline's kept backward, traced when its B slot calls it): `_recompute` needs no
    barrier there, and without one XLA reads the residuals where the stash keeps them
    instead of copying them out first."""
    token = _APART.set(True)
    try:
        yield
    finally:
        _APART.reset(token)


def _recompute(residuals):
    """The residuals behind an optimization barrier: XLA would otherwise see that the
    backward recomputes what the forward computed (the GeLU's tanh, a norm's centred
    values) and keep the forward's [b, s, ffn] float32 values for it instead (seen in the
    compiled H100 program): the memory these ops exist to save. jax.checkpoint does the
    same (its prevent_cse). Not within `backward_apart`."""
    return residuals if _APART.get() else jax.lax.optimization_barrier(residuals)


def _row_sum(x, like):
    """x summed over every axis but the last, shaped and typed like `like` ([n])."""
    return jnp.sum(x, axis=tuple(range(x.ndim - 1))).astype(like.dtype)


# --------------------------------------------------------------------------- norms


def _norm_stats(x, eps: float, center: bool):
    """(mean or 0, 1 / sqrt(var + eps)) over the last axis, float32 [..., 1], from one
    pass over x (E[x] and E[x^2], as Flax's fast variance; a second pass for the centred
    variance read x again)."""
    x = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if not center:
        return jnp.zeros((), jnp.float32), jax.lax.rsqrt(mean_square + eps)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(mean_square - jnp.square(mean), 0.0)
    return mean, jax.lax.rsqrt(var + eps)


def norm_backward_form(kernels: str, platform: str, fits: bool) -> str:
    """How the norms' backward runs: "kernel" (pallas_kernels/norm_backward.py compiled)
    on a GPU target where the layer's layout `fits` it (layers.norm_form: no context or
    expert split, and a tensor split only with sequence parallelism and less than full
    recomputation); off a GPU with model.kernels=pallas that kernel in Pallas interpret
    mode ("interpret"); else "xla", the plain-JAX form's fusions.
    Where it does not fit, the compiled programs gained nothing or lost overlap with it:
    - a tensor split without sequence parallelism: the norms run on whole [b, s, h]
      activations that a pipelined B reads from its stash slot, which XLA's form reads in
      place (a fused dynamic slice) and a Pallas call only as a copy; the copies took
      what the kernel saved;
    - the context ring: a backward ring send lost the attention it had in flight;
    - a tensor split with sequence parallelism and model.remat=full: the exposed
      transfer grew by more than the kernel saved, or the step got slower.
    With sequence parallelism fewer of the backward's all-gathers have a GEMM in flight
    beside the kernel (XLA prices its own form's column-sum reduction far above its time
    and schedules that under them), but the transfer time they leave exposed grew by less
    than the kernel saved, or fell (git log: the figures and how they were counted)."""
    if platform == "gpu":
        return "kernel" if fits else "xla"
    return "interpret" if kernels == "pallas" else "xla"


def _norm_grads(form: str, x, scale, mean, rstd, dy, center: bool):
    """(dx, dscale, dbias or None) of a norm in the form `norm_backward_form` names:
    XLA:GPU fuses no broadcast into a column reduction, so its form reads x and dy again
    for the scale and bias sums; the kernel makes all three in one pass."""
    xla = partial(reference_norm_backward, center=center)
    if form == "xla":
        return xla(x, scale, mean, rstd, dy)
    if form == "interpret":
        return norm_backward(x, scale, mean, rstd, dy, center=center, interpret=True)
    # the compiled kernel where the program is lowered for CUDA; XLA's form where a GPU
    # layout's program runs on CPU (tests comparing it with the CPU layout's)
    return jax.lax.platform_dependent(
        x, scale, mean, rstd, dy, default=xla,
        cuda=partial(norm_backward, center=center, interpret=False))


def layer_norm(x, scale, bias, eps: float, dtype, backward: str = "xla"):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis -> dtype; its
    backward in the form `backward` (norm_backward_form)."""
    return _layer_norm(x, *_varying_like(x, scale, bias), eps, dtype, backward)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, scale, bias, eps: float, dtype, backward: str):
    mean, rstd = _norm_stats(x, eps, True)
    return ((x.astype(jnp.float32) - mean) * rstd * scale + bias).astype(dtype)


def _layer_norm_fwd(x, scale, bias, eps, dtype, backward):
    mean, rstd = _norm_stats(x, eps, True)
    y = ((x.astype(jnp.float32) - mean) * rstd * scale + bias).astype(dtype)
    return y, (x, scale, bias, mean, rstd)


def _layer_norm_bwd(eps, dtype, backward, residuals, dy):
    x, scale, bias, mean, rstd = _recompute(residuals)
    dx, dscale, dbias = _norm_grads(backward, x, scale, mean, rstd, dy, True)
    return dx, dscale.astype(scale.dtype), dbias.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def rms_norm(x, scale, eps: float, dtype, backward: str = "xla"):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis -> dtype; its backward in the
    form `backward` (norm_backward_form)."""
    return _rms_norm(x, *_varying_like(x, scale), eps, dtype, backward)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, scale, eps: float, dtype, backward: str):
    _, rstd = _norm_stats(x, eps, False)
    return (x.astype(jnp.float32) * rstd * scale).astype(dtype)


def _rms_norm_fwd(x, scale, eps, dtype, backward):
    _, rstd = _norm_stats(x, eps, False)
    return (x.astype(jnp.float32) * rstd * scale).astype(dtype), (x, scale, rstd)


def _rms_norm_bwd(eps, dtype, backward, residuals, dy):
    x, scale, rstd = _recompute(residuals)
    dx, dscale, _ = _norm_grads(backward, x, scale, None, rstd, dy, False)
    return dx, dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# --------------------------------------------------------------------------- activations


def erf_gelu_and_grad(u):
    """The exact GeLU u Phi(u) of float32 u (BERT's) and its derivative."""
    cdf = 0.5 * (1.0 + jax.lax.erf(u * _SQRT_HALF))
    return u * cdf, cdf + u * jnp.exp(-0.5 * u * u) * _INV_SQRT_2PI


def bias_gelu(x, bias, exact: bool = False):
    """GeLU(x + bias) -> x's dtype, the tanh approximation (GPT-2's, Megatron's) or with
    `exact` the erf form; keeps x and bias, nothing of the GeLU."""
    return _bias_gelu(x, *_varying_like(x, bias), exact)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_gelu(x, bias, exact):
    u = x.astype(jnp.float32) + bias.astype(jnp.float32)
    return (erf_gelu_and_grad if exact else gelu_and_grad)(u)[0].astype(x.dtype)


def _bias_gelu_fwd(x, bias, exact):
    return _bias_gelu(x, bias, exact), (x, bias)


def _bias_gelu_bwd(exact, residuals, dy):
    x, bias = _recompute(residuals)
    u = x.astype(jnp.float32) + bias.astype(jnp.float32)
    _, grad = (erf_gelu_and_grad if exact else gelu_and_grad)(u)
    # dx written once in x's dtype and the bias sum read from it: without the barrier XLA
    # moved the cast into the sum's kernel, so the GeLU kernel wrote dx in float32
    # [b, s, ffn] for it to read: twice the bytes of the layer's largest activation
    dx = jax.lax.optimization_barrier((dy.astype(jnp.float32) * grad).astype(x.dtype))
    return dx, _row_sum(dx.astype(jnp.float32), bias)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def bias_add(y, bias):
    """y + bias (float32 [n], cast to y's dtype), its backward reading the output gradient
    g behind an optimization barrier: the bias gradient's sum and the FP8 linear's amax
    and cast of g (model.fp8) then read the same value, and XLA makes them one kernel;
    reading g from the norm backward's kernel that makes it, they stayed three."""
    return _bias_add(y, *_varying_like(y, bias))


@jax.custom_vjp
def _bias_add(y, bias):
    return y + bias.astype(y.dtype)


def _bias_add_fwd(y, bias):
    return _bias_add(y, bias), bias


def _bias_add_bwd(bias, g):
    g = jax.lax.optimization_barrier(g)
    return g, _row_sum(g.astype(jnp.float32), bias)


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


def bias_gelu_again(x, bias):
    """GeLU(x + bias) -> x's dtype, bias_gelu's tanh GeLU written in another form,
    u / (1 + exp(-2 c (u + 0.044715 u^3))), equal to it but for rounding (a last bit of
    x's dtype, rarely): model.fp8=delayed takes fc2's input amax from it
    (tensor.fp8_twin), and XLA makes it a reduction in bias_gelu's backward kernel,
    which reads x and bias anyway. In bias_gelu's form XLA shared the tanh between the
    two and wrote it in float32 for both."""
    u = x.astype(jnp.float32) + bias.astype(jnp.float32)
    z = 2.0 * _SQRT_2_OVER_PI * (u + _CUBIC * u * u * u)
    return (u / (1.0 + jnp.exp(-z))).astype(x.dtype)


@jax.custom_vjp
def swiglu(gate, up):
    """silu(gate) * up -> gate's dtype; keeps gate and up (the two matmul outputs)."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, dy):
    gate, up = _recompute(residuals)
    g, u, dy = gate.astype(jnp.float32), up.astype(jnp.float32), dy.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    d_gate = dy * u * sig * (1.0 + g * (1.0 - sig))
    return d_gate.astype(gate.dtype), (dy * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# --------------------------------------------------------------------------- softmax


def softmax(scores, scale: float, keep, dtype):
    """softmax(scale * scores) over the last axis where `keep` (bool, broadcastable), 0
    elsewhere, computed in float32 -> dtype. Keeps only its output (in dtype, the tensor
    the probabilities-times-values matmul keeps too): the backward is Megatron's fused
    softmax's, from the output alone (autodiff kept the float32 logits and probabilities
    beside it: 10 bytes a score, against 2 with this in bfloat16)."""
    return _softmax(scores, keep, scale, jnp.dtype(dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _softmax(scores, keep, scale, dtype):
    logits = jnp.where(keep, scores.astype(jnp.float32) * scale, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _softmax_fwd(scores, keep, scale, dtype):
    probs = _softmax(scores, keep, scale, dtype)
    return probs, (probs, jnp.zeros((), scores.dtype))


def _softmax_bwd(scale, dtype, residuals, d_probs):
    probs, like = residuals
    p, g = probs.astype(jnp.float32), d_probs.astype(jnp.float32)
    d_logits = p * (g - jnp.sum(g * p, axis=-1, keepdims=True))
    return (d_logits * scale).astype(like.dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
