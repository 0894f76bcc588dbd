"""The models: shared Flax modules in layers.py and stack.py, one module per architecture
(gpt.py, llama.py, bert.py), and the interface every part outside model/ uses, so that
nothing else branches on the architecture.

An architecture module defines, over a parameter tree {'layers': [L, ...] stacked layer
leaves, plus the "ends" (every other top-level key: embedding, final norm, output layer)}:

    init_params(cfg, vocab, key)                  global float32 parameters
    logical_axes(cfg, vocab, tensor)              their logical axis names (PartitionSpecs;
                                                  a few depend on the tensor size)
    embed(ends, batch, key, cfg, layout, deterministic)   batch [b, W] -> x [b, s, h]
    apply_layers(layers, x, batch, key, cfg, layout, deterministic)
                                                  any contiguous block of layers
    head_loss(ends, x, batch, cfg, layout)        -> the batch's loss sum (see below)
    forward_flops(cfg, vocab)                     matmul FLOPs per token: {layer, core, head}

and, for decoders, `logits(ends, x, cfg, layout)` (final norm and output layer),
`decode(params, tokens, cache, start, cfg, layout)` and `init_cache(cfg, layout, batch,
length)` (jaxptd/generate.py). Architectures with their own
batch rows (BERT) also define `batch_width(cfg)`, `make_batch(tokens, seed, step, first_row,
cfg)` and `reserved_ids(cfg)`; the defaults below are the decoders'.

A batch row is what the data gives (token rows [s + 1]) turned into the architecture's
row by `make_batch`; every stage gets the microbatch's rows. The loss convention: the step
divides the sum of `head_loss` over the global batch by (global batch x seq_len), so a
decoder returns the sum of its token losses and BERT seq_len x each row's loss.

`Layout` (layers.py) says whether the functions see global parameters or one tensor rank's
shards. `get(cfg)` returns the architecture module; `loss_sum` composes the pieces.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxptd.config import ModelConfig
from jaxptd.model.layers import Layout


def get(cfg: ModelConfig):
    """The architecture module named by model.arch."""
    return importlib.import_module(f"jaxptd.model.{cfg.arch}")


def ends(params) -> dict:
    """The parameters outside the layer stack (used by the first and last stages)."""
    return {k: v for k, v in params.items() if k != "layers"}


def loss_sum(params, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """The whole model: batch [b, W] int32 -> its loss sum (float32; module docstring)."""
    arch = get(cfg)
    x = arch.embed(ends(params), batch, key, cfg, layout, deterministic)
    x = arch.apply_layers(params["layers"], x, batch, key, cfg, layout, deterministic)
    return arch.head_loss(ends(params), x, batch, cfg, layout)


def forward_logits(params, tokens, cfg: ModelConfig, layout: Layout):
    """A decoder's logits [b, s, V/t] float32 for tokens [b, s] through the training
    forward (no cache, no dropout)."""
    arch, key = get(cfg), jax.random.key(0)
    batch = jnp.pad(tokens, ((0, 0), (0, 1)))  # the rows embed expects: s + 1 tokens
    x = arch.embed(ends(params), batch, key, cfg, layout, True)
    x = arch.apply_layers(params["layers"], x, batch, key, cfg, layout, True)
    return arch.logits(ends(params), x, cfg, layout)


def batch_width(cfg: ModelConfig) -> int:
    """Columns of a batch row: s + 1 tokens for decoders."""
    return getattr(get(cfg), "batch_width", lambda c: c.seq_len + 1)(cfg)


def make_batch(tokens: np.ndarray, seed: int, step: int, first_row: int,
               cfg: ModelConfig) -> np.ndarray:
    """Token rows [n, s + 1] (rows first_row.. of batch `step`) -> the architecture's rows
    [n, batch_width] int32, a pure function of its arguments (numpy, on the host)."""
    arch = get(cfg)
    if not hasattr(arch, "make_batch"):
        return tokens
    return arch.make_batch(tokens, seed, step, first_row, cfg)


def reserved_ids(cfg: ModelConfig) -> int:
    """Ids at the top of model.vocab_size the architecture keeps for itself (BERT's special
    tokens); the data's ids must stay below them."""
    return getattr(get(cfg), "reserved_ids", lambda c: 0)(cfg)


def weight_decay_mask(params):
    """True for matrices (names starting with 'w'); biases and norms are not decayed."""
    def decayed(path, _):
        return getattr(path[-1], "key", "").startswith("w")
    return jax.tree_util.tree_map_with_path(decayed, params)
