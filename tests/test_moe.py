"""The mixture of experts (jaxptd/model/moe.py): the layer against a plain per-token loop in
numpy (float64: routing, experts, shared expert, balance terms, capacity drops), fp32 parity
of the loss and every gradient with the single-device program across layouts (data, expert,
tensor, sequence parallelism, every pipeline schedule, FSDP, ZeRO-1, context, recomputation,
offload; dropless, and with a capacity that drops nothing), the step's statistics and
DeepSeek-V3's bias update, and checkpoints restored across a change of parallel.expert."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TINY, assert_grads_match_single_device, assert_same_state,
                     fixed_batches, make_setup, placed_state)

from jaxptd.train import metrics
from jaxptd.checkpoint.files import layout_metadata
from jaxptd.checkpoint.store import Checkpointer
from jaxptd.config import ConfigError, load_config
from jaxptd.model import gpt, llama
from jaxptd.model.moe import STATS, MoE
from jaxptd.model.tensor import Layout
from jaxptd.train.step import build_train_step

LLAMA = ["model.arch=llama", "model.num_kv_heads=4", "model.moe_experts=4",
         "model.moe_shared_ffn=32", "model.moe_z_loss=0.001"]
GPT = ["model.moe_experts=4", "model.moe_top_k=1", "model.moe_ffn=64",
       "model.moe_shared_ffn=32"]
DEEPSEEK = ["model.moe_router=sigmoid", "model.moe_bias_rate=0.01",
            "model.moe_shared_gate=true"]


# --------------------------------------------------------------------------- the layer

def _plain_moe(p, x, cfg, gated: bool, bias=None):
    """The layer as a loop over tokens in float64 numpy: (y [T, h], aux, z, load [E],
    dropped), the rows of x being one sequence each of cfg.seq_len tokens."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items() if k != "shared"}
    x = np.asarray(x, np.float64)
    n, k = cfg.moe_experts, cfg.moe_top_k
    logits = x @ p["w_router"]
    if cfg.moe_router == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    pick = scores + (0 if bias is None else np.asarray(bias))
    choice = np.argsort(-pick, axis=-1, kind="stable")[:, :k]  # [T, k]
    weights = np.take_along_axis(scores, choice, -1)
    if cfg.moe_norm_topk:
        weights /= weights.sum(-1, keepdims=True)
    t = x.shape[0]
    cap = math.ceil(cfg.moe_capacity * t * k / n) if cfg.moe_capacity else t * k
    taken, kept = np.zeros(n, int), np.zeros((t, k), bool)
    for j in range(k):  # priority: every first choice, then every second ...
        for i in range(t):
            kept[i, j] = taken[choice[i, j]] < cap
            taken[choice[i, j]] += kept[i, j]

    def expert(e, v):
        if gated:
            g, u = v @ p["w_experts_gate"][e], v @ p["w_experts_up"][e]
            return (g / (1 + np.exp(-g)) * u) @ p["w_experts_down"][e]
        u = v @ p["w_experts_fc1"][e] + p["b_experts_fc1"][e]
        hidden = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
        return hidden @ p["w_experts_fc2"][e] + p["b_experts_fc2"][e]
    y = np.stack([sum(weights[i, j] * expert(choice[i, j], x[i]) for j in range(k)
                      if kept[i, j]) + 0 * x[i] for i in range(t)])
    s = cfg.seq_len
    counts = np.zeros((t // s, n))
    for i in range(t):
        counts[i // s, choice[i]] += 1
    probs = scores / scores.sum(-1, keepdims=True)
    aux = sum(n * np.sum(counts[r] / (s * k) * probs[r * s:(r + 1) * s].mean(0))
              for r in range(t // s))
    lse = np.log(np.exp(logits).sum(-1))
    return y, aux, np.sum(lse ** 2), counts.sum(0), float((~kept).sum())


def _plain_shared(p, x, cfg, gated: bool):
    """The shared expert (and Qwen2-MoE's gate) in float64."""
    s = {k: np.asarray(v, np.float64) for k, v in p["shared"].items()}
    x = np.asarray(x, np.float64)
    if gated:
        g = x @ s["w_gate"]
        y = (g / (1 + np.exp(-g)) * (x @ s["w_up"])) @ s["w_down"]
    else:
        u = x @ s["w_fc1"] + s["b_fc1"]
        y = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3))) \
            @ s["w_fc2"] + s["b_fc2"]
    if "w_shared_gate" in p:
        y = y / (1 + np.exp(-(x @ np.asarray(p["w_shared_gate"], np.float64))))
    return y


@pytest.mark.parametrize("arch, extra", [
    ("llama", LLAMA), pytest.param("gpt", GPT, marks=pytest.mark.slow),
    pytest.param("llama", LLAMA + DEEPSEEK, marks=pytest.mark.slow),
    pytest.param("llama", LLAMA + ["model.moe_capacity=0.5"], marks=pytest.mark.slow)])
def test_layer_is_the_plain_per_token_loop(arch, extra):
    """One layer's output and statistics equal the loop: top-k routing (with the bias
    picking, never weighing), SwiGLU or GeLU experts, the shared expert and its gate, the
    balance terms of each sequence, the load, and capacity's drops in priority order."""
    cfg = load_config(None, TINY + extra).model
    gated = arch == "llama"
    family = llama if gated else gpt
    params = jax.jit(family.init_params, static_argnums=(0, 1))(cfg, cfg.padded_vocab(1),
                                                                 jax.random.key(1))
    mlp = jax.tree.map(lambda v: v[0], params["layers"]["mlp"])
    bias = None
    if cfg.moe_bias_rate:  # a bias that changes which experts are picked
        bias = jnp.asarray([0.3, -0.2, 0.1, 0.0], jnp.float32)
        mlp["router_bias"] = bias
    x = jax.random.normal(jax.random.key(2), (4, cfg.seq_len, cfg.hidden_size))
    module = MoE(cfg, Layout(512), shared=family.MLP if gated else gpt.MLP, gated=gated)
    y, state = jax.jit(lambda p, x: module.apply({"params": p}, x, mutable=[STATS]))(mlp, x)
    stats = state[STATS]["stats"]
    flat = x.reshape(-1, cfg.hidden_size)
    ref_y, aux, z, load, dropped = _plain_moe(mlp, flat, cfg, gated, bias)
    ref_y = ref_y + _plain_shared(mlp, flat, cfg, gated)
    np.testing.assert_allclose(np.asarray(y).reshape(ref_y.shape), ref_y, rtol=1e-4,
                               atol=1e-5 * np.abs(ref_y).max())
    np.testing.assert_allclose(float(stats["aux"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(stats["z"]), z, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(stats["load"]), load)
    assert float(stats["dropped"]) == dropped
    assert (dropped > 0) == bool(cfg.moe_capacity)  # 0.5: some must drop


def test_flops_count_the_active_parameters():
    """forward_flops: a layer's MLP costs the router, top_k experts and the shared one."""
    dense = load_config(None, TINY + ["model.arch=llama", "model.ffn_size=64"]).model
    moe = load_config(None, TINY + ["model.arch=llama", "model.moe_experts=8",
                                    "model.moe_top_k=2", "model.moe_ffn=32"]).model
    h = dense.hidden_size
    difference = llama.forward_flops(moe, 512)["layer"] - llama.forward_flops(dense, 512)["layer"]
    assert difference == 2 * h * 8  # 2 experts of 32 = the dense 64, plus the router


# --------------------------------------------------------------------------- parity

def _case(data, pipe, tensor, *extra, slow=True, arch=LLAMA):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(data, pipe, tensor, [*arch, *extra], marks=marks,
                        id=f"{'gpt' if arch is GPT else 'llama'}-{data}-{pipe}-{tensor}-"
                        + "-".join(e.split(".")[-1] for e in extra))


# (model.moe_every > 1: units of dense layers and a mixture, model/stack.py). 1F1B with a
# mixture: tests/test_pipeline_program.py's unrolled moe case (and the H100 compile's);
# experts with pipe: the zb-h1, GPipe, zb-interleaved and zb-v cases; with tensor: the SP
# ones.
PARITY = [
    _case(4, 2, 1, "parallel.expert=4", "parallel.microbatches=2", "parallel.schedule=zb-h1",
          "model.moe_every=2"),
    _case(4, 1, 2, "parallel.expert=4", "parallel.sequence_parallel=true", slow=False),
    _case(1, 2, 2, "parallel.microbatches=4", "parallel.schedule=interleaved",
          "parallel.chunks=2"),
    _case(2, 2, 1, "parallel.expert=2", "parallel.microbatches=2", "parallel.schedule=gpipe",
          "parallel.stash=inputs"),
    _case(2, 2, 1, "parallel.expert=2", "parallel.microbatches=4",
          "parallel.schedule=zb-interleaved", "parallel.chunks=2", "model.num_layers=8",
          "model.moe_every=2"),
    _case(2, 2, 1, "parallel.expert=2", "parallel.microbatches=2", "parallel.schedule=zb-v",
          "parallel.chunks=2"),
    _case(4, 1, 1, "parallel.expert=2", "parallel.fsdp=true"),
    _case(4, 1, 1, "parallel.expert=2", "optimizer.zero1=true", "model.remat=full",
          "model.moe_every=4"),
    _case(2, 1, 2, "parallel.expert=2", "parallel.context=2"),
    _case(2, 1, 1, "parallel.expert=2", "offload.activations=true", "offload.optimizer=true",
          "parallel.microbatches=2"),
    _case(2, 1, 2, "parallel.expert=2", "model.moe_capacity=4.0", "model.moe_every=2",
          *DEEPSEEK),
    _case(2, 1, 2, "parallel.expert=2", "parallel.sequence_parallel=true", "model.moe_every=2",
          arch=GPT),
]


@pytest.mark.parametrize("data, pipe, tensor, extra", PARITY)
def test_loss_and_gradients_match_single_device(data, pipe, tensor, extra):
    """fp32: the layout's loss, balance terms and every gradient are the single-device
    program's (rtol 1e-5); with a capacity, nothing dropped (the same compiled gradients'
    statistics, on the same batch)."""
    setup = make_setup(data, pipe, tensor, extra)
    out = {}
    assert_grads_match_single_device(setup, stats_out=out)
    if setup.config.model.moe_capacity:
        assert float(jnp.sum(out["stats"]["dropped"])) == 0


# --------------------------------------------------------------------------- the step

@pytest.mark.slow
def test_step_reports_statistics_and_moves_the_balance_bias():
    """The step's statistics are the global batch's (load sums to tokens x top_k in every
    MoE layer, laid out as the layer stack: pipelined [v, p, Uc, E], here units of a dense
    layer and a mixture), and DeepSeek-V3's bias moves by moe_bias_rate towards the mean
    load, untouched by the optimizer."""
    setup = make_setup(2, 2, 1, [*LLAMA, *DEEPSEEK, "parallel.expert=2",
                                 "parallel.microbatches=2", "model.moe_every=2"])
    cfg = setup.config

    def bias_of(state):
        return np.asarray(jax.device_get(
            state["params"]["layers"]["layer_1"]["mlp"]["router_bias"]))
    state = placed_state(setup)
    bias0 = bias_of(state)
    step = build_train_step(setup)
    state, metrics = step(state, jax.device_put(fixed_batches(cfg, 1)[0],
                                                setup.batch_sharding))
    load = np.asarray(metrics["moe"]["load"])
    assert load.shape == (1, 2, 1, 4)  # [v, p, Uc, E]
    tokens = cfg.train.global_batch * cfg.model.seq_len
    np.testing.assert_array_equal(load.sum(-1), tokens * cfg.model.moe_top_k)
    bias = bias_of(state)
    expected = bias0 + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(bias, expected, rtol=1e-6)
    assert np.any(bias != bias0)


def test_log_record_is_per_layer_in_model_order():
    """metrics.moe_record: pipelined statistics [v, p, Lc, ...] flatten to model order;
    aux a sequence, z a token, the busiest expert over the mean, the share dropped."""
    cfg = load_config(None, TINY + LLAMA).model  # 16 tokens a row, top 2 of 4
    load = np.array([[[[8, 8, 8, 8]], [[32, 0, 0, 0]]]])  # [v=1, p=2, Lc=1, E=4]
    stats = {"load": load, "aux": np.array([[[2.0], [4.0]]]), "z": np.array([[[32.0], [0.0]]]),
             "dropped": np.array([[[0.0], [8.0]]])}
    record = metrics.moe_record(stats, cfg, batch=2)  # 2 rows: 64 routed rows a layer
    assert record["moe_load_layers"] == [1.0, 4.0] and record["moe_load"] == 4.0
    assert record["moe_aux_layers"] == [1.0, 2.0]
    assert record["moe_z_layers"] == [1.0, 0.0]
    assert record["moe_dropped_layers"] == [0.0, 0.125]


def test_config_rules_name_the_key():
    for overrides, key in [
            (["model.arch=bert", "model.moe_experts=4"], "model.moe_experts"),
            (["model.moe_experts=4", "model.moe_top_k=5"], "model.moe_top_k"),
            (["model.moe_experts=4", "parallel.data=2", "parallel.expert=3"], "parallel.expert"),
            (["model.moe_experts=6", "parallel.data=4", "parallel.expert=4"], "parallel.expert"),
            (["model.moe_top_k=1"], "model.moe_top_k"),
            (["parallel.expert=2", "parallel.data=2"], "parallel.expert"),
            (["model.moe_experts=4", "model.moe_shared_gate=true"], "model.moe_shared_gate"),
            (["model.moe_experts=4", "model.moe_bias_rate=0.1", "offload.optimizer=true"],
             "model.moe_bias_rate"),
            (["model.moe_experts=4", "model.moe_every=3"], "model.moe_every"),
            (["model.moe_experts=4", "model.moe_every=2", "parallel.pipe=4",
              "parallel.microbatches=4"], "model.moe_every"),
            (["model.moe_every=2"], "model.moe_every")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, TINY + overrides)


# --------------------------------------------------------------------------- checkpoints

@pytest.mark.slow
def test_restore_across_expert_parallel_sizes(tmp_path):
    """A state trained one step at expert 2 (with tensor 2) restores at expert 4 and 1
    bitwise as its logical values: experts are whole in a checkpoint."""
    source = make_setup(2, 1, 2, [*LLAMA, "parallel.expert=2"])
    state = placed_state(source)
    state, _ = build_train_step(source)(state, jax.device_put(
        fixed_batches(source.config, 1)[0], source.batch_sharding))
    ckpt = Checkpointer(str(tmp_path), 1, 10, metadata=layout_metadata(source.config, 1))
    ckpt.save(1, source.state_layout.state_to_logical(state))
    ckpt.close()
    logical = jax.device_get(source.state_layout.state_to_logical(state))
    for data, expert in ((4, 4), (2, 1)):  # (tensor 2 throughout: one padded vocabulary)
        target = make_setup(data, 1, 2, [*LLAMA, f"parallel.expert={expert}"])
        restored = Checkpointer(str(tmp_path), 0, 10)
        try:
            got, step = restored.restore_latest(target.state_layout.abstract_state(logical=True),
                                                target.config.model.vocab_size)
        finally:
            restored.close()
        assert step == 1
        assert_same_state(got, logical)
