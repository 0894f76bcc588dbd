"""The model against independent references: Pallas kernels against the plain-XLA ops (one
device and inside the manual shard_map), Megatron's initialisation statistics, the loss at
initialisation against ln(vocab), zero gradient for the padded vocabulary rows, and
dropout on the embedding sum."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_trees_close, fixed_batches, make_setup, placed_state,
                     reference_loss_and_grads)
from jaxptd.config import ConfigError, load_config
from jaxptd import model as models
from jaxptd.model import gpt
from jaxptd.model.tensor import Layout
from jaxptd.train.step import build_grads

SMALL = ["model.num_layers=2", "model.seq_len=8", "train.global_batch=4"]


def sharded_loss_and_grads(setup, batch):
    state = placed_state(setup)
    grads, loss, _ = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    return loss, grads


@pytest.fixture(scope="module")
def single_device():
    """kernels -> (setup, loss, grads) of the global model on one device (vocab 300 -> 384)."""
    def run(kernels):
        setup = make_setup(1, 1, 1, SMALL + [f"model.kernels={kernels}"])
        params = jax.jit(gpt.init_params, static_argnums=(0, 1))(
            setup.config.model, setup.vocab, jax.random.key(0))
        batch = fixed_batches(setup.config, 1)[0]
        fn = lambda p: reference_loss_and_grads(setup.config, setup.vocab, p, batch)  # noqa: E731
        # Not vacuous: the pallas model really calls kernels (the xla one does not).
        assert ("pallas_call" in str(jax.make_jaxpr(fn)(params))) == (kernels == "pallas")
        loss, grads = jax.jit(fn)(params)
        return setup, float(loss), jax.device_get(grads)
    return {kernels: run(kernels) for kernels in ("xla", "pallas")}


@pytest.fixture(scope="module")
def sharded():
    """kernels -> (setup, loss, grads) through build_grads on (2, 1, 4) (vocab 300 -> 512)."""
    def run(kernels):
        setup = make_setup(2, 1, 4, SMALL + [f"model.kernels={kernels}"])
        loss, grads = sharded_loss_and_grads(setup, fixed_batches(setup.config, 1)[0])
        return setup, float(loss), jax.device_get(grads)
    return {kernels: run(kernels) for kernels in ("xla", "pallas")}


# --------------------------------------------------------------------------- kernels


@pytest.mark.slow
@pytest.mark.parametrize("where", ["single_device", "sharded"])
def test_pallas_kernels_match_xla(where, request):
    """model.kernels=pallas (interpret mode on CPU) computes the plain-XLA loss and
    gradients, on one device and inside the manual shard_map."""
    results = request.getfixturevalue(where)
    (_, xla_loss, xla_grads), (_, pallas_loss, pallas_grads) = results["xla"], results["pallas"]
    np.testing.assert_allclose(pallas_loss, xla_loss, rtol=1e-5)
    assert_trees_close(pallas_grads, xla_grads, rtol=1e-5)


@pytest.mark.parametrize("dims, extra", [
    ((1, 1, 1), []),
    pytest.param((2, 1, 4), ["model.arch=llama", "model.num_kv_heads=2",
                             "parallel.sequence_parallel=true"], marks=pytest.mark.slow)])
def test_flash_attention_matches_xla(dims, extra):
    """model.attention=flash (Pallas flash attention, interpret mode on CPU) computes the
    XLA attention's loss and gradients in the same layout: GPT on one device; Llama's
    grouped key/value heads over tensor ranks with sequence parallelism."""
    runs = {}
    for attention in ("xla", "flash"):
        setup = make_setup(*dims, ["model.num_layers=2", "model.seq_len=32",
                                   "train.global_batch=4", *extra,
                                   f"model.attention={attention}"])
        batch = fixed_batches(setup.config, 1)[0]
        state = placed_state(setup)
        fn = build_grads(setup, deterministic=True)
        args = (state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
                state["step"], jnp.float32(1))
        # not vacuous: only the flash model calls the kernels
        assert ("pallas_call" in str(jax.make_jaxpr(fn)(*args))) == (attention == "flash")
        grads, loss, _ = jax.jit(fn)(*args)
        runs[attention] = float(loss), jax.device_get(grads)
    np.testing.assert_allclose(runs["flash"][0], runs["xla"][0], rtol=1e-5)
    assert_trees_close(runs["flash"][1], runs["xla"][1], rtol=1e-5)


# --------------------------------------------------------------------------- initialisation


def test_megatron_initialisation():
    """N(0, 0.02) weights; residual output projections N(0, 0.02 / sqrt(2L)); biases zero;
    LayerNorm scale one; padded vocabulary rows zero; every layer drawn independently."""
    layers = 4
    config = load_config(None, [f"model.num_layers={layers}", "model.hidden_size=256",
                                "model.num_heads=4", "model.seq_len=64"])
    vocab = config.model.padded_vocab(1)
    params = jax.device_get(jax.jit(gpt.init_params, static_argnums=(0, 1))(
        config.model, vocab, jax.random.key(0)))
    std, out_std = 0.02, 0.02 / math.sqrt(2 * layers)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    expected_std = {
        "wte": (params["embed"]["wte"][:config.model.vocab_size], std),
        "wpe": (params["embed"]["wpe"], std),
        "w_qkv": (attn["w_qkv"], std), "w_fc1": (mlp["w_fc1"], std),
        "w_out": (attn["w_out"], out_std), "w_fc2": (mlp["w_fc2"], out_std),
    }
    for name, (weight, target) in expected_std.items():
        weight = np.asarray(weight, np.float64)
        assert abs(weight.std() / target - 1) < 0.03, (name, weight.std(), target)
        assert abs(weight.mean()) < 0.1 * target, (name, weight.mean())
    for name, bias in [("b_qkv", attn["b_qkv"]), ("b_out", attn["b_out"]),
                       ("b_fc1", mlp["b_fc1"]), ("b_fc2", mlp["b_fc2"])]:
        assert np.all(np.asarray(bias) == 0), name
    assert vocab > config.model.vocab_size
    assert np.all(np.asarray(params["embed"]["wte"][config.model.vocab_size:]) == 0)
    norms = [params["layers"]["ln1"], params["layers"]["ln2"], params["final_norm"]]
    for norm in norms:
        assert np.all(np.asarray(norm["scale"]) == 1) and np.all(np.asarray(norm["bias"]) == 0)
    w_qkv = np.asarray(attn["w_qkv"])
    assert w_qkv.shape[0] == layers
    assert not np.allclose(w_qkv[0], w_qkv[1]), "layers must be initialised independently"


# --------------------------------------------------------------------------- loss at init


@pytest.mark.parametrize("where", ["single_device", "sharded"])
def test_loss_at_initialisation_is_ln_vocab(where, request):
    setup, loss, _ = request.getfixturevalue(where)["xla"]
    vocab, padded = setup.config.model.vocab_size, setup.vocab
    assert padded > vocab  # 300 padded to 384 or 512: padded rows must take no probability
    assert abs(loss - math.log(vocab)) < 0.05, (loss, math.log(vocab))
    assert abs(loss - math.log(padded)) > 0.2, (loss, math.log(padded))


@pytest.mark.parametrize("where", ["single_device", "sharded"])
def test_padded_vocabulary_rows_get_zero_gradient(where, request):
    setup, _, grads = request.getfixturevalue(where)["xla"]
    wte_grad = np.asarray(grads["embed"]["wte"])  # [padded vocab, h]
    vocab = setup.config.model.vocab_size
    assert wte_grad.shape[0] == setup.vocab > vocab
    assert np.all(wte_grad[vocab:] == 0)
    assert np.all(np.any(wte_grad[:vocab] != 0, axis=1))  # every real row learns


def test_cudnn_attention_falls_back_to_xla_off_gpu():
    """model.attention=cudnn runs cuDNN flash attention on a GPU only (compiled for an H100
    it is cuDNN's call, xla's none: tests/test_h100.py); the step on CPU devices lays the
    model out for the CPU, where the loss equals model.attention=xla's."""
    def config(attention):
        return load_config(None, ["model.num_layers=1", "model.hidden_size=32",
                                  "model.num_heads=4", "model.seq_len=8",
                                  "model.dtype=bfloat16", f"model.attention={attention}"])

    cpu = make_setup(1, 1, 1, ["model.dtype=bfloat16", "model.attention=cudnn"])
    assert cpu.local_layout.platform == "cpu"
    vocab = config("xla").model.padded_vocab(1)
    params = jax.jit(gpt.init_params, static_argnums=(0, 1))(  # the same for both paths
        config("xla").model, vocab, jax.random.key(0))
    batch = jnp.arange(2 * 9).reshape(2, 9) % 257
    loss_sum = jax.jit(models.loss_sum, static_argnums=(3, 4, 5))
    losses = [float(loss_sum(params, batch, jax.random.key(0), config(attention).model,
                             Layout(vocab, platform=cpu.local_layout.platform), True))
              for attention in ("xla", "cudnn")]
    assert losses[0] == losses[1]
    with pytest.raises(ConfigError, match="needs model.dtype bfloat16"):
        load_config(None, ["model.attention=cudnn"])


# --------------------------------------------------------------------------- recomputation


@pytest.mark.slow
def test_recomputation_keeps_gradients_and_saves_memory():
    """model.remat=selective (the attention core), minimal and minimal_mlp (the matmul
    outputs kept, but q, k, v by minimal_mlp) and full (each layer) recompute with the same
    dropout masks, so loss and gradients equal remat=none's; the compiled step keeps less:
    full < selective < none (seq 64, where the [s, s] probabilities matter)."""
    results = {}
    for remat in ("none", "selective", "minimal", "minimal_mlp", "full"):
        setup = make_setup(2, 1, 4, ["model.num_layers=2", "model.seq_len=64",
                                     "model.dropout=0.1", f"model.remat={remat}"])
        state = placed_state(setup)
        args = (state["params"], jax.device_put(fixed_batches(setup.config, 1)[0],
                                                setup.batch_sharding),
                state["rng"], state["step"], jnp.float32(1))
        grads_fn = jax.jit(build_grads(setup, deterministic=False))
        temp = grads_fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
        grads, loss, _ = grads_fn(*args)
        results[remat] = float(loss), jax.device_get(grads), temp
    loss, grads, temp = results["none"]
    for remat in ("selective", "minimal", "minimal_mlp", "full"):
        np.testing.assert_allclose(results[remat][0], loss, rtol=1e-6)
        assert_trees_close(results[remat][1], grads, rtol=1e-5)
    assert results["full"][2] < results["selective"][2] < 0.9 * temp, {
        remat: r[2] for remat, r in results.items()}


@pytest.mark.slow
def test_embedding_sum_gets_dropout():
    """GPT-2 and Megatron drop out the embedding sum (token + position) in training."""
    config = load_config(None, SMALL + ["model.dropout=0.5", "model.hidden_size=64"]).model
    vocab = config.padded_vocab(1)
    params = jax.jit(gpt.init_params, static_argnums=(0, 1))(config, vocab, jax.random.key(0))
    batch = jnp.arange(4 * 9).reshape(4, 9) % 257
    embed = jax.jit(lambda ends, deterministic: gpt.embed(  # noqa: E731
        ends, batch, jax.random.key(1), config, Layout(vocab), deterministic),
        static_argnums=1)
    kept, plain = (np.asarray(embed(models.ends(params), d)) for d in (False, True))
    dropped = kept == 0
    assert 0.4 < dropped.mean() < 0.6
    np.testing.assert_allclose(kept[~dropped], 2 * plain[~dropped], rtol=1e-6)
