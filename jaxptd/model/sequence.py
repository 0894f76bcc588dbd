"""Which tokens of a row this rank holds, and what each may attend to: context
parallelism's split of the sequence and packed documents.

Context parallelism (layout.context = c > 1) splits every activation's sequence over the
context ranks. A row's s tokens are cut into 2c chunks of s / 2c and rank r holds chunks r
and 2c-1-r, in that order (`local_index`): under a causal mask chunk i attends to i + 1
chunks, so every rank's pair attends to 2c + 1 chunks in all and the ranks do the same work
(contiguous quarters would give rank c-1 2c - 1 times rank 0's). The batch rows stay whole
on every context rank (int32 tokens, [b, s + 1]: kilobytes): each rank reads its tokens,
targets and positions from them, so nothing outside the model moves.

Packed rows (model.document_end = the id that ends a document, >= 0) hold several
documents one after another. A token's segment is the number of document ends before it in
the row and its position restarts at each document's first token; attention never crosses
a segment, and the target after a document end (the next document's first token) takes no
loss (Megatron's reset_attention_mask, reset_position_ids and eod_mask_loss); the loss is
the mean over the targets that do (`counted_targets`), as Megatron's and transformers' is.

`Rows` carries this per token to the layers (with BERT's padding under context
parallelism); it is None when neither applies, so the layers keep their plain causal (or
padding-masked) path and its kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model.tensor import Layout
from jaxptd.parallel.varying import mark_varying


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Rows:
    """What attention needs of the batch rows, for every token of each row (every context
    rank has the whole rows: it reads any rank's tokens' values with `take`, so only keys
    and values cross the context axis)."""
    positions: jax.Array  # [b, s] int32: each token's position (in its document, packed)
    segments: jax.Array | None = None  # [b, s] int32: its document in the row (packed)
    padding: jax.Array | None = None  # [b, s] bool: True = a key no query sees (BERT)

    def take(self, index) -> "Rows":
        """The values of the tokens at row positions `index` [n]: [b, n] each."""
        return jax.tree.map(lambda a: jnp.take(a, index, axis=1), self)


def local_index(seq: int, layout: Layout, rank=None):
    """[s / c] int32: the row positions of context rank `rank`'s tokens (default: this
    rank's), chunks r and 2c-1-r of the row's 2c (all of 0..s-1 without context
    parallelism)."""
    c = layout.context
    if c == 1 or layout.context_axis is None:
        return jnp.arange(seq, dtype=jnp.int32)
    size = seq // (2 * c)
    rank = lax.axis_index(layout.context_axis) if rank is None else rank
    first = rank * size + jnp.arange(size, dtype=jnp.int32)
    second = (2 * c - 1 - rank) * size + jnp.arange(size, dtype=jnp.int32)
    return jnp.concatenate([first, second])


def local_positions(rows: Rows, layout: Layout):
    """[b, s / c]: the positions of this rank's tokens."""
    return rows.take(local_index(rows.positions.shape[1], layout)).positions


def split(rows, layout: Layout):
    """This context rank's tokens of per-token values [b, s, ...] -> [b, s / c, ...]."""
    if layout.context == 1 or layout.context_axis is None:
        return rows
    return jnp.take(rows, local_index(rows.shape[1], layout), axis=1)


def vary(x, layout: Layout):
    """x typed as varying over the context axis (the first stage's embedding), as every
    activation of a context rank is, even with one rank: the pipeline's buffers are."""
    if layout.context_axis is None:
        return x
    return mark_varying(x, (layout.context_axis,))


def packed(cfg: ModelConfig) -> bool:
    return cfg.document_end >= 0


def needs_rows(cfg: ModelConfig, layout: Layout) -> bool:
    """Whether attention needs `Rows` (else its plain causal or padding path)."""
    return packed(cfg) or (layout.context > 1 and layout.context_axis is not None)


def rows_of(inputs, cfg: ModelConfig, layout: Layout, padding=None) -> Rows | None:
    """inputs [b, s] int32 (a row's input tokens, all of them) -> their `Rows`, or None
    when attention needs none (needs_rows). padding: [b, s] True at keys to ignore (BERT's;
    without `Rows` its mask goes to attention as it is)."""
    if not needs_rows(cfg, layout):
        return None
    b, s = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segments = None
    if packed(cfg):
        ends = (inputs == cfg.document_end).astype(jnp.int32)
        # a document starts at 0 and after every end: its start index carried forward
        starts = jnp.concatenate([jnp.ones((b, 1), jnp.int32), ends[:, :-1]], axis=1)
        first = lax.cummax(jnp.where(starts > 0, positions, 0), axis=1)
        segments = jnp.cumsum(starts, axis=1) - 1
        positions = positions - first
    return Rows(positions, segments, padding)


def _counted(inputs, cfg: ModelConfig):
    """inputs [b, s] -> [b, s] bool: which targets take loss, the one after a document
    end not (packed rows only)."""
    return inputs != cfg.document_end


def loss_mask(inputs, cfg: ModelConfig, layout: Layout):
    """[b, s / c] bool: which of this rank's targets count (packed: not the one after a
    document end), or None: all."""
    if not packed(cfg):
        return None
    return split(_counted(inputs, cfg), layout)


def counted_targets(batch, cfg: ModelConfig):
    """batch [b, s + 1] int32 (packed rows, whole: every context rank's tokens) -> int32
    []: how many of its b s targets take loss (`loss_mask`'s over all ranks). The loss
    is a mean over these, Megatron's (eod_mask_loss: the loss mask's sum) and
    transformers' (the labels not -100); unpacked, all b s count."""
    assert packed(cfg)
    return jnp.sum(_counted(batch[:, :-1], cfg), dtype=jnp.int32)


def blocked(q_rows: Rows, k_rows: Rows, causal: bool):
    """[b, 1, nq, nk] bool, True = query q may not see key k: a later position (causal),
    another document, or a padded key. Positions order keys only within a document."""
    qp, kp = q_rows.positions, k_rows.positions
    mask = jnp.zeros((qp.shape[0], qp.shape[1], kp.shape[1]), bool)
    if causal:
        mask = kp[:, None, :] > qp[:, :, None]
    if q_rows.segments is not None:
        mask = mask | (k_rows.segments[:, None, :] != q_rows.segments[:, :, None])
    if k_rows.padding is not None:
        mask = mask | k_rows.padding[:, None, :]
    return mask[:, None]
