"""Flax modules of the transformer layer, written from one tensor-parallel rank's point of
view, and the pieces every architecture's layers share: LayerNorm and RMSNorm, attention
(cuDNN flash attention or `attention_core` with selective recomputation), the MLP, dropout,
and `Block`, the one layer of GPT, Llama and BERT.

Owns the layer math. How a rank sees its parameters and activations, every matmul with a
weight and the collectives f and g around the column- and row-parallel linears are
tensor.py's; the vocabulary-parallel embedding and loss are vocab.py's. LayerNorm and
softmax run in float32.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd.config import ModelConfig
from jaxptd.model import context as context_attention, fused
from jaxptd.model.sequence import Rows
from jaxptd.model.tensor import (Layout, dense, entered, exit_tensor, fp8_twin, normal, weight,
                                 zeros)

# checkpoint name of the residual stream between a layer's attention and MLP blocks, which
# model.remat=minimal keeps (with every other dense() output: tensor.DENSE_OUTPUT)
RESIDUAL = "residual"


def softmax_reference(scores, scale: float, causal: bool = True, mask=None, dtype=None):
    """softmax(scale * scores) over the last axis in float32 (-> dtype, default float32),
    keys masked out where the bottom-right aligned causal mask or `mask` (True = masked,
    broadcastable) says; its backward keeps only its output (fused.softmax).
    scores: [b, n, sq, sk]."""
    sq, sk = scores.shape[-2:]
    keep = jnp.ones((), bool)
    if causal:
        keep = jnp.tril(jnp.ones((sq, sk), dtype=bool), k=sk - sq)
    if mask is not None:
        keep = keep & ~mask
    return fused.softmax(scores, scale, keep, dtype or jnp.float32)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis with replicated float32 scale and bias: math in float32
    on x as given, output in the compute dtype; its backward keeps x and the row
    statistics only (fused.layer_norm), in the form `norm_form` picks."""

    cfg: ModelConfig
    layout: Layout | None = None  # None: creating the parameters (init) only

    @nn.compact
    def __call__(self, x):
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        scale = self.param("scale", ones, (x.shape[-1],), jnp.float32)
        bias = self.param("bias", zeros(("norm",)), (x.shape[-1],), jnp.float32)
        return fused.layer_norm(x, scale, bias, self.cfg.layernorm_eps, jnp.dtype(self.cfg.dtype),
                                norm_form(self.cfg, self.layout))


class RMSNorm(nn.Module):
    """RMSNorm (Llama) with a replicated float32 scale, as LayerNorm (fused.rms_norm)."""

    cfg: ModelConfig
    layout: Layout | None = None

    @nn.compact
    def __call__(self, x):
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        scale = self.param("scale", ones, (x.shape[-1],), jnp.float32)
        return fused.rms_norm(x, scale, self.cfg.layernorm_eps, jnp.dtype(self.cfg.dtype),
                              norm_form(self.cfg, self.layout))


def norm_form(cfg: ModelConfig, layout: Layout | None) -> str:
    """The norms' backward form (fused.norm_backward_form) for a layer laid out as `layout`."""
    if layout is None:
        return fused.norm_backward_form(cfg.kernels, "cpu", True)
    fits = (layout.tensor == 1 or layout.sequence_parallel and cfg.remat != "full") and \
        layout.context == layout.expert == 1
    return fused.norm_backward_form(cfg.kernels, layout.platform, fits)


def layer_norm(cfg: ModelConfig, name: str | None = None,
               layout: Layout | None = None) -> LayerNorm:
    return LayerNorm(cfg, layout, name=name)


def rms_norm(cfg: ModelConfig, name: str | None = None, layout: Layout | None = None) -> RMSNorm:
    return RMSNorm(cfg, layout, name=name)


def attend(module: nn.Module, q, k, v, deterministic: bool, *, causal: bool, mask=None,
           cache=None):
    """Attention of q [b, s, n/t, d] over k, v [b, s, nk/t, d] (nk <= n: grouped-query) ->
    (context [b, s, n/t, d], cache).

    Picks cuDNN or Pallas flash attention when asked and possible (Pallas: no mask beyond
    causal, interpret mode off a GPU), else `attention_core` with its
    dropout key and selective recomputation. mask: True = masked, broadcastable to
    [b, n/t, s, sk] (BERT's padding), or a sequence.Rows of the tokens' positions and
    segments (context parallelism, packed rows: model/context.py attends).
    cache: (k_cache, v_cache [b, S, nk/t, d], start) of decoding: k, v are written at
    positions start.. and the queries (at those positions) attend to every cached key up
    to their own; the updated (k_cache, v_cache) is returned (None without a cache).
    """
    cfg, layout = module.cfg, module.layout
    scale = 1.0 / math.sqrt(q.shape[-1])
    if cache is not None:
        k_cache, v_cache, start = cache
        k = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
        v = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
        cache = (k, v)
        positions = start + jnp.arange(q.shape[1])
        mask, causal = jnp.arange(k.shape[1])[None, :] > positions[:, None], False
    if isinstance(mask, Rows):  # the mask of positions and segments, across context ranks
        return context_attention.attention(
            q, k, v, mask, layout, causal=causal, scale=scale,
            cudnn=cfg.attention == "cudnn" and layout.platform == "gpu",
            flash=cfg.kernels == "pallas",
            core=_xla_core(module, deterministic, scale, causal=False)), cache
    padding = mask is not None and mask.ndim == 4 and mask.shape[1:3] == (1, 1)
    if (cfg.attention == "cudnn" and layout.platform == "gpu" and cache is None
            and (mask is None or padding)):
        # cuDNN flash attention: no [s, s] scores in memory (config refuses dropout); it
        # takes grouped-query key/value heads as they are, and a key padding mask as each
        # row's key count (BERT's rows end with their padding: bert.make_batch)
        lengths = None if mask is None else jnp.sum(~mask[:, 0, 0, :], axis=-1, dtype=jnp.int32)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            key_value_seq_lengths=lengths,
                                            implementation="cudnn"), cache
    if cfg.attention == "flash" and cache is None and mask is None:
        # Pallas flash attention (config refuses dropout): any head width to 256, so the
        # heads cuDNN takes only on Hopper (d > 128) on an A100 too
        from pallas_kernels.flash import attention

        return attention(q, k, v, scale, causal, layout.platform != "gpu"), cache
    return _xla_core(module, deterministic, scale, causal)(q, k, v, mask), cache


def _xla_core(module: nn.Module, deterministic: bool, scale: float, causal: bool):
    """(q, k, v, mask) -> `attention_core` with the layer's dropout key (its own on every
    tensor and context rank: each holds other heads or other tokens) and, with
    model.remat=selective, under jax.checkpoint (keep q, k, v; recompute the [s, s] part)."""
    cfg, layout = module.cfg, module.layout
    key = None
    if cfg.dropout and not deterministic:
        key = jax.random.fold_in(module.make_rng("dropout"), _rank(layout))
    core = functools.partial(attention_core, cfg=cfg, layout=layout, scale=scale,
                             causal=causal)
    if cfg.remat == "selective":
        core = jax.checkpoint(core)
    return lambda q, k, v, mask: core(q, k, v, key, mask=mask)


def _rank(layout: Layout):
    """This rank's number among the tensor x context ranks, whose attention dropout masks
    must differ (each holds other heads or other tokens)."""
    rank = 0 if layout.tensor_axis is None else lax.axis_index(layout.tensor_axis)
    if layout.context_axis is not None and layout.context > 1:
        rank = rank + layout.tensor * lax.axis_index(layout.context_axis)
    return rank


class Attention(nn.Module):
    """Self-attention (causal, or bidirectional for BERT): QKV column-parallel by heads,
    output projection row-parallel."""

    cfg: ModelConfig
    layout: Layout
    causal: bool = True

    @nn.compact
    def __call__(self, x, deterministic: bool, mask=None, cache=None):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        heads = cfg.num_heads // layout.tensor
        w_qkv = weight(self, "w_qkv", normal(cfg.init_std, ("embed", "qkv", "heads", "kv")),
                       (cfg.hidden_size, 3, heads, cfg.head_dim))
        b_qkv = self.param("b_qkv", zeros(("qkv", "heads", "kv")), (3, heads, cfg.head_dim))
        w_out = weight(self, "w_out", normal(residual_std(cfg), ("heads", "kv", "embed")),
                       (heads, cfg.head_dim, cfg.hidden_size))
        b_out = self.param("b_out", zeros(("embed",)), (cfg.hidden_size,))

        qkv = entered(self, x, ("w_qkv", w_qkv))[0] + b_qkv.astype(dt)
        q, k, v = (qkv[:, :, i] for i in range(3))  # each [b, s, heads/t, d]
        context, cache = attend(self, q, k, v, deterministic, causal=self.causal, mask=mask,
                                cache=cache)
        out = dense(self, "w_out", context, w_out)  # partial sum over this rank's heads
        return add_bias(layout, exit_tensor(out, layout), b_out), cache  # g: all-reduce #1


def add_bias(layout: Layout, y, bias):
    """y + bias in y's dtype; with model.fp8 by fused.bias_add, whose backward makes the bias
    gradient in one kernel with the output gradient's FP8 cast and amax."""
    return fused.bias_add(y, bias) if layout.fp8 != "none" else y + bias.astype(y.dtype)


def residual_std(cfg: ModelConfig) -> float:
    """Megatron's init of the layers writing into the residual stream: std / sqrt(2 L)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def attention_core(q, k, v, key, *, cfg: ModelConfig, layout: Layout, scale: float,
                   causal: bool = True, mask=None):
    """softmax(scale q k^T) v with the causal mask and/or `mask` (True = masked, broadcastable
    to [b, heads/t, sq, sk]) and, when `key` is given, dropout on the probabilities.
    q: [b, sq, heads/t, d]; k, v: [b, sk, kv_heads/t, d], each key/value head shared by
    heads / kv_heads consecutive query heads (grouped-query attention) -> [b, sq, heads/t, d].

    Megatron's selective recomputation (Korthikanti et al. 2022) recomputes exactly this:
    its [b, heads/t, s, s] tensors are most of a layer's activations at long sequences and
    only 4 b s^2 h of its FLOPs.
    """
    b, sq, heads, d = q.shape
    kv_heads, sk = k.shape[2], k.shape[1]
    grouped = q.reshape(b, sq, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k)  # [b, kv, heads / kv, sq, sk]
    if cfg.kernels == "pallas":
        from pallas_kernels import fused_softmax

        probs = fused_softmax(scores.reshape(b, heads, sq, sk), scale=scale, causal=causal,
                              mask=mask, interpret=layout.platform != "gpu").reshape(
                                  scores.shape).astype(cfg.dtype)
    else:  # in the grouped shape: the softmax's output is the very array the matmul keeps
        grouped_mask = None if mask is None or mask.ndim < 4 else mask[:, :, None]
        probs = softmax_reference(scores, scale, causal,
                                  mask if grouped_mask is None else grouped_mask, cfg.dtype)
    if key is not None:
        probs = dropout(probs, cfg.dropout, key)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, sq, heads, d)


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); ffn = 4h unless set."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        ffn = cfg.ffn // layout.tensor
        w_fc1 = weight(self, "w_fc1", normal(cfg.init_std, ("embed", "mlp")),
                       (cfg.hidden_size, ffn))
        b_fc1 = self.param("b_fc1", zeros(("mlp",)), (ffn,))
        w_fc2 = weight(self, "w_fc2", normal(residual_std(cfg), ("mlp", "embed")),
                       (ffn, cfg.hidden_size))
        b_fc2 = self.param("b_fc2", zeros(("embed",)), (cfg.hidden_size,))

        hidden = entered(self, x, ("w_fc1", w_fc1))[0]  # [b, s, ffn/t]
        if cfg.kernels == "pallas" and cfg.gelu == "tanh":  # the kernel's GeLU is tanh's
            from pallas_kernels import bias_gelu

            hidden = bias_gelu(hidden, b_fc1.astype(dt), interpret=layout.platform != "gpu")
            twin = None
        else:
            twin = None if cfg.gelu == "erf" else fp8_twin(  # fc2's input again, for its amax
                layout, fused.bias_gelu_again, hidden, b_fc1)
            hidden = fused.bias_gelu(hidden, b_fc1, exact=cfg.gelu == "erf")
        out = dense(self, "w_fc2", hidden, w_fc2, twin)  # partial sum over this rank's ffn/t
        return add_bias(layout, exit_tensor(out, layout), b_fc2)  # g: all-reduce #2


class Block(nn.Module):
    """Pre-norm transformer layer: x + drop(attn(norm1 x)); x + drop(mlp(norm2 x)).

    With model.norm_position=post (BERT) each residual starts from the normed value
    instead, y = norm1 x; y + drop(attn(y)), as Megatron's
    apply_residual_connection_post_layernorm: the original BERT's post-LayerNorm
    (LN(x + drop(attn(x)))) with each layer's output norm moved into the next layer's
    input (the first layer's norm is BERT's embedding LayerNorm, the final norm the last
    layer's output norm), so every layer keeps the same parameters and stages split alike.

    The pieces are attributes, so every architecture's layer is this one: GPT's (LayerNorm,
    Attention, MLP), Llama's (RMSNorm, grouped-query attention with rotary positions,
    SwiGLU), BERT's (GPT's, bidirectional with a padding mask). Called with a KV cache it
    returns (x, cache), else x.
    """

    cfg: ModelConfig
    layout: Layout
    attention: type = Attention
    mlp: type = MLP
    norm: Callable = layer_norm
    causal: bool = True

    @nn.compact
    def __call__(self, x, deterministic: bool = True, mask=None, cache=None):
        cfg, layout = self.cfg, self.layout
        post = cfg.norm_position == "post"
        y = self.norm(cfg, "ln1", layout)(x)
        h, new_cache = self.attention(cfg, layout, self.causal, name="attn")(
            y, deterministic, mask, cache)
        x = checkpoint_name((y if post else x) + self._dropout(h, deterministic), RESIDUAL)
        y = self.norm(cfg, "ln2", layout)(x)
        h = self.mlp(cfg, layout, name="mlp")(y)
        x = (y if post else x) + self._dropout(h, deterministic)
        return x if cache is None else (x, new_cache)

    def _dropout(self, x, deterministic):
        # After the all-reduce the activation is the same on every tensor rank: one mask;
        # with sequence parallelism each rank holds other tokens: a mask per rank.
        if not self.cfg.dropout or deterministic:
            return x
        key = self.make_rng("dropout")
        if self.layout.split_sequence:
            key = jax.random.fold_in(key, lax.axis_index(self.layout.tensor_axis))
        if self.layout.context > 1 and self.layout.context_axis is not None:
            key = jax.random.fold_in(key, lax.axis_index(self.layout.context_axis))
        return dropout(x, self.cfg.dropout, key)


def dropout(x, rate: float, key):
    """x with each element kept with probability 1 - rate and scaled by 1 / (1 - rate), else
    zero (x's dtype)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
