"""The Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention, untied output layer, no biases. `ARCH`: its functions as the architecture
interface (jaxptd/arch/interface.py; config rules and Hugging Face names:
jaxptd/arch/llama.py).

Parameter tree (global shapes; n heads, k key/value heads, d = h / n, f = model.ffn):

    embed/wte [V, h]                     vocab-parallel
    layers/ln1/scale, layers/ln2/scale [L, h]
    layers/attn/w_q [L, h, n, d]         column-parallel by heads
    layers/attn/w_kv [L, h, 2, k, d]     column-parallel by key/value heads when the tensor
                                         size t divides k; else replicated (t a multiple
                                         of k), each rank using the one head its queries share
    layers/attn/b_q [L, n, d], b_kv [L, 2, k, d]   model.qkv_bias only (Qwen2's), split as
                                         w_q and w_kv
    layers/attn/w_o [L, n, d, h]         row-parallel
    layers/mlp/w_gate, w_up [L, h, f], w_down [L, f, h]   column-, column-, row-parallel
                                         (a mixture of experts' instead: model/moe.py, with
                                         SwiGLU experts [L, E, ...] and this MLP as the
                                         shared experts, layers/mlp/shared/...; with
                                         model.moe_every = k, units [L/k, ...] of k
                                         layers, layers/layer_j/..., the last a mixture)
    final_norm/scale [h]
    head/w_head [h, V]                   column-parallel by vocabulary

Rotary embeddings rotate the two halves of each head (Hugging Face's `rotate_half`
convention, so its q/k weights need no permutation), frequencies theta^(-2i/d), scaled as
Llama 3.1's with model.rope_scaling=llama3 (`inverse_frequencies`).
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxptd.arch.interface import Architecture, Decoder
from jaxptd.config import ModelConfig
from jaxptd.model import fused, stack
from jaxptd.model.layers import Block, attend, residual_std, rms_norm
from jaxptd.model.moe import MoE, mlp_flops
from jaxptd.model.sequence import Rows, local_positions
from jaxptd.model.tensor import (Layout, dense, enter_tensor, entered, exit_tensor, normal,
                                 weight, zeros)
from jaxptd.model.vocab import Embed


def kv_sharded(cfg: ModelConfig, tensor: int) -> bool:
    """Whether key/value heads split over the tensor ranks (else they are replicated)."""
    return cfg.kv_heads % tensor == 0


def inverse_frequencies(cfg: ModelConfig):
    """The rotary frequencies [d/2] float32: theta^(-2i/d), and with rope_scaling=llama3
    transformers' `_compute_llama3_parameters`: wavelengths 2 pi / f longer than
    original / low_freq_factor slowed by `factor`, shorter than original / high_freq_factor
    kept, those between interpolated (smooth = (original / wavelength - low) / (high - low))."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if cfg.rope_scaling == "none":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_seq_len
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelength > original / low, inv_freq / factor,
                     jnp.where(wavelength < original / high, inv_freq, between))


def rotary(x, positions, inv_freq):
    """x [b, s, heads, d] rotated by positions [s] or [b, s] at frequencies inv_freq [d/2]
    (float32 math, x's dtype out)."""
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(b,) s, d/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[..., None, :]  # [(b,) s, 1, d]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[..., None, :]
    x32 = x.astype(jnp.float32)
    half = jnp.concatenate([-x32[..., d // 2:], x32[..., : d // 2]], -1)
    return (x32 * cos + half * sin).astype(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions; biases on the query, key
    and value projections with model.qkv_bias (Qwen2's), none on the output."""

    cfg: ModelConfig
    layout: Layout
    causal: bool = True

    @nn.compact
    def __call__(self, x, deterministic: bool, mask=None, cache=None):  # x: [b, s, h]
        cfg, layout = self.cfg, self.layout
        t, d = layout.tensor, cfg.head_dim
        sharded = kv_sharded(cfg, t)
        kv_name = "kv_heads" if sharded else "kv_heads_replicated"
        kv_heads = cfg.kv_heads // t if sharded else cfg.kv_heads  # this rank's
        w_q = weight(self, "w_q", normal(cfg.init_std, ("embed", "heads", "kv")),
                     (cfg.hidden_size, cfg.num_heads // t, d))
        w_kv = weight(self, "w_kv", normal(cfg.init_std, ("embed", "qkv", kv_name, "kv")),
                      (cfg.hidden_size, 2, kv_heads, d))
        w_o = weight(self, "w_o", normal(residual_std(cfg), ("heads", "kv", "embed")),
                     (cfg.num_heads // t, d, cfg.hidden_size))

        # q [b, s, n/t, d], kv [b, s, 2, k/t (or k), d]
        q, kv = entered(self, x, ("w_q", w_q), ("w_kv", w_kv))
        if cfg.qkv_bias:  # split (or replicated) as their weights' output columns
            b_q = self.param("b_q", zeros(("heads", "kv")), (cfg.num_heads // t, d))
            b_kv = self.param("b_kv", zeros(("qkv", kv_name, "kv")), (2, kv_heads, d))
            q, kv = q + b_q.astype(q.dtype), kv + b_kv.astype(kv.dtype)
        k, v = kv[:, :, 0], kv[:, :, 1]
        if not sharded and layout.tensor_axis is not None:
            # t / k consecutive ranks share key/value head r // (t / k); the gradient of
            # the replicated weight sums over the ranks (JAX's varying-axes transpose).
            head = lax.axis_index(layout.tensor_axis) // (t // cfg.kv_heads)
            k, v = (lax.dynamic_slice_in_dim(a, head, 1, axis=2) for a in (k, v))
        start = 0 if cache is None else cache[2]
        positions = start + jnp.arange(q.shape[1])  # the whole sequence (SP: gathered)
        if isinstance(mask, Rows):  # context parallelism, packed rows: [b, s (/ c)]
            positions = local_positions(mask, layout)
        inv_freq = inverse_frequencies(cfg)
        q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
        context, cache = attend(self, q, k, v, deterministic, causal=self.causal,
                                mask=mask, cache=cache)
        out = dense(self, "w_o", context, w_o)  # partial sum over this rank's heads
        return exit_tensor(out, layout), cache  # g: all-reduce #1


class MLP(nn.Module):
    """SwiGLU: (silu(x W_gate) * x W_up) W_down; gate and up column-, down row-parallel."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x):  # x: [b, s, h]
        cfg, layout = self.cfg, self.layout
        ffn = cfg.ffn // layout.tensor
        w_gate = weight(self, "w_gate", normal(cfg.init_std, ("embed", "mlp")),
                        (cfg.hidden_size, ffn))
        w_up = weight(self, "w_up", normal(cfg.init_std, ("embed", "mlp")), (cfg.hidden_size, ffn))
        w_down = weight(self, "w_down", normal(residual_std(cfg), ("mlp", "embed")),
                        (ffn, cfg.hidden_size))
        hidden = fused.swiglu(*entered(self, x, ("w_gate", w_gate), ("w_up", w_up)))
        return exit_tensor(dense(self, "w_down", hidden, w_down), layout)  # g: all-reduce #2


class Head(nn.Module):
    """The untied output layer: x [b, s, h] -> logits [b, s, V/t] float32, never gathered."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x):
        w_head = self.param("w_head", normal(self.cfg.init_std, ("embed", "vocab")),
                            (self.cfg.hidden_size, self.layout.vocab // self.layout.tensor))
        return dense(self, "w_head", enter_tensor(x, self.layout), w_head).astype(jnp.float32)


def block(cfg: ModelConfig, layout: Layout) -> nn.Module:
    """The layer stack's element (stack.block): a layer, or with model.moe_every > 1 a
    unit of layers."""
    return stack.block(cfg, layout,
                       functools.partial(Block, attention=Attention, mlp=MLP, norm=rms_norm),
                       functools.partial(MoE, shared=MLP, gated=True))


def _boxed_init(cfg: ModelConfig, vocab: int, key):
    """Global parameters as Flax `Partitioned` boxes (values plus logical names)."""
    return stack.boxed_init(cfg, vocab, key, block, {"embed": (Embed, True), "head": (Head, False)},
                            {"final_norm": rms_norm(cfg)})


def init_params(cfg: ModelConfig, vocab: int, key):
    """Global float32 parameters (N(0, init_std); residual outputs scaled by 1/sqrt(2L))."""
    return nn.unbox(_boxed_init(cfg, vocab, key))


def logical_axes(cfg: ModelConfig, vocab: int, tensor: int = 1):
    """Logical names; the key/value heads (of w_kv and b_kv) are 'kv_heads' (split over
    tensor) when `tensor` divides them, else 'kv_heads_replicated'."""
    specs = nn.get_partition_spec(jax.eval_shape(
        lambda: _boxed_init(cfg, vocab, jax.random.key(0))))
    if not kv_sharded(cfg, tensor):
        for layer in stack.layer_trees(specs["layers"], cfg):
            attn = layer["attn"]
            for name in ("w_kv", "b_kv") if cfg.qkv_bias else ("w_kv",):
                attn[name] = P(*("kv_heads_replicated" if n == "kv_heads" else n
                                 for n in attn[name]))
    return specs


def logits(ends, x, cfg: ModelConfig, layout: Layout):
    """Final RMSNorm and the output layer: x [b, s, h] ([b, s/t, h] with sequence
    parallelism, gathered by the column-parallel Head) -> [b, s, V/t] float32."""
    x = rms_norm(cfg, layout=layout).apply({"params": ends["final_norm"]}, x)
    return Head(cfg, layout).apply({"params": ends["head"]}, x)


embed, head_loss, decode, attention_rows = stack.decoder(Embed, block, logits)


def init_cache(cfg: ModelConfig, layout: Layout, batch: int, length: int):
    heads = cfg.kv_heads // layout.tensor if kv_sharded(cfg, layout.tensor) else 1
    return stack.init_cache(cfg, heads, batch, length)


def forward_flops(cfg: ModelConfig, vocab: int) -> dict:
    """Matmul FLOPs per token of one forward pass: a layer (queries and output 2 h^2 each,
    keys and values 4 h k d, the MLP's moe.mlp_flops: SwiGLU 6 h f, a mixture of experts'
    active part, a mean over the layers when every k-th is one; attention core 4 s h), its
    core, its queries', keys' and values' projection, the head."""
    h, s = cfg.hidden_size, cfg.seq_len
    mlp = mlp_flops(cfg, 6)
    qkv = 2 * h * h + 4 * h * cfg.kv_heads * cfg.head_dim
    return {"layer": 2 * h * h + qkv + mlp + 4 * s * h, "core": 4 * s * h, "qkv": qkv,
            "head": 2 * h * vocab}


ARCH = Architecture(init_params=init_params, logical_axes=logical_axes, embed=embed,
                    block=block, head_loss=head_loss, forward_flops=forward_flops,
                    attention_mask=attention_rows,
                    decoder=Decoder(logits, decode, init_cache))
