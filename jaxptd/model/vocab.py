"""The vocabulary-parallel ends of a model (Megatron-LM 2019, §3): the token embedding,
whose [V/t, h] table is also the tied output layer of GPT and BERT, the embedding dropout,
and the cross-entropy of logits that stay split over the vocabulary on the tensor ranks.
Padded vocabulary rows (layout.vocab > model.vocab_size) are never looked up and never take
probability.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model.layers import dropout
from jaxptd.model.products import apart_einsum
from jaxptd.model.tensor import (Layout, exit_tensor, normal, psum, token_block,
                                 token_positions)


class Embed(nn.Module):
    """Vocab-parallel token embedding plus `positions` learned positions (0: none, as with
    rotary embeddings); its table is the tied head of GPT and BERT."""

    cfg: ModelConfig
    layout: Layout
    positions: int = 0

    def setup(self):
        cfg = self.cfg
        self.vocab = self.layout.vocab // self.layout.tensor  # local rows
        self.wte = self.param("wte", normal(cfg.init_std, ("vocab", "embed")),
                              (self.vocab, cfg.hidden_size))
        if self.positions:
            self.wpe = self.param("wpe", normal(cfg.init_std, ("positions", "embed")),
                                  (self.positions, cfg.hidden_size))

    def __call__(self, tokens, start=0, positions=None):
        # tokens: [b, s] int32 at positions start.. (or at `positions` [b, s]: context
        # parallelism, packed rows) -> [b, s, h] ([b, s/t, h] with SP).
        # Megatron's lookup: ids outside this rank's rows give zeros; the all-reduce (with
        # SP the reduce-scatter) sums the one rank that holds each id.
        local = tokens - vocab_start(self.layout)
        inside = (local >= 0) & (local < self.vocab)
        rows = jnp.take(self.wte, jnp.clip(local, 0, self.vocab - 1), axis=0)
        x = exit_tensor(jnp.where(inside[..., None], rows, 0.0), self.layout)
        if self.positions:
            where = start + token_positions(*tokens.shape, self.layout) if positions is None \
                else token_block(positions, self.layout)  # [b, s(/t)]
            x = x + jnp.take(self.wpe, where, axis=0)
        return x.astype(self.cfg.dtype)

    def logits(self, x):  # x: [b, s, h] -> [b, s, vocab/t] float32, never gathered
        if self.layout.apart:  # the table's gradient in float32 (Layout.apart)
            return apart_einsum("bsh,vh->bsv")(x.astype(self.cfg.dtype), self.wte).astype(
                jnp.float32)
        return jnp.einsum("bsh,vh->bsv", x, self.wte.astype(self.cfg.dtype)).astype(jnp.float32)


def embedding_dropout(x, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """Dropout on the embedding output (GPT-2's and Megatron's), one mask for all tensor
    ranks (the embedding is the same on each; with sequence parallelism each holds other
    tokens: a mask per rank). `key` is the first stage's layer key; the layers fold in
    their indices, this folds in one no stack reaches."""
    if not cfg.dropout or deterministic:
        return x
    key = jax.random.fold_in(key, EMBED_STREAM)
    if layout.split_sequence:
        key = jax.random.fold_in(key, lax.axis_index(layout.tensor_axis))
    return dropout(x, cfg.dropout, key)


EMBED_STREAM = 2**31 - 1


def vocab_start(layout: Layout):
    """First vocabulary id of this tensor rank's [V/t] logits."""
    local = layout.vocab // layout.tensor
    return 0 if layout.tensor_axis is None else lax.axis_index(layout.tensor_axis) * local


def vocab_parallel_xent(logits, targets, cfg: ModelConfig, layout: Layout,
                        classes: int | None = None):
    """Cross-entropy of vocab-parallel logits [b, s, V/t] float32 at targets [b, s] -> [b, s].

    The logits stay on their tensor rank: only [b, s] maxima, sums of exponentials and
    target logits cross the tensor axis. Padded vocabulary rows, and any id from `classes`
    on (default: model.vocab_size), never take probability.
    """
    ids = vocab_start(layout) + jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < (classes or cfg.vocab_size), logits, -jnp.inf)
    # The max only stabilises the exponentials; its gradient cancels, so it is stopped.
    row_max = lax.stop_gradient(jnp.max(logits, axis=-1))  # [b, s]
    if layout.tensor_axis is not None:
        row_max = lax.pmax(row_max, layout.tensor_axis)
    sum_exp = psum(jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1), layout.tensor_axis)
    target_logit = psum(
        jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1), layout.tensor_axis)
    return jnp.log(sum_exp) + row_max - target_logit
