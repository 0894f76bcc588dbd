"""The pipeline executor: a validated schedule's lockstep rounds, run inside the step's
fully manual shard_map, with stage-to-stage traffic through `lax.ppermute` over 'pipe'.

Owns how a schedule becomes computation. `schedules.lower` gives, for every round t and
pipe rank r, at most one forward (F slot) and one backward (B slot) with the stash and
gradient-buffer slots they use. One round is

    F slot  -> ppermute activations r -> r+1 -> B slot -> ppermute gradients r -> r-1

and a `lax.scan` runs the T rounds. Each rank reads its own row of the tables
(`axis_index('pipe')`), and `lax.cond` on that row skips idle slots, so an idle slot costs
nothing; the ppermutes stay outside the conds (every rank must take part). A round costs
max(F) + max(B) over the ranks, which is what `schedules.simulate` models.

Why lockstep rounds with one F and one B slot: a schedule that lowers this way finishes in
(m + p - 1)(t_f + t_b) for 1F1B, the time of Megatron's asynchronous 1F1B, while rounds of
a single action would cost max(t_f, t_b) each and lose up to a third when t_b = 2 t_f.

The backward is driven by the schedule: the B slot of (microbatch j, chunk c) calls
`jax.vjp` of the stage on its stashed input, recomputing the stage's forward (activation
recomputation per stage: only stage inputs are stashed, [slots, b, s, h], and the number
of slots is the schedule's peak stash, bounded by the pipeline depth, not by m). The
first virtual stage also runs the embedding, the last the head and the loss, so a
microbatch's backward can start in the round its forward ends; the tied embedding's two
gradient contributions meet in the step's reduction over 'pipe'.

Scatter/gather (PTD-P §4.1): a stage output is the same on every tensor rank, so each
tensor rank sends only its 1/t slice of the hidden dimension and the receiver all-gathers
it over 'tensor'.

Parameters: each layer leaf is [v, 1, L/(p v), ...] on a device (chunks, this rank's
stage, layers of the chunk); virtual stage c*p + r runs chunk c on rank r.
"""
from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.mesh import DATA, PIPE, TENSOR
from jaxptd.model import gpt
from jaxptd.pipeline.schedules import Rounds, lower, make_schedule
from jaxptd.sharding import mark_varying

try:  # an all-gather typed "same on every rank" (the receiver's activations must be)
    from jax._src.lax.parallel import all_gather_invariant
except ImportError:  # a JAX without it: place the slice and psum (twice the bytes)
    all_gather_invariant = None

TABLE_FIELDS = ("f_valid", "f_mb", "f_chunk", "f_slot", "b_valid", "b_mb", "b_chunk", "b_slot",
                "b_grad_slot", "recv_f_valid", "recv_f_slot", "recv_b_valid", "recv_b_slot")


@lru_cache(maxsize=32)
def rounds_for(kind: str, stages: int, microbatches: int, chunks: int) -> Rounds:
    """The lowered (and thereby validated) rounds of a schedule."""
    return lower(make_schedule(kind, stages, microbatches, chunks))


def _tables(rounds: Rounds, rank):
    """This rank's row of every table: a dict of int32 [T] arrays."""
    return {name: jnp.asarray(getattr(rounds, name), jnp.int32)[:, rank] for name in TABLE_FIELDS}


def _chunk(layers, c):
    """Chunk c's layers from a local [v, 1, Lc, ...] stack -> [Lc, ...]."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, c, 0, keepdims=False)[0], layers)


def _add_chunk(grads_layers, c, chunk_grads):
    """grads[c, 0] += chunk_grads for every layer leaf."""
    def add(total, g):
        current = lax.dynamic_index_in_dim(total, c, 0, keepdims=True)
        return lax.dynamic_update_index_in_dim(total, current + g[None, None], c, 0)
    return jax.tree.map(add, grads_layers, chunk_grads)


def _scatter(x, tensor: int):
    """[b, s, h] (same on every tensor rank) -> this rank's [b, s, h/t] slice."""
    if tensor == 1:
        return x
    width = x.shape[-1] // tensor
    return lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * width, width, axis=-1)


def _gather(x, tensor: int):
    """[b, s, h/t] slices -> [b, s, h], the same (and typed so) on every tensor rank."""
    if tensor == 1:
        return x
    if all_gather_invariant is not None:
        return all_gather_invariant(x, TENSOR, axis=x.ndim - 1, tiled=True)
    width = x.shape[-1]
    full = jnp.zeros((*x.shape[:-1], width * tensor), x.dtype)
    return lax.psum(lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(TENSOR) * width,
                                                    axis=-1), TENSOR)


def _store(buffer, valid, slot, value):
    """buffer[slot] = value where valid (a received message), else unchanged."""
    old = lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(valid, value, old), slot, 0)


class _Stage:
    """One virtual stage as a function of (parameters, stage input)."""

    def __init__(self, setup, micro, key, rank, deterministic):
        config = setup.config
        self.config, self.layout = config, setup.local_layout
        self.micro, self.key, self.rank = micro, key, rank
        self.deterministic = deterministic
        self.stages = config.parallel.pipe * config.parallel.chunks
        self.norm = 1.0 / (config.train.global_batch * config.model.seq_len)

    def vstage(self, chunk):
        return chunk * self.config.parallel.pipe + self.rank

    def __call__(self, params, x_in, mb, chunk):
        """-> (stage output [b, s, h], loss contribution: nonzero on the last stage only)."""
        model, layout = self.config.model, self.layout
        vstage = self.vstage(chunk)
        tokens = lax.dynamic_index_in_dim(self.micro, mb, 0, keepdims=False)  # [b, s+1]
        x = lax.cond(vstage == 0, lambda: gpt.embed(params, tokens[:, :-1], model, layout),
                     lambda: x_in)
        key = jax.random.fold_in(jax.random.fold_in(self.key, mb), vstage)
        y = gpt.apply_layers(_chunk(params["layers"], chunk), x, key, model, layout,
                             self.deterministic)
        loss = lax.cond(vstage == self.stages - 1,
                        lambda: gpt.head_loss(params, y, tokens[:, 1:], model, layout),
                        lambda: mark_varying(jnp.zeros((), jnp.float32), (DATA, PIPE)))
        loss = loss * self.norm
        return y, loss


def pipeline_grads(params, batch, key, loss_scale, *, setup, deterministic: bool):
    """Pipelined local gradients; runs inside the step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns (gradient sums, loss sum) on this
    device, scaled to the global token mean (the loss is nonzero on the last stage's rank).
    """
    config = setup.config
    p, v, m = config.parallel.pipe, config.parallel.chunks, config.parallel.microbatches
    tensor = config.parallel.tensor
    rounds = rounds_for(config.parallel.schedule, p, m, v)
    rank = lax.axis_index(PIPE)
    micro = batch.reshape(m, -1, batch.shape[-1])  # [m, b, s+1]
    b, s, h = micro.shape[1], config.model.seq_len, config.model.hidden_size
    stage = _Stage(setup, micro, key, rank, deterministic)
    last = p * v - 1
    dtype = jnp.dtype(config.model.dtype)

    # Activations go to the next rank; the wrap-around link is used only by interleaving.
    fwd_pairs = [(r, (r + 1) % p) for r in range(p if v > 1 else p - 1)]
    bwd_pairs = [(r, (r - 1) % p) for r in range(p) if v > 1 or r > 0]

    def forward(carry, row):
        stash, gbuf, grads, loss = carry
        mb, chunk = row["f_mb"], row["f_chunk"]
        x_in = lax.dynamic_index_in_dim(stash, row["f_slot"], 0, keepdims=False)
        y, contribution = stage(params, x_in, mb, chunk)
        return y, loss + contribution

    def backward(carry, row):
        stash, gbuf, grads, loss = carry
        mb, chunk = row["b_mb"], row["b_chunk"]
        x_in = lax.dynamic_index_in_dim(stash, row["b_slot"], 0, keepdims=False)
        g_out = lax.dynamic_index_in_dim(gbuf, row["b_grad_slot"], 0, keepdims=False)
        is_last = stage.vstage(chunk) == last
        _, vjp = jax.vjp(lambda prm, x: stage(prm, x, mb, chunk), params, x_in)
        g_loss = mark_varying(jnp.where(is_last, loss_scale, 0.0).astype(jnp.float32),
                              (DATA, PIPE))
        g_params, g_x = vjp((jnp.where(is_last, jnp.zeros_like(g_out), g_out), g_loss))
        layer_grads = _chunk(g_params["layers"], chunk)
        new = {k: jax.tree.map(jnp.add, grads[k], g_params[k]) for k in ("embed", "final_norm")}
        new["layers"] = _add_chunk(grads["layers"], chunk, layer_grads)
        return g_x, new

    def one_round(carry, row):
        stash, gbuf, grads, loss = carry
        # F slot: run a forward (or nothing), send its output to the next rank.
        idle_y = jnp.zeros_like(stash[0])
        y, loss = lax.cond(row["f_valid"] > 0, forward, lambda c, r: (idle_y, c[3]), carry, row)
        received = _gather(lax.ppermute(_scatter(y, tensor), PIPE, fwd_pairs), tensor)
        stash = _store(stash, row["recv_f_valid"] > 0, row["recv_f_slot"], received)
        # F of virtual stage 0 has no input message; its slot keeps nothing.
        carry = (stash, gbuf, grads, loss)
        # B slot: backward of a stashed stage input (or nothing), send the input gradient.
        g_x, grads = lax.cond(row["b_valid"] > 0, backward,
                              lambda c, r: (jnp.zeros_like(c[0][0]), c[2]), carry, row)
        received = _gather(lax.ppermute(_scatter(g_x, tensor), PIPE, bwd_pairs), tensor)
        gbuf = _store(gbuf, row["recv_b_valid"] > 0, row["recv_b_slot"], received)
        return (stash, gbuf, grads, loss), None

    # Buffers hold stage inputs / their gradients: [slots, b, s, h], varying over data and
    # pipe and the same on every tensor rank, like the activations they receive.
    stash = mark_varying(jnp.zeros((rounds.num_stash_slots, b, s, h), dtype), (DATA, PIPE))
    gbuf = mark_varying(jnp.zeros((rounds.num_grad_slots, b, s, h), dtype), (DATA, PIPE))
    grads = jax.tree.map(jnp.zeros_like, params)
    loss = mark_varying(jnp.zeros((), jnp.float32), (DATA, PIPE))
    rows = _tables(rounds, rank)
    (stash, gbuf, grads, loss), _ = lax.scan(one_round, (stash, gbuf, grads, loss), rows)
    return grads, loss
