"""The GPT model (the papers' GPT-2-shaped decoder) as pure functions over a parameter tree,
ready to be cut into stages.

Parameter tree (global shapes; L = num_layers, V = padded vocabulary):

    embed/wte [V, h], embed/wpe [seq, h]
    layers/{ln1, attn, ln2, mlp}/...  each with a leading [L] axis (model order)
    final_norm/{scale, bias} [h]

Learned positions, LayerNorm, GeLU MLP, biases, and the tied embedding as the output
layer. The functions follow the architecture interface of jaxptd/model/__init__.py;
`Layout` (layers.py) says how they see the parameters. The model never sees a mesh.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxptd.config import ModelConfig
from jaxptd.model import stack
from jaxptd.model.layers import (Block, Embed, Layout, embedding_dropout, layer_norm,
                                 vocab_parallel_xent)


def _block(cfg: ModelConfig, layout: Layout) -> Block:
    return Block(cfg, layout)


def _embed(cfg: ModelConfig, layout: Layout) -> Embed:
    return Embed(cfg, layout, positions=cfg.seq_len)


def _boxed_init(cfg: ModelConfig, vocab: int, key):
    """Global parameters as Flax `Partitioned` boxes (values plus logical names)."""
    layout = Layout(vocab)
    k_embed, k_layers = jax.random.split(key)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    x = jnp.zeros((1, cfg.seq_len, cfg.hidden_size), cfg.dtype)
    embed = _embed(cfg, layout).init(k_embed, tokens)["params"]
    layers = stack.init_layers(_block(cfg, layout), cfg, k_layers, x)
    final_norm = layer_norm(cfg).init(jax.random.key(0), x.astype(jnp.float32))["params"]
    return {"embed": embed, "layers": layers, "final_norm": final_norm}


def init_params(cfg: ModelConfig, vocab: int, key):
    """Global float32 parameters (N(0, 0.02); residual outputs scaled by 1/sqrt(2L))."""
    return nn.unbox(_boxed_init(cfg, vocab, key))


def logical_axes(cfg: ModelConfig, vocab: int, tensor: int = 1):
    """A tree (like the parameters) of PartitionSpecs holding logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(cfg, vocab, jax.random.key(0))))


def embed(ends, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """batch [b, s + 1] int32 (inputs are its first s tokens) -> activations [b, s, h] in
    the compute dtype, with dropout on the embedding sum."""
    x = _embed(cfg, layout).apply({"params": ends["embed"]}, batch[:, :-1])
    return embedding_dropout(x, key, cfg, deterministic)


def apply_layers(layers, x, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """A stack of layers (leading axis n) on x [b, s, h]; see stack.scan_layers."""
    return stack.scan_layers(_block(cfg, layout), layers, x, key, cfg, deterministic)


def logits(ends, x, cfg: ModelConfig, layout: Layout):
    """Final LayerNorm and the tied output layer: x [b, s, h] -> [b, s, V/t] float32."""
    x = layer_norm(cfg).apply({"params": ends["final_norm"]}, x.astype(jnp.float32))
    return _embed(cfg, layout).apply({"params": ends["embed"]}, x.astype(cfg.dtype),
                                     method=Embed.logits)


def head_loss(ends, x, batch, cfg: ModelConfig, layout: Layout):
    """x [b, s, h], batch [b, s + 1] int32 (targets are its last s tokens) -> scalar float32
    sum of the token losses (vocab-parallel cross-entropy)."""
    return jnp.sum(vocab_parallel_xent(logits(ends, x, cfg, layout), batch[:, 1:], cfg, layout))


def decode(params, tokens, cache, start, cfg: ModelConfig, layout: Layout):
    """tokens [b, q] at positions start.. -> (logits [b, q, V/t] float32, cache)."""
    x = _embed(cfg, layout).apply({"params": params["embed"]}, tokens, start)
    x, cache = stack.decode_layers(_block(cfg, layout), params["layers"], x, cache, start)
    return logits(params, x, cfg, layout), cache


def init_cache(cfg: ModelConfig, layout: Layout, batch: int, length: int):
    return stack.init_cache(cfg, cfg.num_heads // layout.tensor, batch, length)


def max_length(cfg: ModelConfig) -> int:
    """Longest sequence the model can read: its learned positions."""
    return cfg.seq_len


def forward_flops(cfg: ModelConfig, vocab: int) -> dict:
    """Matmul FLOPs per token of one forward pass: a layer (24 h^2 + 4 s h with ffn = 4h,
    PTD-P eq. 3), its attention core (4 s h) and the logit layer (2 h V)."""
    h, s = cfg.hidden_size, cfg.seq_len
    return {"layer": 8 * h * h + 4 * h * cfg.ffn + 4 * s * h, "core": 4 * s * h,
            "head": 2 * h * vocab}
