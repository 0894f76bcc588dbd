"""The mixture-of-experts MLP (`MoE`): a router, `moe_experts` routed experts of which each
token takes `moe_top_k`, optional shared experts, and the statistics every step logs.

Owns routing, the balance terms, combine and the statistics; moving the rows to their
experts and back (dispatch, expert parallelism's exchange) is moe_dispatch.py's.

Routing (float32): logits = x W_router [T, E]; scores softmax (Mixtral, Qwen) or sigmoid
(DeepSeek-V3); the top k experts by score (plus DeepSeek-V3's balance bias `router_bias`
when model.moe_bias_rate > 0: it picks, it never weighs); their scores are the weights,
renormalised to sum to 1 with model.moe_norm_topk. y = sum_k w_k E_k(x) + shared(x)
(times sigmoid(x w) with model.moe_shared_gate, Qwen2-MoE's).

Balance terms, each a sum over this rank's tokens in the loss's units (the step divides
every loss sum by global batch x seq_len), so that they are layout-free:
- aux (Switch/GShard): each sequence is a group, aux = E sum_i f_i P_i with f_i the share of
  the sequence's top-k choices that went to expert i (f_i = 1/E when balanced, so aux = 1)
  and P_i its mean score (sigmoid scores normalised per token first). Per token that is
  E sum_i f_i p_ti / s, f counted over the whole sequence (its context ranks summed), so a
  rank sums its own tokens' terms. Sequence groups make it the same at every data,
  microbatch and context layout (a per-microbatch group would not be).
- z (ST-MoE): logsumexp(logits)^2 per token.
The objective adds moe_aux_loss x aux + moe_z_loss x z of every layer (`objective`).

Statistics (sown in the collection STATS, one dict a layer): aux and z (the
sums above), load [E] (rows routed to each expert, before any drop) and dropped (rows
dropped). Under sequence parallelism they are computed on the gathered tokens, the same on
every tensor rank; `_same_on_tensor` makes their type say so (and so their gradient right).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model.layers import residual_std
from jaxptd.model.moe_dispatch import Dispatch
from jaxptd.model.tensor import Layout, enter_tensor, exit_tensor, fp8_history, normal, zeros
from jaxptd.parallel.varying import varying_axes

STATS = "moe_stats"  # the Flax collection a MoE layer sows its statistics into


def _weights(cfg: ModelConfig) -> dict:
    """Each statistic's weight in the objective (the counts: none)."""
    return {"aux": cfg.moe_aux_loss, "z": cfg.moe_z_loss, "load": 0.0, "dropped": 0.0}


def objective(stats, cfg: ModelConfig):
    """The balance terms' part of the objective (loss-sum units): moe_aux_loss x aux +
    moe_z_loss x z summed over the layers in `stats` (None: 0)."""
    if stats is None:
        return 0.0
    weights = _weights(cfg)
    return sum(weights[name] * jnp.sum(v) for name, v in stats.items())


def objective_cotangent(stats, cfg: ModelConfig, seed):
    """seed x d objective / d stats, shaped and typed (varying axes) like `stats` (None:
    None): what a pipeline stage's backward takes for the statistics it output."""
    if stats is None:
        return None
    weights = _weights(cfg)
    return {name: jnp.zeros_like(v) + weights[name] * seed for name, v in stats.items()}


def active_mlp_flops(cfg: ModelConfig, per_width: int) -> int:
    """Forward matmul FLOPs a token spends in a mixture of experts' MLP, from its active
    parameters: the router 2 h E, its top k experts per_width h fe each (per_width: 6 for
    SwiGLU's three matrices, 4 for GeLU's two), the shared experts per_width h fs and
    their gate 2 h."""
    h = cfg.hidden_size
    return (2 * h * cfg.moe_experts + cfg.moe_top_k * per_width * h * cfg.expert_ffn
            + per_width * h * cfg.moe_shared_ffn + 2 * h * cfg.moe_shared_gate)


def mlp_flops(cfg: ModelConfig, per_width: int) -> float:
    """Forward matmul FLOPs a token spends in a layer's MLP, the mean over the layers: the
    dense MLP's per_width h f, or with a mixture of experts `active_mlp_flops` in one layer
    of every model.moe_every and the dense MLP's in the others."""
    dense = per_width * cfg.hidden_size * cfg.ffn
    if not cfg.moe:
        return dense
    return (active_mlp_flops(cfg, per_width) + (cfg.unit - 1) * dense) / cfg.unit


def update_bias(params, load, apply, cfg: ModelConfig):
    """DeepSeek-V3's auxiliary-loss-free balance, after a step: each layer's router_bias
    moves by moe_bias_rate towards its experts' mean load (up for an expert under it, down
    over it). load: the step's rows per expert [..., E], laid out as the layers; apply:
    False leaves the biases (a step skipped by the loss scale)."""
    path = ("layers", *cfg.layer_path(cfg.unit - 1), "mlp", "router_bias")
    flat = traverse_util.flatten_dict(params)
    move = cfg.moe_bias_rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)
    flat[path] = flat[path] + jnp.where(apply, move, 0.0)
    return traverse_util.unflatten_dict(flat)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one layer: x [b, s, h] ([b, s/t, h] with sequence
    parallelism) -> [b, s, h] likewise; sows its statistics (module docstring).

    `shared`: the family's dense MLP (a factory of (cfg, layout)), run as the shared
    experts with ffn = moe_shared_ffn; `gated`: SwiGLU experts (llama) or GeLU experts with
    biases (gpt)."""

    cfg: ModelConfig
    layout: Layout
    shared: type
    gated: bool

    @nn.compact
    def __call__(self, x):
        cfg, layout = self.cfg, self.layout
        n, k, h = cfg.moe_experts, cfg.moe_top_k, cfg.hidden_size
        w_router = self.param("w_router", normal(cfg.init_std, ("embed", "router")), (h, n),
                              jnp.float32)
        bias = None
        if cfg.moe_bias_rate:
            bias = self.param("router_bias", zeros(("router",)), (n,), jnp.float32)
        experts = self._expert_weights()
        histories = {name: fp8_history(self, f"w_experts_{name}", make=True)
                     for name in experts if cfg.moe_capacity and not name.startswith("b_")}

        x_in = enter_tensor(x, layout)  # [b, s, h]: f (sequence parallelism: all tokens)
        b, s = x_in.shape[:2]
        logits = jnp.einsum("bsh,he->bse", x_in.astype(jnp.float32), w_router)
        scores = jax.nn.softmax(logits) if cfg.moe_router == "softmax" \
            else jax.nn.sigmoid(logits)
        pick = scores if bias is None else scores + bias
        _, choice = lax.top_k(lax.stop_gradient(pick), k)  # [b, s, k] expert ids
        weights = jnp.take_along_axis(scores, choice, axis=-1)  # [b, s, k]
        if cfg.moe_norm_topk:
            weights = weights / jnp.sum(weights, -1, keepdims=True)

        tokens = x_in.reshape(b * s, h)
        run = Dispatch(cfg, layout, experts, self.gated, histories)
        if cfg.moe_capacity:
            out, dropped = run.with_capacity(tokens, choice.reshape(b * s, k))
        else:
            out, dropped = run.dropless(tokens, choice.reshape(b * s, k))
        # out [T, k, h]: each choice's expert output, partial sums over tensor ranks
        y = jnp.einsum("tkh,tk->th", out, weights.reshape(b * s, k).astype(out.dtype))
        y = exit_tensor(y.reshape(b, s, h), layout)  # g
        if cfg.moe_shared_ffn:
            y = y + self._shared(x)
        self.sow(STATS, "stats", self._stats(logits, scores, choice, dropped),
                 init_fn=lambda: None, reduce_fn=lambda _, new: new)
        return y

    def _expert_weights(self) -> dict:
        """This rank's experts: [E/e, ...] each, hidden width split over tensor ranks."""
        cfg, layout = self.cfg, self.layout
        n, h, f = cfg.moe_experts // layout.expert, cfg.hidden_size, \
            cfg.expert_ffn // layout.tensor
        out_std = residual_std(cfg)

        def param(name, std, names, shape):
            return self.param(name, normal(std, ("experts", *names)), (n, *shape), jnp.float32)
        if self.gated:
            return {"gate": param("w_experts_gate", cfg.init_std, ("embed", "mlp"), (h, f)),
                    "up": param("w_experts_up", cfg.init_std, ("embed", "mlp"), (h, f)),
                    "down": param("w_experts_down", out_std, ("mlp", "embed"), (f, h))}
        return {"fc1": param("w_experts_fc1", cfg.init_std, ("embed", "mlp"), (h, f)),
                "b_fc1": self.param("b_experts_fc1", zeros(("experts", "mlp")), (n, f),
                                    jnp.float32),
                "fc2": param("w_experts_fc2", out_std, ("mlp", "embed"), (f, h)),
                "b_fc2": self.param("b_experts_fc2", zeros(("experts", "embed")), (n, h),
                                    jnp.float32)}

    def _shared(self, x):
        """The shared experts: the family's dense MLP at width moe_shared_ffn, gated by
        sigmoid(x w) with moe_shared_gate (on this rank's tokens x)."""
        cfg = self.cfg
        wide = dataclasses.replace(cfg, ffn_size=cfg.moe_shared_ffn)
        y = self.shared(wide, self.layout, name="shared")(x)
        if not cfg.moe_shared_gate:
            return y
        w = self.param("w_shared_gate", normal(cfg.init_std, ("embed", "router")),
                       (cfg.hidden_size, 1), jnp.float32)
        gate = jax.nn.sigmoid(jnp.einsum("bsh,ho->bso", x.astype(jnp.float32), w))
        return (gate * y.astype(jnp.float32)).astype(y.dtype)

    def _stats(self, logits, scores, choice, dropped) -> dict:
        """This rank's statistics of the layer (module docstring): aux and z float32
        scalars (differentiable), load [E] and dropped float32 counts."""
        cfg, layout = self.cfg, self.layout
        n, k = cfg.moe_experts, cfg.moe_top_k
        b = choice.shape[0]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], choice.shape)
        per_row = jnp.zeros((b, n), jnp.float32).at[rows, choice].add(1.0)  # [b, E]
        if layout.context > 1 and layout.context_axis is not None:
            per_row = lax.psum(per_row, layout.context_axis)  # the whole sequence's
        share = per_row / (cfg.seq_len * k)  # f [b, E]
        p = scores if cfg.moe_router == "softmax" else \
            scores / jnp.sum(scores, -1, keepdims=True)
        aux = n * jnp.sum(share[:, None, :] * p) / cfg.seq_len
        z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        load = jnp.zeros((n,), jnp.float32).at[choice.reshape(-1)].add(1.0)
        return {name: self._same_on_tensor(v) for name, v in
                {"aux": aux, "z": z, "load": load, "dropped": dropped}.items()}

    def _same_on_tensor(self, value):
        """A value computed alike on every tensor rank from gathered tokens (sequence
        parallelism: typed as varying over tensor) as one invariant value: the mean over
        the ranks, whose transpose gives each rank 1/t of the gradient, summed back by
        the gathers' and replicated weights' transposes."""
        axis = self.layout.tensor_axis
        if axis is None or axis not in varying_axes(value):
            return value
        return lax.psum(value, axis) / self.layout.tensor
