"""What the architectures share: the stacked element (`block`: a layer, or a `Unit` of
model.moe_every layers when every k-th layer is a mixture of experts), stacked
initialisation with logical names (every architecture's), and for the decoders the scan
over layers with a KV cache (decoding; training's layer scan is jaxptd.model.apply_layers)
and their interface functions.

The stacked elements' parameters are stacked on a leading [model.units] axis named
'layers' (one element a layer, unless a Unit); element i of a stack draws dropout from
fold_in(key, i).

Initialisation does not depend on the layout: every parameter is drawn at the real
vocabulary (model.vocab_size), and its axes named 'vocab' are then padded with zeros to the
layout's padded vocabulary (128 x tensor), so one seed gives bitwise the same logical
parameters at every tensor size. The padding stays zero in training: padded ids are never
looked up and never take probability (vocab.vocab_parallel_xent), so their gradients and
Adam moments are zero, and AdamW's decay of a zero is zero.
"""
from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model import sequence
from jaxptd.model.tensor import Layout
from jaxptd.model.vocab import embedding_dropout, vocab_parallel_xent


class Unit(nn.Module):
    """model.moe_every = k consecutive layers as one element of the layer stack:
    layer_0 .. layer_{k-2} with the dense MLP, layer_{k-1} with the mixture of experts
    (model layer u k + j is unit u's layer_j), so that the stack stays one scan over
    identical trees. Called like a Block; its KV cache is [k, ...] (init_cache)."""

    cfg: ModelConfig
    layout: Layout
    dense: Callable  # (cfg, layout, name=) -> the dense layer, a Block
    sparse: Callable  # the same with the mixture of experts

    @nn.compact
    def __call__(self, x, deterministic: bool = True, mask=None, cache=None):
        k = self.cfg.unit
        caches = []
        for j in range(k):
            layer = (self.sparse if j == k - 1 else self.dense)(self.cfg, self.layout,
                                                                name=f"layer_{j}")
            if cache is None:
                x = layer(x, deterministic, mask)
            else:
                x, kv = layer(x, deterministic, mask, (cache[0][j], cache[1][j], cache[2]))
                caches.append(kv)
        return x if cache is None else (x, tuple(jnp.stack(c) for c in zip(*caches)))


def block(cfg: ModelConfig, layout: Layout, layer: Callable, moe_mlp: Callable) -> nn.Module:
    """The layer stack's element: layer(cfg, layout) (a Block factory), with a mixture of
    experts its MLP moe_mlp in every layer, or in every moe_every-th (a Unit)."""
    if not cfg.moe:
        return layer(cfg, layout)
    sparse = functools.partial(layer, mlp=moe_mlp)
    if cfg.unit == 1:
        return sparse(cfg, layout)
    return Unit(cfg, layout, dense=layer, sparse=sparse)


def layer_tree(layers: dict, cfg: ModelConfig, j: int) -> dict:
    """A stack's tree (of parameters, or anything keyed alike) -> the subtree of layer j of
    a unit (with one layer a unit: layers itself; the mixture is layer cfg.unit - 1)."""
    return functools.reduce(lambda tree, name: tree[name], cfg.layer_path(j), layers)


def layer_trees(layers: dict, cfg: ModelConfig) -> list[dict]:
    """The subtrees of all of a unit's layers (layer_tree)."""
    return [layer_tree(layers, cfg, j) for j in range(cfg.unit)]


def init_layers(block: nn.Module, cfg: ModelConfig, key, x):
    """Boxed parameters of cfg.units independently drawn elements, stacked [units, ...],
    with 'layers' prepended to every logical name. x: a [1, s, h] example input."""
    layers = jax.vmap(lambda k: block.init(k, x)["params"])(
        jax.random.split(key, cfg.units))
    return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)), layers,
                        is_leaf=lambda b: isinstance(b, nn.Partitioned))


def init_cache(cfg: ModelConfig, kv_heads: int, batch: int, length: int):
    """Zero keys and values for decoding: two [L, batch, length, kv_heads, d] arrays (this
    rank's key/value heads) in the compute dtype ([units, k, ...] with Units of k)."""
    unit = (cfg.unit,) if cfg.unit > 1 else ()
    shape = (cfg.units, *unit, batch, length, kv_heads, cfg.head_dim)
    return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def decode_layers(block: nn.Module, layers, x, cache, start):
    """x [b, q, h] at positions start.. through every layer, reading and extending the
    cache (from init_cache) -> (x, cache). No dropout."""
    def one_layer(x, layer_and_cache):
        layer, k_cache, v_cache = layer_and_cache
        x, (k_cache, v_cache) = block.apply({"params": layer}, x, True, None,
                                            (k_cache, v_cache, start))
        return x, (k_cache, v_cache)

    return lax.scan(one_layer, x, (layers, *cache))


def boxed_init(cfg: ModelConfig, vocab: int, key, block, keyed: dict, norms: dict):
    """Global parameters as Flax boxes: {'layers': cfg.units stacked elements} plus the ends,
    padded to the vocabulary `vocab` (module docstring).

    block: the layer's factory of (cfg, layout); keyed: {name: (factory of (cfg, layout),
    takes_tokens)} drawn with their own keys (in this order, the layers' key last); norms:
    {name: module} (ones and zeros: no key). The factories get the global layout of the
    real vocabulary. Example inputs are [1, s] tokens or [1, s, h] activations.
    """
    drawn = Layout(cfg.vocab_size, fp8=cfg.fp8)  # (delayed: each linear's amax history)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    x = jnp.zeros((1, cfg.seq_len, cfg.hidden_size), cfg.dtype)
    *keys, k_layers = jax.random.split(key, len(keyed) + 1)
    tree = {name: make(cfg, drawn).init(k, tokens if takes_tokens else x)["params"]
            for (name, (make, takes_tokens)), k in zip(keyed.items(), keys)}
    tree.update({name: norm.init(jax.random.key(0), x.astype(jnp.float32))["params"]
                 for name, norm in norms.items()})
    tree["layers"] = init_layers(block(cfg, drawn), cfg, k_layers, x)
    return jax.tree.map(lambda box: _pad_vocab(box, vocab), tree,
                        is_leaf=lambda b: isinstance(b, nn.Partitioned))


def _pad_vocab(box: nn.Partitioned, vocab: int) -> nn.Partitioned:
    """A box drawn at the real vocabulary with zeros appended along its 'vocab' axes."""
    widths = [(0, vocab - size if name == "vocab" else 0)
              for name, size in zip(box.names, box.value.shape)]
    return box.replace_boxed(jnp.pad(box.value, widths))


def decoder(embed_module, block, logits):
    """The interface functions every decoder shares, from its embedding module and layer
    (factories of (cfg, layout)) and its `logits(ends, x, cfg, layout)`:
    (embed, head_loss, decode, attention_rows)."""

    def embed(ends, batch, key, cfg, layout, deterministic: bool):
        """batch [b, s + 1] int32 (inputs: its first s tokens) -> [b, s, h] in the compute
        dtype, with dropout on the embedding (context parallelism: this rank's s / c
        tokens, model/sequence.py)."""
        inputs = batch[:, :-1]
        rows = sequence.rows_of(inputs, cfg, layout)
        x = embed_module(cfg, layout).apply({"params": ends["embed"]},
                                            sequence.split(inputs, layout), 0,
                                            None if rows is None else
                                            sequence.local_positions(rows, layout))
        return embedding_dropout(sequence.vary(x, layout), key, cfg, layout, deterministic)

    def head_loss(ends, x, batch, cfg, layout):
        """x [b, s, h], batch [b, s + 1] (targets: its last s tokens) -> the sum of the
        token losses (vocab-parallel cross-entropy; packed rows: not the target after a
        document end)."""
        losses = vocab_parallel_xent(logits(ends, x, cfg, layout),
                                     sequence.split(batch[:, 1:], layout), cfg, layout)
        counted = sequence.loss_mask(batch[:, :-1], cfg, layout)
        return jnp.sum(losses if counted is None else jnp.where(counted, losses, 0.0))

    def decode(params, tokens, cache, start, cfg, layout):
        """tokens [b, q] at positions start.. -> (logits [b, q, V/t] float32, cache)."""
        x = embed_module(cfg, layout).apply({"params": params["embed"]}, tokens, start)
        x, cache = decode_layers(block(cfg, layout), params["layers"], x, cache, start)
        return logits(params, x, cfg, layout), cache

    def attention_rows(batch, cfg, layout):
        """What every layer's attention gets: sequence.Rows of the input tokens, or None
        (then no batch is needed)."""
        if not sequence.needs_rows(cfg, layout):
            return None
        return sequence.rows_of(batch[:, :-1], cfg, layout)

    return embed, head_loss, decode, attention_rows
