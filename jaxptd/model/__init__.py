"""The models: Flax modules in layers.py, one module per architecture (gpt.py), and the
interface every part outside model/ uses, so that nothing else branches on the architecture.

An architecture module defines, over a parameter tree {'layers': [L, ...] stacked layer
leaves, plus the "ends" (every other top-level key: embedding, final norm, output layer)}:

    init_params(cfg, vocab, key)                  global float32 parameters
    logical_axes(cfg, vocab)                      their logical axis names (PartitionSpecs)
    embed(ends, batch, cfg, layout)               batch [b, s + 1] -> x [b, s, h]   first stage
    apply_layers(layers, x, key, cfg, layout, deterministic)   any contiguous block of layers
    head_loss(ends, x, batch, cfg, layout)        -> sum of token losses            last stage

`Layout` (layers.py) says whether the functions see global parameters or one tensor rank's
shards. `get(cfg)` returns the architecture module; `loss_sum` composes the three pieces.
"""
from __future__ import annotations

import jax

from jaxptd.config import ModelConfig
from jaxptd.model.layers import Layout


def get(cfg: ModelConfig):
    """The architecture module named by model.arch."""
    from jaxptd.model import gpt
    return {"gpt": gpt}[cfg.arch]


def ends(params) -> dict:
    """The parameters outside the layer stack (used by the first and last stages)."""
    return {k: v for k, v in params.items() if k != "layers"}


def loss_sum(params, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """The whole model: batch [b, s + 1] int32 -> sum of the b*s token losses (float32)."""
    arch = get(cfg)
    x = arch.embed(ends(params), batch, cfg, layout)
    x = arch.apply_layers(params["layers"], x, key, cfg, layout, deterministic)
    return arch.head_loss(ends(params), x, batch, cfg, layout)


def weight_decay_mask(params):
    """True for matrices (names starting with 'w'); biases and norms are not decayed."""
    def decayed(path, _):
        return getattr(path[-1], "key", "").startswith("w")
    return jax.tree_util.tree_map_with_path(decayed, params)
