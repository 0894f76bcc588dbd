"""pallas_kernels/norm_backward.py, the norms' one-pass backward (interpret mode on CPU):
equal to the XLA form (jaxptd.model.fused's, `reference_norm_backward`) in values and
gradients, float32 to rounding, for LayerNorm and RMSNorm; inside a manual shard_map
with sequence parallelism (each tensor rank's scale and bias sums added over tensor);
in a pipelined, tensor-parallel step with sequence parallelism; lowered for CUDA."""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import assert_trees_close, fixed_batches, make_setup, placed_state, \
    reference_loss_and_grads
from jaxptd.model import fused
from jaxptd.train.step import build_grads
from pallas_kernels.norm_backward import norm_backward, reference_norm_backward

MODULE = importlib.import_module("pallas_kernels.norm_backward")
TIGHT = dict(rtol=2e-6, atol=2e-6)  # float32: the same math, summed in another order


def _inputs(shape, dtype, seed=0):
    kx, kdy, ks = jax.random.split(jax.random.key(seed), 3)
    x = (3 * jax.random.normal(kx, shape) + 1.5).astype(dtype)  # a mean away from 0
    dy = jax.random.normal(kdy, shape).astype(dtype)
    scale = 1 + 0.3 * jax.random.normal(ks, shape[-1:])
    return x, dy, scale, x.astype(jnp.float32)


def _norm(center, form):
    if center:
        return lambda x, s, b: fused.layer_norm(x, s, b, 1e-5, x.dtype, form)
    return lambda x, s, b: fused.rms_norm(x, s, 1e-5, x.dtype, form)


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("shape, strips", [((3, 7, 48), None), ((37, 200), 4), ((2, 1), None)])
def test_kernel_equals_the_xla_form(center, shape, strips, monkeypatch):
    """The kernel's dx and column sums against the reference, from the same statistics: n
    not a power of two, rows not a multiple of the tile, and (strips) several row tiles a
    program, whose partial sums the wrapper adds."""
    if strips:
        monkeypatch.setattr(MODULE, "_STRIPS", strips)
    x, dy, scale, xf = _inputs(shape, jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.var(xf, -1, keepdims=True) + 1e-5)
    got = norm_backward(x, scale, mean, rstd, dy, center=center, interpret=True)
    want = reference_norm_backward(x, scale, mean, rstd, dy, center=center)
    assert (got[2] is None) == (want[2] is None) == (not center)
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, **TIGHT)


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_gradients_equal_the_xla_form(center, dtype):
    """fused.layer_norm / rms_norm with the kernel's backward: the gradients of x (in x's
    dtype), scale and bias equal the XLA form's (bfloat16 dx: to its last bit)."""
    x, dy, scale, _ = _inputs((4, 5, 96), dtype, seed=1)
    bias = jnp.linspace(-1, 1, 96)

    def grads(form):
        y, vjp = jax.vjp(_norm(center, form), x, scale, bias)
        return (y, *vjp(dy))

    got, want = grads("interpret"), grads("xla")
    assert got[1].dtype == dtype
    for g, w in zip(got, want):
        tol = TIGHT if dtype == jnp.float32 else dict(rtol=8e-3, atol=8e-3)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


@pytest.mark.parametrize("center", [True, False])
def test_sequence_parallel_sums_the_scale_gradient_over_tensor(center):
    """Inside shard_map(check_vma=True), tokens split over 4 tensor ranks (sequence
    parallelism) and the batch over 2 data ranks, scale and bias replicated: every rank's
    kernel sums its own tokens, and the gradients are those of the whole batch."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x, dy, scale, _ = _inputs((2, 8, 24), jnp.float32, seed=2)
    bias = jnp.linspace(-1, 1, 24)
    tokens = P("data", "tensor")

    def loss(norm, x, scale, bias):
        return jnp.sum(norm(x, scale, bias) * dy)

    def local(x, dy_part, scale, bias):  # [1, 2, 24] of x on each rank
        # the scale and bias gradients leave invariant: autodiff of fused's cast of the
        # replicated parameters to x's varying axes is their psum over data and tensor
        return jax.grad(lambda *a: jnp.sum(_norm(center, "interpret")(*a) * dy_part),
                        argnums=(0, 1, 2))(x, scale, bias)

    step = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, P(), P()),
                         out_specs=(tokens, P(), P()), check_vma=True)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    got = jax.jit(step)(put(x, tokens), put(dy, tokens), put(scale, P()), put(bias, P()))
    want = jax.grad(lambda *a: loss(_norm(center, "xla"), *a), argnums=(0, 1, 2))(x, scale, bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(jax.device_get(g), w, **TIGHT)


@pytest.mark.slow
def test_pipelined_sequence_parallel_step_with_the_kernel(monkeypatch):
    """(1, 2, 2) 1F1B with sequence parallelism, every norm's backward the kernel: the
    loss and gradients of the single-device XLA program (the norms' scale and bias summed
    over the tensor ranks' tokens and over microbatches)."""
    setup = make_setup(1, 2, 2, ["model.num_layers=2", "model.seq_len=8",
                                 "train.global_batch=4", "parallel.microbatches=2",
                                 "parallel.sequence_parallel=true"])
    batch = fixed_batches(setup.config, 1)[0]
    state = placed_state(setup)
    params = jax.device_get(setup.state_layout.to_logical(state["params"]))
    ref_loss, ref_grads = reference_loss_and_grads(setup.config, setup.vocab, params, batch)
    monkeypatch.setattr(fused, "norm_backward_form", lambda *_: "interpret")
    fn = build_grads(setup, deterministic=True)
    args = (state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
            state["step"], jnp.float32(1))
    assert "pallas_call" in str(jax.make_jaxpr(fn)(*args))  # not vacuous
    grads, loss, _ = jax.jit(fn)(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(setup.state_layout.to_logical(jax.device_get(grads)), ref_grads)


def test_norm_backward_forms():
    """The compiled kernel on a GPU target where the layout fits it (no context or expert
    split, a tensor split only with sequence parallelism); off a GPU the kernel
    (interpreted) only with model.kernels=pallas."""
    from jaxptd.config import load_config
    from jaxptd.model.layers import norm_form
    from jaxptd.model.tensor import Layout

    assert fused.norm_backward_form("xla", "gpu", True) == "kernel"
    assert fused.norm_backward_form("pallas", "gpu", False) == "xla"
    assert fused.norm_backward_form("pallas", "cpu", False) == "interpret"
    assert fused.norm_backward_form("xla", "cpu", True) == "xla"
    cfg = load_config(None, []).model
    assert norm_form(cfg, Layout(384, platform="gpu")) == "kernel"
    assert norm_form(cfg, Layout(384, 2, "tensor", platform="gpu")) == "xla"
    assert norm_form(cfg, Layout(384, 2, "tensor", True, platform="gpu")) == "kernel"  # SP
    full = dataclasses.replace(cfg, remat="full")
    assert norm_form(full, Layout(384, 2, "tensor", True, platform="gpu")) == "xla"
    assert norm_form(cfg, Layout(384, fsdp=(("qkv", 0),), fsdp_axis="fsdp",
                                 platform="gpu")) == "kernel"
    assert norm_form(cfg, Layout(384, 2, "tensor", True, context=2, context_axis="context",
                                 platform="gpu")) == "xla"
    assert norm_form(cfg, Layout(384, expert=2, expert_axis="expert", platform="gpu")) == "xla"
    assert norm_form(cfg, None) == "xla"


def test_kernel_lowers_for_cuda():
    x = jnp.zeros((3, 70, 200), jnp.bfloat16)
    scale = jnp.ones((200,), jnp.float32)

    def fwd_bwd(x, scale, dy):
        y, vjp = jax.vjp(lambda a, s: fused.layer_norm(a, s, s, 1e-5, a.dtype, "kernel")
                         + fused.rms_norm(a, s, 1e-5, a.dtype, "kernel"), x, scale)
        return y, vjp(dy)

    text = jax.jit(fwd_bwd).trace(x, scale, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2
