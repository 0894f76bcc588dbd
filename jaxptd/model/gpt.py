"""The GPT model as pure functions over a parameter tree, ready to be cut into stages.

Owns the parameter tree, its initialisation and logical axes, and the three pieces a
pipeline stage is built from:

    embed(params, batch)           -> x        first stage
    block(cfg, layout)             -> one layer (jaxptd.model.apply_layers runs a stack)
    head_loss(params, x, batch)    -> sum of token losses   last stage (tied embedding)

Parameter tree (global shapes; L = num_layers, V = padded vocabulary):

    embed/wte [V, h], embed/wpe [seq, h]
    layers/{ln1, attn, ln2, mlp}/...  each with a leading [L] axis (model order)
    final_norm/{scale, bias} [h]

The functions follow the architecture interface of jaxptd/model/__init__.py; `Layout`
(layers.py) says how they see the parameters. The model never sees a mesh.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model.layers import Block, Embed, Layout, enter_tensor, layer_norm, psum


def block(cfg: ModelConfig, layout: Layout) -> Block:
    """One layer (the stack is applied by jaxptd.model.apply_layers)."""
    return Block(cfg, layout)


def _embed(cfg: ModelConfig, layout: Layout) -> Embed:
    return Embed(cfg, layout)


def _boxed_init(cfg: ModelConfig, vocab: int, key):
    """Global parameters as Flax `Partitioned` boxes (values plus logical names)."""
    layout = Layout(vocab)
    k_embed, k_layers = jax.random.split(key)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    x = jnp.zeros((1, cfg.seq_len, cfg.hidden_size), cfg.dtype)
    embed = _embed(cfg, layout).init(k_embed, tokens)["params"]
    layer = block(cfg, layout)
    layers = jax.vmap(lambda k: layer.init(k, x)["params"])(
        jax.random.split(k_layers, cfg.num_layers))
    # vmap stacked the values; prepend the 'layers' name to every box.
    layers = jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)), layers,
                          is_leaf=lambda b: isinstance(b, nn.Partitioned))
    final_norm = layer_norm(cfg).init(jax.random.key(0), x.astype(jnp.float32))["params"]
    return {"embed": embed, "layers": layers, "final_norm": final_norm}


def init_params(cfg: ModelConfig, vocab: int, key):
    """Global float32 parameters (N(0, 0.02); residual outputs scaled by 1/sqrt(2L))."""
    return nn.unbox(_boxed_init(cfg, vocab, key))


def logical_axes(cfg: ModelConfig, vocab: int):
    """A tree (like the parameters) of PartitionSpecs holding logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(cfg, vocab, jax.random.key(0))))


def embed(params, batch, cfg: ModelConfig, layout: Layout):
    """batch [b, s + 1] int32 (inputs are its first s tokens) -> activations [b, s, h] in
    the compute dtype."""
    return _embed(cfg, layout).apply({"params": params["embed"]}, batch[:, :-1])


def head_loss(params, x, batch, cfg: ModelConfig, layout: Layout):
    """Final LayerNorm, tied output layer and vocab-parallel cross-entropy.

    x [b, s, h], batch [b, s + 1] int32 (targets are its last s tokens) -> scalar float32
    sum of token losses. The
    [b, s, vocab/t] logits stay on their tensor rank: only [b, s] maxima, sums of
    exponentials and target logits cross the tensor axis. Padded vocabulary rows never
    take probability.
    """
    targets = batch[:, 1:]
    x = layer_norm(cfg).apply({"params": params["final_norm"]}, x.astype(jnp.float32))
    x = enter_tensor(x.astype(cfg.dtype), layout)  # SP: the whole sequence for the logits
    module = _embed(cfg, layout)
    logits = module.apply({"params": params["embed"]}, x, method=Embed.logits)  # [b, s, V/t]
    ids = module.apply({"params": params["embed"]}, method=Embed.vocab_start) + jnp.arange(
        logits.shape[-1])
    logits = jnp.where(ids < cfg.vocab_size, logits, -jnp.inf)
    # The max only stabilises the exponentials; its gradient cancels, so it is stopped.
    row_max = lax.stop_gradient(jnp.max(logits, axis=-1))  # [b, s]
    if layout.tensor_axis is not None:
        row_max = lax.pmax(row_max, layout.tensor_axis)
    sum_exp = psum(jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1), layout.tensor_axis)
    target_logit = psum(
        jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1), layout.tensor_axis)
    return jnp.sum(jnp.log(sum_exp) + row_max - target_logit)
