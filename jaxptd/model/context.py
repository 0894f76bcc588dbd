"""Attention over a sequence split across the context ranks (context parallelism), and the
masked attention of packed rows.

Each context rank holds its queries, keys and values for its n = s / c tokens
(sequence.local_index: chunks r and 2c-1-r) and attends to every rank's keys by one of two
methods (parallel.context_attention):

- ring: c steps; at each a rank attends to the key/value block it holds and passes the
  block (with its tokens' positions and segments) to the next rank with `ppermute`, so the
  send of step j + 1's block runs beside step j's scores (an optimization barrier ties
  the received block to them). Blocks are combined with the
  online softmax (each block's output and log-sum-exp, rescaled to the running maximum);
  each block's scores are recomputed in the backward (jax.checkpoint), whose
  ppermutes, the transposes of the forward's, pass the key/value gradients back round the
  ring. Under the causal mask a block from another rank is half visible (`_visible_half`)
  and only that half is computed: a rank's score entries are n^2 + (c-1) n^2 / 2 against
  the n s / 2 + n^2 / 2 a causal mask leaves (n = s / c), the same on every rank. Memory:
  the c blocks the backward reads, no [n, s] scores.
- allgather: the keys and values of all ranks gathered (Llama 3's choice; with grouped-query
  attention they are small: 2 s k d against the queries' s n d), one masked attention of the
  local queries over all s keys; the gather's transpose reduce-scatters their gradients.
  On a GPU with model.attention=cudnn this is one cuDNN flash attention with a mask.

The ring computes its blocks with XLA on every platform: cuDNN's public attention drops the
cotangent of the log-sum-exp it returns, and the ring's combination differentiates through
it. The mask of every block comes from the tokens' positions and segments
(sequence.blocked), so load balancing and packed documents need nothing more here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.model.sequence import Rows, blocked, local_index
from jaxptd.model.tensor import Layout

_NEG = -1e30  # a masked score: finite, so a row with no visible key gives zeros, not NaNs


def attention(q, k, v, rows: Rows, layout: Layout, *, causal: bool, scale: float,
              cudnn: bool, core):
    """Attention of this rank's queries q [b, n, heads, d] over every context rank's keys
    and values k, v [b, n, kv_heads, d] -> [b, n, heads, d] in q's dtype. rows: the whole
    rows' positions (and segments, padding); core(q, k, v, mask) is the layer's masked
    attention core (layers.attention_core), used when the whole mask is in hand."""
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
    return _ring(q, k, v, rows, mine, layout, causal=causal, scale=scale)


def _masked(q, k, v, mask, scale, cudnn: bool, core):
    """One attention of q over k, v with mask [b, 1, nq, nk] (True = masked)."""
    if cudnn:
        return jax.nn.dot_product_attention(q, k, v, mask=~mask, scale=scale,
                                            implementation="cudnn")
    return core(q, k, v, mask)


def _ring(q, k, v, rows: Rows, mine: Rows, layout: Layout, *, causal, scale):
    """The ring: one ppermute a step of the key/value block stacked [2, b, n, kv, d]; the
    block's tokens are read off the whole rows by the rank it came from."""
    size, axis = layout.context, layout.context_axis
    send = functools.partial(_pass_on, axis=axis, size=size, cpu=layout.platform == "cpu")
    b, n, heads, d = q.shape
    rank, seq = lax.axis_index(axis), rows.positions.shape[1]
    out = jnp.zeros((b, n, heads, d), jnp.float32)
    lse = jnp.full((b, n, heads), -jnp.inf, jnp.float32)
    block = jnp.stack([k, v])
    for step in range(size):
        kv = block
        if step + 1 < size:  # the next block's send, independent of this block's scores
            block = send(block)
        origin = (rank - step) % size
        mask = blocked(mine, rows.take(local_index(seq, layout, origin)), causal)
        if causal and step > 0:
            o_j, lse_j = _visible_half(q, kv, mask, scale, later=origin < rank)
        else:
            o_j, lse_j = _block(q, kv[0], kv[1], mask, scale)
        if step + 1 < size:
            # The next block is read only after this block's scores: without the barrier
            # XLA's GPU scheduler starts the send after them and finishes it beside a few
            # small ops (Llama-3-8B at 32k, context 2: the forward's and recomputation's
            # sends overlapped no GEMM, 64 of 96); with it each send runs beside a block.
            block, o_j, lse_j = lax.optimization_barrier((block, o_j, lse_j))
        out, lse = _merge(out, lse, o_j, lse_j)
    return out.astype(q.dtype)


def _visible_half(q, kv, mask, scale, later):
    """A causal ring step's block from another rank: of its [n, n] scores only half can be
    visible, and only that half is computed, as two [n/2, n/2] quarters. Rank r holds
    chunks (r, 2c-1-r) as halves (q1, q2) and the block from rank o its (k1, k2): for
    o < r (`later`) q1 and q2 see k1 and neither sees k2; for o > r only q2 sees, k1 and k2.
    (q2, k1) is computed either way and the other quarter is picked by selects, not a
    conditional (which would stop the next block's send from overlapping it). The mask
    still applies (packed rows)."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]

    def pick(a, b):
        return jnp.where(later, a, b)
    other = _block(pick(q[:, :half], q[:, half:]), pick(k[:, :half], k[:, half:]),
                   pick(v[:, :half], v[:, half:]),
                   pick(mask[:, :, :half, :half], mask[:, :, half:, half:]), scale)
    shared = _block(q[:, half:], k[:, :half], v[:, :half], mask[:, :, half:, :half], scale)
    unseen = jnp.full_like(other[1], -jnp.inf)
    first = (other[0], pick(other[1], unseen))  # q1: the other quarter if o < r, else none
    second = _merge(*shared, other[0], pick(unseen, other[1]))
    return (jnp.concatenate([first[0], second[0]], axis=1),
            jnp.concatenate([first[1], second[1]], axis=1))


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


@functools.partial(jax.checkpoint, static_argnums=(4,))
def _block(q, k, v, mask, scale):
    """(softmax-weighted values [b, n, heads, d] float32, log-sum-exp [b, n, heads]) of q
    over one key block; a query with no visible key there gets zeros and -inf."""
    b, n, heads, d = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, n, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k,
                        preferred_element_type=jnp.float32) * scale
    hidden = mask[:, :, None]  # [b, 1, 1, nq, nk]
    scores = jnp.where(hidden, _NEG, scores)
    row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
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
