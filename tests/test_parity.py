"""fp32 parity: every (data, pipe=1, tensor) layout, with ZeRO-1 too where data > 1,
computes the losses and gradients of the single-device program (rtol 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_trees_close, fixed_batches, make_setup, placed_state,
                     reference_loss_and_grads, reference_losses)
from jaxptd.step import build_grads, build_train_step

# ZeRO-1 shards the optimizer state over data (with data = 1 it is the same program); it
# leaves the gradients of the layout unchanged, so (2, 1, 4) is run with it only.
CASES = [pytest.param(*case, marks=pytest.mark.slow) for case in (
    (1, 1, 1, False), (8, 1, 1, False), (1, 1, 8, False))] + [(2, 1, 4, True)]


@pytest.mark.parametrize("data, pipe, tensor, zero1", CASES)
def test_losses_and_gradients_match_single_device(data, pipe, tensor, zero1):
    setup = make_setup(data, pipe, tensor, [f"optimizer.zero1={zero1}",
                                            "parallel.microbatches=2"])
    config = setup.config
    state = placed_state(setup)
    params0 = jax.device_get(state["params"])
    batches = fixed_batches(config, 3)

    grads, loss = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batches[0], setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    ref_loss, ref_grads = reference_loss_and_grads(config, setup.vocab, params0, batches[0])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)

    step = build_train_step(setup)
    losses = []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference_losses(config, setup.vocab, params0, batches),
                               rtol=1e-5)


def test_initialisation_is_layout_independent():
    """Parameters initialised into (2,1,4) shardings equal the single-device ones."""
    sharded = make_setup(2, 1, 4)
    single = make_setup(1, 1, 1, [f"model.vocab_size={sharded.vocab}"])
    assert_trees_close(sharded.init_state(0)["params"], single.init_state(0)["params"], rtol=0)


def test_zero1_shards_optimizer_state_over_data():
    setup = make_setup(8, 1, 1, ["optimizer.zero1=true"])
    state = placed_state(setup)
    adam = state["opt_state"][1][0]  # ScaleByAdamState of the adamw chain
    wte = adam.mu["embed"]["wte"]
    assert "data" in str(wte.sharding.spec)
    assert wte.addressable_shards[0].data.size == wte.size // 8
    assert state["params"]["embed"]["wte"].addressable_shards[0].data.size == wte.size


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32():
    """Mixed precision: bf16 compute with f32 masters lands near the f32 loss."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        setup = make_setup(2, 1, 4, [f"model.dtype={dtype}"])
        state = placed_state(setup)
        assert state["params"]["layers"]["mlp"]["w_fc1"].dtype == jnp.float32
        step = build_train_step(setup)
        batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
        losses[dtype] = float(step(state, batch)[1]["loss"])
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)


@pytest.mark.slow
def test_float16_dynamic_loss_scale_skips_overflow():
    setup = make_setup(1, 1, 1, ["model.dtype=float16", "optimizer.loss_scale=dynamic"])
    state = placed_state(setup)
    step = build_train_step(setup)
    batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
    state = jax.tree.map(lambda x: x, state)
    state["loss_scale"] = state["loss_scale"]._replace(scale=jnp.float32(2.0**40))
    before = jax.device_get(state["params"])
    state, metrics = step(state, batch)
    assert float(metrics["loss_scale"]) == 2.0**39  # overflow: halved
    assert_trees_close(state["params"], before, rtol=0)  # and the update skipped
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
