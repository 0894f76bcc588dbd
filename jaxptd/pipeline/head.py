"""The head and loss spread over the pipe ranks, in the round forms without conditionals.

Owns `SpreadHead`. In lockstep rounds every rank waits for the last stage's B slot, and
that slot runs the head: the logits and the cross-entropy over the whole vocabulary
(GPT-1.3B: 2 h V = 206 MFLOP a token forward against a layer's 24 h^2 + 4 s h = 117 M, the
work of 1.8 layers more than the other stages' slots). The steady and masked forms run it
on every rank anyway (inline: computed, then selected), so instead each rank computes it
for 1/p of the last stage's rows:

The head's rank (Context.head_rank, "the last rank" below) is p - 1, or 0 for a V-shaped
schedule, whose last stage is on rank 0.

- the rows: the last rank's stage output y [b, s, h] goes out by an all-to-all over pipe
  (rank r gets rows r b/p .. (r + 1) b/p, or with fewer rows than ranks pieces of rows; with sequence parallelism y, a block of the
  b s tokens on each tensor rank, is first gathered over tensor into rows and the rows'
  tokens split over tensor again: one all-gather over tensor more a slot); the
  gradient of each rank's rows comes back by the all-to-all's transpose, inside the B
  slot's vjp;
- the weights: the ends leaves the head reads (models.ends_readers: 'last', 'both') are
  held in the last rank's slot (jaxptd/train/state.py); they are broadcast over pipe once a step
  (a psum of that slot, the others masked to zeros; each rank keeps the matrices in the
  compute dtype, as the head multiplies them) and typed varying over pipe, so that
  a slot's vjp gives this rank's partial gradient (of an invariant input it would give
  the sum over pipe: a psum a slot); summed over the rounds here, the partial gradients
  go back through the broadcast's transpose once after the last round (summed over pipe,
  into the last rank's slot), where the step's tied-embedding exchange and reduction find
  them as before.

Every rank's part of the loss is its own (the step sums the loss over pipe). It applies
where `scans.head_pieces` says: a round form without conditionals, and b divisible by
p, or (a token-wise head) each row cut into k pieces of s/k tokens, b k divisible by p.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from jaxptd import model as models
from jaxptd.parallel.mesh import PIPE
from jaxptd.model.tensor import enter_tensor, token_block
from jaxptd.pipeline.stage import Stage
from jaxptd.parallel.varying import mark_varying


class SpreadHead:
    """The head's weights on every pipe rank for one step, and its per-slot work."""

    def __init__(self, stage: Stage, ends):
        """stage: this rank's Stage; ends: its ends slots (leaves [1, ...], FSDP shards)."""
        self.stage, self.p = stage, stage.context.pipe
        readers = models.ends_readers(stage.model, stage.layout.vocab)
        self.paths = frozenset(path for path, reader in readers.items() if reader != "first")
        # weights: the whole ends tree as the head reads it, its leaves broadcast from the
        # last rank (the embedding-only leaves: this rank's own, which the head never reads);
        # its matrices already in the compute dtype, to which the head casts them where it
        # multiplies (tensor.dense, Embed.logits): the same products in half the bytes with
        # bf16, their gradients summed in float32 (the broadcast's, `_back`'s, dtype)
        broadcast, self._back = jax.vjp(self._broadcast, ends)
        dtype = jnp.dtype(stage.model.dtype)
        self.weights = traverse_util.unflatten_dict({
            path: x.astype(dtype) if path in self.paths and x.ndim >= 2 else x
            for path, x in traverse_util.flatten_dict(broadcast).items()})

    def _broadcast(self, ends):
        whole = traverse_util.flatten_dict(self.stage.gather_ends(ends))
        on_last = self.stage.rank == self.stage.context.head_rank
        return traverse_util.unflatten_dict({
            path: mark_varying(lax.psum(jnp.where(on_last, x, 0), PIPE), (PIPE,))
            if path in self.paths else x for path, x in whole.items()})

    def zeros(self):
        """The per-rank float32 gradient sums of the broadcast weights (the leaves the head
        reads)."""
        flat = traverse_util.flatten_dict(self.weights)
        return {path: jnp.zeros_like(flat[path], jnp.float32) for path in sorted(self.paths)}

    def add(self, sums, g_weights):
        """sums += this slot's gradient of the broadcast weights."""
        flat = traverse_util.flatten_dict(g_weights)
        return {path: total + flat[path].astype(total.dtype) for path, total in sums.items()}

    def loss(self, weights, y, mb, on):
        """This rank's part of the last stage's loss (its token sum times Stage.norm, 0
        where `on` is not set): the head on its 1/p of the rows of y [b, s, h], the last
        rank's stage output of microbatch mb (the tables' head_mb, head_on; y on the
        other ranks is sent and unused)."""
        layout = self.stage.layout
        # sequence parallelism: a tensor rank's [b, s/t, h] is a block of the b s tokens,
        # not of the rows; gathered (tensor.enter_tensor) into rows, split by rows, and
        # the rows' tokens split over tensor again (tensor.token_block)
        y, tokens = _pieces(enter_tensor(y, layout), self.stage.tokens(mb),
                            self.stage.context.head_pieces)
        rows = y.shape[0] // self.p
        # [p, b k/p, s/k, h]: from rank j, j's pieces for this rank; the head rank's are
        # the ones (p - 1, or 0 V-shaped)
        mine = token_block(lax.all_to_all(y.reshape(self.p, rows, *y.shape[1:]), PIPE, 0,
                                          0)[self.stage.context.head_rank], layout)
        tokens = lax.dynamic_slice_in_dim(tokens, self.stage.rank * rows, rows)
        # Layout.apart: the weights' gradients come out of their GEMMs in float32 and
        # `add`'s sums are the GEMMs' epilogue (in bf16, the add was a kernel of its own
        # every round, reading and writing the float32 [V, h] sums; with chunks it once
        # left a steady send with no GEMM in flight, which tests/test_h100.py's interleaved
        # steady-send case checks). zb-v's too, now that its two-round scans run the head
        # in one of their rounds only (it had added both rounds' bf16 gradients in a pass)
        layout = dataclasses.replace(layout, apart=True)
        loss = self.stage.context.arch.head_loss(weights, mine, tokens, self.stage.model,
                                                 layout)
        return jnp.where(on > 0, loss * self.stage.norm, 0.0)

    def grads(self, sums):
        """This rank's gradient sums -> the ends slots' gradients (leaves [1, ...]):
        summed over pipe into the last rank's slot, zeros elsewhere (FSDP: scattered to
        the shards)."""
        flat = traverse_util.flatten_dict(self.weights)
        cotangent = {path: sums.get(path, jnp.zeros_like(x)) for path, x in flat.items()}
        return self._back(traverse_util.unflatten_dict(cotangent))[0]


def _pieces(y, tokens, k: int):
    """y [b, s, h] and its rows' tokens [b, s + 1] cut into k pieces a row: [b k, s/k, h]
    and [b k, s/k + 1] (a piece's inputs and its targets, the next piece's first token)."""
    if k == 1:
        return y, tokens
    b, s = y.shape[:2]
    piece = s // k
    window = jnp.arange(k)[:, None] * piece + jnp.arange(piece + 1)[None, :]  # [k, s/k + 1]
    return (y.reshape(b * k, piece, *y.shape[2:]),
            tokens[:, window].reshape(b * k, piece + 1))
