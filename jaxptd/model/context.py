"""Attention over a sequence split across the context ranks (context parallelism), and the
masked attention of packed rows.

Each context rank holds its queries, keys and values for its n = s / c tokens
(sequence.local_index: chunks r and 2c-1-r) and attends to every rank's keys by one of two
methods (parallel.context_attention):

- ring: c steps; at each a rank attends to the key/value block it holds, its own first,
  and passes the block to the next rank with `ppermute` (c - 1 sends), so the send of
  step j + 1's block runs beside step j's scores (an optimization barrier ties the
  received block to them). Blocks are combined with the online softmax (each block's
  normalized float32 output and log-sum-exp, rescaled to the running one). Under the
  causal mask only the visible part of a block is computed: of the own block three
  quarters (`_own_half`: chunk r never sees chunk 2c-1-r), of another rank's one half
  (`_visible_half`): a rank computes 3 n^2 / 4 + (c-1) n^2 / 2 = n s / 2 + n^2 / 4 score
  entries, of which n s / 2 + n / 2 are visible, the same on every rank.
  The ring has its own backward (jax.custom_vjp, flash attention's): the forward keeps
  only q, k, v, the output O (in q's dtype: it is the output itself, as flash attention
  keeps it) and the final log-sum-exp L [b, n, heads]; no per-block tensor. The backward
  takes D = rowsum(dO O) [b, n, heads] and goes round the ring again, each block's part
  computed from the global L and D (`_block_bwd`: P = exp(S - L), dV = P^T dO,
  dS = P (dO V^T - D), dQ = dS K, dK = dS^T Q; the same visible parts): dQ adds to the
  rank's own, dK and dV to the block's running gradients, which follow the block round
  the ring and come home after it (`_ring_bwd`). Sends a layer: c - 1 forward; c - 1 of
  key/value blocks and c - 1 of their float32 gradients [2, b, n, kv, d] backward (under
  full recomputation the recomputed forward's c - 1 too, of which XLA merges some with
  the backward's key/value sends), each beside a block: the own block's first query half
  runs beside the first send, its second beside the last, the gradients' way home.
  Memory: q, k, v, O, L a layer, and one block part's [b, heads, n/2, n] scores (with
  their probabilities and gradients) at a time.
- allgather: the keys and values of all ranks gathered (Llama 3's choice; with grouped-query
  attention they are small: 2 s k d against the queries' s n d), one masked attention of the
  local queries over all s keys; the gather's transpose reduce-scatters their gradients.
  On a GPU with model.attention=cudnn this is one cuDNN flash attention with a mask.

The ring's blocks (`_Ring.part_fwd`, `part_bwd`) are XLA's (`_block_fwd`, `_block_bwd`:
a part's float32 scores in memory), or with model.kernels=pallas JAX's Pallas flash
attention (pallas_kernels/flash.py: no scores in memory) where the rows have no segments
and no padding: then every block part is entirely visible or, the own keys, causal, which
is all the kernel's masks. The mask of every XLA block comes from the tokens' positions
and segments (sequence.blocked), so load balancing and packed documents need nothing more
here.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.model.sequence import Rows, blocked, local_index
from jaxptd.model.tensor import Layout

_NEG = -1e30  # a masked score: finite, so a row with no visible key gives zeros, not NaNs


def attention(q, k, v, rows: Rows, layout: Layout, *, causal: bool, scale: float,
              cudnn: bool, flash: bool, core):
    """Attention of this rank's queries q [b, n, heads, d] over every context rank's keys
    and values k, v [b, n, kv_heads, d] -> [b, n, heads, d] in q's dtype. rows: the whole
    rows' positions (and segments, padding); core(q, k, v, mask) is the layer's masked
    attention core (layers.attention_core), used when the whole mask is in hand; flash:
    the ring's blocks are Pallas flash attention (model.kernels=pallas) where no segment
    or padding masks them."""
    seq, c, axis = rows.positions.shape[1], layout.context, layout.context_axis
    mine = rows.take(local_index(seq, layout))
    if axis is None or c == 1:
        return _masked(q, k, v, blocked(mine, mine, causal), scale, cudnn, core)
    if layout.context_attention == "allgather":
        gather = functools.partial(lax.all_gather, axis_name=axis, axis=1, tiled=True)
        k_all, v_all = gather(k), gather(v)  # [b, s, kv_heads, d], in rank order
        order = jnp.concatenate([local_index(seq, layout, r) for r in range(c)])
        return _masked(q, k_all, v_all, blocked(mine, rows.take(order), causal), scale,
                       cudnn, core)
    plain = rows.segments is None and rows.padding is None
    return _ring(_Ring(layout, causal, scale, flash and plain), q, k, v, rows)


def _masked(q, k, v, mask, scale, cudnn: bool, core):
    """One attention of q over k, v with mask [b, 1, nq, nk] (True = masked)."""
    if cudnn:
        return jax.nn.dot_product_attention(q, k, v, mask=~mask, scale=scale,
                                            implementation="cudnn")
    return core(q, k, v, mask)


class _Ring(NamedTuple):
    """The ring's static arguments (hashable: custom_vjp's nondiff argument)."""
    layout: Layout
    causal: bool
    scale: float
    flash: bool  # blocks by pallas_kernels.flash, else XLA's (`_block_fwd`, `_block_bwd`)

    def part_fwd(self, q, k, v, mask, diagonal: bool):
        """(out, lse) of queries q [b, m, heads, d] over a part of a block, k, v
        [b, m or 2m, kv_heads, d]. XLA's block takes the mask; the flash blocks take the
        keys in query-sized pieces, each entirely visible but, when `diagonal` (under the
        causal mask, the queries' own keys come last), the last, causal (module
        docstring: no other mask reaches them)."""
        if not self.flash:
            return _block_fwd(q, k, v, mask, self.scale)
        from pallas_kernels.flash import flash_block
        parts = [flash_block(q, kp, vp, scale=self.scale, causal=causal,
                             interpret=self.layout.platform != "gpu")
                 for kp, vp, causal in self._pieces(q, k, v, diagonal)]
        return functools.reduce(lambda a, b: _merge(*a, *b), parts)

    def part_bwd(self, q, k, v, mask, diagonal: bool, lse, out, d_out):
        """`part_fwd`'s gradients (dq [b, m, heads, d], dk, dv [b, m or 2m, kv_heads, d])
        float32 from the whole attention's log-sum-exp, output and its cotangent."""
        if not self.flash:
            return _block_bwd(q, k, v, mask, self.scale, lse, out, d_out)
        from pallas_kernels.flash import flash_block_grads
        grads = [flash_block_grads(q, kp, vp, out, lse, d_out, scale=self.scale,
                                   causal=causal, interpret=self.layout.platform != "gpu")
                 for kp, vp, causal in self._pieces(q, k, v, diagonal)]
        return (sum(g[0] for g in grads), jnp.concatenate([g[1] for g in grads], axis=1),
                jnp.concatenate([g[2] for g in grads], axis=1))

    def _pieces(self, q, k, v, diagonal: bool):
        """(k, v, causal) of each query-sized piece of the keys."""
        m, count = q.shape[1], k.shape[1] // q.shape[1]
        return [(k[:, i * m:(i + 1) * m], v[:, i * m:(i + 1) * m],
                 self.causal and diagonal and i == count - 1) for i in range(count)]

    def send(self, block):
        """Each rank's block to the next rank (`_pass_on`)."""
        layout = self.layout
        return _pass_on(block, axis=layout.context_axis, size=layout.context,
                        cpu=layout.platform == "cpu")

    def blocks(self, rows: Rows):
        """mask(step) -> (later, [b, 1, n, n] bool) for the block a rank holds at `step`,
        of origin (rank - step) mod c, read off the whole rows; later: whether that origin
        is below the rank (which quarters `_visible_half` takes)."""
        layout, seq = self.layout, rows.positions.shape[1]
        rank = lax.axis_index(layout.context_axis)
        mine = rows.take(local_index(seq, layout))

        def mask(step):
            origin = (rank - step) % layout.context
            theirs = rows.take(local_index(seq, layout, origin))
            return origin < rank, blocked(mine, theirs, self.causal)
        return mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, rows: Rows):
    """The ring: q [b, n, heads, d], k, v [b, n, kv_heads, d] -> [b, n, heads, d] in q's
    dtype; differentiable in q, k, v (rows: integers, no cotangent)."""
    return _ring_fwd(ring, q, k, v, rows)[0]


def _ring_fwd(ring: _Ring, q, k, v, rows: Rows):
    """c steps, the own block first (as its two query halves), one ppermute a step but the
    last of the key/value block stacked [2, b, n, kv, d]; the residuals: q, k, v, rows,
    the output and its log-sum-exp [b, n, heads]."""
    size, mask_at = ring.layout.context, ring.blocks(rows)
    out, lse = None, None
    block = jnp.stack([k, v])
    for step in range(size):
        kv = block
        if step + 1 < size:  # the next block's send, independent of this block's scores
            block = ring.send(block)
        later, mask = mask_at(step)  # the block of origin (rank - step) mod c
        if step == 0:  # its own: each query half
            halves = [ring.part_fwd(*_own_half(q, kv, mask, ring.causal, i), diagonal=True)
                      for i in (0, 1)]
            o_j, lse_j = (jnp.concatenate(x, axis=1) for x in zip(*halves))
        elif ring.causal:
            o_j, lse_j = _visible_half(ring, q, kv, mask, later)
        else:
            o_j, lse_j = ring.part_fwd(q, kv[0], kv[1], mask, diagonal=False)
        if step + 1 < size:
            # The next block is read only after this block's scores: without the barrier
            # XLA's GPU scheduler starts the send after them and finishes it beside a few
            # small ops (Llama-3-8B at 32k, context 2: the forward's and recomputation's
            # sends overlapped no GEMM, 64 of 96); with it each send runs beside a block.
            block, o_j, lse_j = lax.optimization_barrier((block, o_j, lse_j))
        out, lse = (o_j, lse_j) if step == 0 else _merge(out, lse, o_j, lse_j)
    out = out.astype(q.dtype)
    return out, (q, k, v, rows, out, lse)


def _ring_bwd(ring: _Ring, residuals, d_out):
    """Round the ring again (module docstring): the own block's first query half; at step
    j = 1 .. c-1 the block of origin (rank - j) mod c, received from the previous rank as
    in the forward (c - 1 sends), whose float32 gradients [2, b, n, kv, d] from the ranks
    before arrive from the previous rank during it and leave with its part added (c - 1
    sends: the last brings them home); the own block's second query half last, beside that
    send. Each send's result is read only after a block (optimization barriers), so XLA's
    GPU scheduler runs every send beside one."""
    q, k, v, rows, out, lse = residuals
    size, mask_at = ring.layout.context, ring.blocks(rows)
    per_row = (lse, out, d_out)  # what the backward needs of the queries' rows
    own, own_mask = jnp.stack([k, v]), mask_at(0)[1]
    block = ring.send(own)
    dq_first, own_grads = _own_half_bwd(q, own, own_mask, ring, 0, *per_row)
    block, dq_first, own_grads = lax.optimization_barrier((block, dq_first, own_grads))
    dq, grads = None, None  # grads: the held block's dk, dv from the ranks before it
    for step in range(1, size):
        kv = block
        if step + 1 < size:
            block = ring.send(block)
        later, mask = mask_at(step)
        if ring.causal:
            dq_j, dk_j, dv_j = _visible_half_bwd(ring, q, kv, mask, later, *per_row)
        else:
            dq_j, dk_j, dv_j = ring.part_bwd(q, kv[0], kv[1], mask, False, *per_row)
        dkv_j = jnp.stack([dk_j, dv_j])
        tied = (block if step + 1 < size else None, grads)
        if tied != (None, None):
            tied, dq_j, dkv_j = lax.optimization_barrier((tied, dq_j, dkv_j))
            block, grads = tied
        dq = dq_j if dq is None else dq + dq_j
        grads = dkv_j if grads is None else grads + dkv_j
        if step + 1 == size:  # the own block's second half comes after this block
            own, grads = lax.optimization_barrier((own, grads))
        grads = ring.send(grads)
    dq_second, own_second = _own_half_bwd(q, own, own_mask, ring, 1, *per_row)
    grads, dq_second, own_second = lax.optimization_barrier((grads, dq_second, own_second))
    dq = dq + jnp.concatenate([dq_first, dq_second], axis=1)
    grads = grads + own_grads + own_second
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _half(x, later, axis: int):
    """x's first half along `axis` if `later`, else its second (a select, no conditional)."""
    first, second = jnp.split(x, 2, axis=axis)
    return jnp.where(later, first, second)


def _own_half(q, kv, mask, causal: bool, second: int):
    """(q, k, v, mask) of one query half of a rank's own block: the second (chunk 2c-1-r)
    over the whole block; the first (chunk r) under the causal mask over the first key
    half only (chunk 2c-1-r comes after chunk r), else over the whole block. Under the
    causal mask 3/4 of the block's scores, in two parts: a [n/2, n/2] and a [n/2, n]."""
    half = q.shape[1] // 2
    rows = slice(half, None) if second else slice(None, half)
    keys = slice(None, half) if causal and not second else slice(None)
    return q[:, rows], kv[0][:, keys], kv[1][:, keys], mask[:, :, rows, keys]


def _own_half_bwd(q, kv, mask, ring: _Ring, second: int, lse, out, d_out):
    """`_own_half` in the backward: (dq of the half's queries [b, n/2, heads, d], the
    block's dk, dv [2, b, n, kv_heads, d]) float32."""
    half = q.shape[1] // 2
    rows = slice(half, None) if second else slice(None, half)
    dq, dk, dv = ring.part_bwd(*_own_half(q, kv, mask, ring.causal, second), True,
                               lse[:, rows], out[:, rows], d_out[:, rows])
    missing = kv.shape[2] - dk.shape[1]  # the first half's k2 under the causal mask
    dkv = jnp.pad(jnp.stack([dk, dv]), [(0, 0), (0, 0), (0, missing), (0, 0), (0, 0)])
    return dq, dkv


def _visible_half(ring: _Ring, q, kv, mask, later):
    """A causal ring step's block from another rank: of its [n, n] scores only half can be
    visible, and only that half is computed, as two [n/2, n/2] quarters. Rank r holds
    chunks (r, 2c-1-r) as halves (q1, q2) and the block from rank o its (k1, k2): for
    o < r (`later`) q1 and q2 see k1 and neither sees k2; for o > r only q2 sees, k1 and k2.
    (q2, k1) is computed either way and the other quarter is picked by selects, not a
    conditional (which would stop the next block's send from overlapping it). The mask
    still applies (packed rows)."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    other = ring.part_fwd(_half(q, later, 1), _half(k, later, 1), _half(v, later, 1),
                          _half(_half(mask, later, 2), later, 3), diagonal=False)
    shared = ring.part_fwd(q[:, half:], k[:, :half], v[:, :half], mask[:, :, half:, :half],
                           diagonal=False)
    unseen = jnp.full_like(other[1], -jnp.inf)
    first = (other[0], jnp.where(later, other[1], unseen))  # q1: the other quarter if o < r
    second = _merge(*shared, other[0], jnp.where(later, unseen, other[1]))
    return (jnp.concatenate([first[0], second[0]], axis=1),
            jnp.concatenate([first[1], second[1]], axis=1))


def _visible_half_bwd(ring: _Ring, q, kv, mask, later, lse, out, d_out):
    """`_visible_half`'s quarters in the backward: (dq [b, n, heads, d], dk, dv
    [b, n, kv_heads, d]) float32 of the block, zero where a quarter is not computed. The
    other quarter, (q1, k1) if `later` else (q2, k2), and (q2, k1), picked by selects."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    dq_o, dk_o, dv_o = ring.part_bwd(
        _half(q, later, 1), _half(k, later, 1), _half(v, later, 1),
        _half(_half(mask, later, 2), later, 3), False, _half(lse, later, 1),
        _half(out, later, 1), _half(d_out, later, 1))
    dq_s, dk_s, dv_s = ring.part_bwd(q[:, half:], k[:, :half], v[:, :half],
                                     mask[:, :, half:, :half], False, lse[:, half:],
                                     out[:, half:], d_out[:, half:])

    def place(shared, other, into_first):
        """[b, n, ...]: the shared quarter's gradient at half `into_first` (0: the first
        half, 1: the second), the other quarter's at the first half if later, else the
        second."""
        none = jnp.zeros_like(other)
        halves = [jnp.where(later, other, none), jnp.where(later, none, other)]
        halves[into_first] = halves[into_first] + shared
        return jnp.concatenate(halves, axis=1)
    return place(dq_s, dq_o, 1), place(dk_s, dk_o, 0), place(dv_s, dv_o, 0)


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, (weighted values
    [b, n, heads, d] float32, log-sum-exp [b, n, heads]) -> the attention over both."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)  # no key in either: zeros
    return (out_a * jnp.exp(lse_a - safe)[..., None]
            + out_b * jnp.exp(lse_b - safe)[..., None]), lse


def _pass_on(block, *, axis: str, size: int, cpu: bool):
    """Rank r's block to rank r + 1 (mod size): a collective-permute, or on XLA:CPU an
    all-gather and a slice. XLA:CPU's collective-permutes inside a pipelined step mix up
    their data (pipe 2, context 2: the loss changed from run to run, 5.6978 and 5.6981
    against 5.7151), its all-gathers do not; the GPU program keeps the permute (the H100
    check counts it)."""
    if not cpu:
        return lax.ppermute(block, axis, [(i, (i + 1) % size) for i in range(size)])
    source = (lax.axis_index(axis) - 1) % size
    return lax.dynamic_index_in_dim(lax.all_gather(block, axis), source, 0, keepdims=False)


def _grouped(x, kv_heads: int):
    """[b, n, heads, ...] -> [b, n, kv_heads, heads / kv_heads, ...]: a key/value head's
    group of query heads (grouped-query attention)."""
    b, n, heads = x.shape[:3]
    return x.reshape(b, n, kv_heads, heads // kv_heads, *x.shape[3:])


def _block_fwd(q, k, v, mask, scale):
    """q [b, nq, heads, d] over one key block k, v [b, nk, kv_heads, d] with mask
    [b, 1, nq, nk] (True = masked) -> (softmax-weighted values [b, nq, heads, d] float32,
    log-sum-exp [b, nq, heads]); a query with no visible key there gets zeros and -inf."""
    b, n, heads, d = q.shape
    scores = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(q, k.shape[2]), k,
                        preferred_element_type=jnp.float32) * scale
    hidden = mask[:, :, None]  # [b, 1, 1, nq, nk]
    scores = jnp.where(hidden, _NEG, scores)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(hidden, 0.0, jnp.exp(scores - row_max))
    total = jnp.sum(probs, axis=-1)  # [b, kv, g, nq]
    seen = total > 0
    values = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
    norm = jnp.where(seen, total, 1.0)
    values = values / jnp.moveaxis(norm, -1, 1)[..., None]
    lse = jnp.where(seen, row_max[..., 0] + jnp.log(norm), -jnp.inf)
    return (values.reshape(b, n, heads, d),
            jnp.moveaxis(lse, -1, 1).reshape(b, n, heads))


def _block_bwd(q, k, v, mask, scale, lse, out, d_out):
    """The gradients (dq [b, nq, heads, d], dk, dv [b, nk, kv_heads, d]) float32 of one key
    block's part of the attention, from the whole attention's log-sum-exp [b, nq, heads],
    output and its cotangent d_out [b, nq, heads, d] (flash attention's backward):
    D = rowsum(dO O); P = exp(S - L), 0 where masked (and in a row with no visible key,
    L = -inf); dV = P^T dO; dS = P (dO V^T - D); dQ = scale dS K; dK = scale dS^T Q,
    summed over each key/value head's group of query heads."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    b, n, heads, d = q.shape
    kv_heads = k.shape[2]
    grouped, d_grouped = _grouped(q, kv_heads), _grouped(d_out, kv_heads)

    def per_row(x):  # [b, nq, heads] -> [b, kv, g, nq, 1], the scores' rows
        return jnp.moveaxis(_grouped(x, kv_heads), 1, -1)[..., None]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k,
                        preferred_element_type=jnp.float32) * scale
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    probs = jnp.where(mask[:, :, None], 0.0, jnp.exp(scores - per_row(safe)))
    dv = jnp.einsum("bkgqs,bqkgd->bskd", probs.astype(d_out.dtype), d_grouped,
                    preferred_element_type=jnp.float32)
    d_probs = jnp.einsum("bqkgd,bskd->bkgqs", d_grouped, v,
                         preferred_element_type=jnp.float32)
    d_scores = (probs * (d_probs - per_row(delta))).astype(q.dtype)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", d_scores, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", d_scores, grouped,
                    preferred_element_type=jnp.float32)
    return dq.reshape(b, n, heads, d) * scale, dk * scale, dv
