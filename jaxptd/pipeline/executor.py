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

The backward is driven by the schedule, not by autodiff through the loop. Every stash
buffer has the schedule's peak-stash number of slots, bounded by the pipeline depth, not
by m. parallel.stash chooses what a slot keeps between a stage's F and B slot:

- activations (default): the F slot takes `jax.vjp` of its layer chunk and stashes the
  closure's residuals (`_Residuals`); the B slot rebuilds the closure and runs only the
  backward, as Megatron does without recomputation;
- inputs: only the stage input [b, s, h] is stashed and the B slot takes `jax.vjp` of the
  whole stage on it, recomputing the forward (per-stage activation recomputation).

The first virtual stage also runs the embedding, the last the head and the loss, so a
microbatch's backward can start in the round its forward ends; the tied embedding's two
gradient contributions meet in the step's reduction over 'pipe'.

Evaluation (`pipeline_loss`) runs the schedule's forwards alone (`schedules.forward_only`):
rounds of one F slot and one ppermute, no vjp, no gradient buffers, and a stash slot
freed as soon as its forward has read it: v m + p - 1 rounds for m >= p (training's
rounds also carry the backwards' tail) and a stash of 2 slots for v = 1 (at most p + 1).

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
from jaxptd import model as models
from jaxptd.pipeline import schedules
from jaxptd.sharding import mark_varying

try:  # an all-gather typed "same on every rank" (the receiver's activations must be)
    from jax._src.lax.parallel import all_gather_invariant
except ImportError:  # a JAX without it: place the slice and psum (twice the bytes)
    all_gather_invariant = None

# The tables of schedules.Rounds that each slot reads; a forward-only pass reads the first.
FORWARD_FIELDS = ("f_valid", "f_mb", "f_chunk", "f_slot", "recv_f_valid", "recv_f_slot")
BACKWARD_FIELDS = ("b_valid", "b_mb", "b_chunk", "b_slot", "b_grad_slot", "recv_b_valid",
                   "recv_b_slot")


@lru_cache(maxsize=32)
def rounds_for(kind: str, stages: int, microbatches: int, chunks: int,
               forward_only: bool = False) -> schedules.Rounds:
    """The lowered rounds of a schedule (training, or its forwards alone for evaluation)."""
    schedule = schedules.make_schedule(kind, stages, microbatches, chunks)
    return schedules.lower(schedules.forward_only(schedule) if forward_only else schedule)


def _tables(rounds: schedules.Rounds, rank, fields):
    """This rank's row of the named tables: a dict of int32 [T] arrays."""
    return {name: jnp.asarray(getattr(rounds, name), jnp.int32)[:, rank] for name in fields}


def _pairs(p: int, v: int, step: int) -> list:
    """ppermute (source, destination) pairs r -> r + step over 'pipe': activations (step
    1) or gradients (step -1); the wrap-around link is used only by interleaving."""
    return [(r, (r + step) % p) for r in range(p) if v > 1 or 0 <= r + step < p]


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


def _read(buffer, slot):
    return lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)


def _store(buffer, valid, slot, value):
    """buffer[slot] = value where valid (a received message), else unchanged."""
    return lax.dynamic_update_index_in_dim(
        buffer, jnp.where(valid, value, _read(buffer, slot)), slot, 0)


def _send(x, pairs, tensor: int, buffer, valid, slot):
    """Sends x [b, s, h] along `pairs` (each tensor rank its 1/t slice, gathered again at
    the receiver) and stores what arrives in buffer[slot] where valid. Every rank calls it."""
    received = _gather(lax.ppermute(_scatter(x, tensor), PIPE, pairs), tensor)
    return _store(buffer, valid > 0, slot, received)


class _Stage:
    """One virtual stage in three pieces: [embedding] -> a chunk of layers -> [head + loss].

    `ends` holds the parameters of the pieces at the two ends ({'embed', 'final_norm'});
    `layers` one chunk's stack [Lc, ...]. The embedding runs on virtual stage 0 only and
    the head on the last only (lax.cond: the other ranks skip them at run time).
    """

    def __init__(self, setup, batch, key, deterministic):
        config, m = setup.config, setup.config.parallel.microbatches
        self.config, self.layout, self.arch = config, setup.local_layout, setup.arch
        self.micro = batch.reshape(m, -1, batch.shape[-1])  # [m, b, row width]
        self.key, self.rank = key, lax.axis_index(PIPE)
        self.deterministic = deterministic
        self.last = config.parallel.pipe * config.parallel.chunks - 1
        self.norm = 1.0 / (config.train.global_batch * config.model.seq_len)

    def vstage(self, chunk):
        return chunk * self.config.parallel.pipe + self.rank

    def buffer(self, slots):
        """Zeros [slots, b, s, h] for stage inputs or their gradients: varying over data and
        pipe and the same on every tensor rank, like the activations they receive."""
        model = self.config.model
        shape = (slots, self.micro.shape[1], model.seq_len, model.hidden_size)
        return mark_varying(jnp.zeros(shape, jnp.dtype(model.dtype)), (DATA, PIPE))

    def tokens(self, mb):
        return lax.dynamic_index_in_dim(self.micro, mb, 0, keepdims=False)  # [b, row width]

    def stage_key(self, mb, chunk):
        return jax.random.fold_in(jax.random.fold_in(self.key, mb), self.vstage(chunk))

    def embed_or_input(self, ends, x_in, mb, chunk):
        """Virtual stage 0 embeds its microbatch; the others take the received input."""
        return lax.cond(self.vstage(chunk) == 0,
                        lambda: self.arch.embed(ends, self.tokens(mb), self.stage_key(mb, chunk),
                                                self.config.model, self.layout,
                                                self.deterministic),
                        lambda: x_in)

    def layers(self, layers, x, mb, chunk):
        return self.arch.apply_layers(layers, x, self.tokens(mb), self.stage_key(mb, chunk),
                                      self.config.model, self.layout, self.deterministic)

    def head(self, ends, y, mb, chunk):
        """The loss contribution (scaled to the global token mean) of the last stage; 0
        elsewhere."""
        loss = lax.cond(self.vstage(chunk) == self.last,
                        lambda: self.arch.head_loss(ends, y, self.tokens(mb),
                                                    self.config.model, self.layout),
                        lambda: mark_varying(jnp.zeros((), jnp.float32), (DATA, PIPE)))
        return loss * self.norm

    def __call__(self, ends, layers, x_in, mb, chunk):
        """The whole stage -> (output [b, s, h], loss contribution)."""
        y = self.layers(layers, self.embed_or_input(ends, x_in, mb, chunk), mb, chunk)
        return y, self.head(ends, y, mb, chunk)


class _Residuals:
    """How a layer chunk's `jax.vjp` closure is kept between its F and its B slot.

    The closure is a pytree: a static backward jaxpr and its residual leaves. Leaves that
    *are* the chunk's weights (JAX's scan passes weights through unchanged) are not stored:
    the B slot takes them from the parameters again. The others, activations, go to
    per-slot buffers [slots, ...]. The structure is fixed by tracing once (the probe);
    every later trace must give the same leaves.
    """

    def __init__(self, vjp_fn, weights):
        self.treedef, self.sources, stored = self._split(vjp_fn, weights)
        self.templates = [jnp.zeros_like(x) for x in stored]

    @staticmethod
    def _split(vjp_fn, weights):
        leaves, treedef = jax.tree.flatten(vjp_fn)
        sources = tuple(next((i for i, w in enumerate(weights) if leaf is w), None)
                        for leaf in leaves)
        return treedef, sources, [leaf for leaf, src in zip(leaves, sources) if src is None]

    def store(self, vjp_fn, weights):
        """The leaves to stash (in buffer order)."""
        _, sources, stored = self._split(vjp_fn, weights)
        # The treedef holds the backward jaxpr (a new object per trace): compare the rest.
        assert sources == self.sources and [(x.shape, x.dtype) for x in stored] == [
            (t.shape, t.dtype) for t in self.templates], "residuals changed between traces"
        return stored

    def rebuild(self, stored, weights):
        """The vjp closure from stashed leaves and the current weights."""
        stored = iter(stored)
        leaves = [next(stored) if src is None else weights[src] for src in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)


def _accumulate(grads, chunk, g_ends, g_layers):
    new = {k: jax.tree.map(jnp.add, grads[k], g_ends[k]) for k in g_ends}
    new["layers"] = _add_chunk(grads["layers"], chunk, g_layers)
    return new


def pipeline_grads(params, batch, key, loss_scale, *, setup, deterministic: bool):
    """Pipelined local gradients; runs inside the step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns (gradient sums, loss sum) on this
    device, scaled to the global token mean (the loss is nonzero on the last stage's rank).

    parallel.stash = 'inputs': the B slot recomputes the stage from its stashed input;
    'activations': the F slot's vjp residuals are stashed and the B slot only runs the
    backward (the embedding and head, cheap, are recomputed).
    """
    config = setup.config
    p, v, m = config.parallel.pipe, config.parallel.chunks, config.parallel.microbatches
    tensor = config.parallel.tensor
    rounds = rounds_for(config.parallel.schedule, p, m, v)
    stage = _Stage(setup, batch, key, deterministic)
    keep_activations = config.parallel.stash == "activations"
    ends = models.ends(params)
    stash, gbuf = stage.buffer(rounds.num_stash_slots), stage.buffer(rounds.num_grad_slots)
    saved, residuals = (), None
    if keep_activations:  # trace one chunk to learn the residuals (XLA drops the compute)
        index = stage.rank * 0  # traced, like the slots' microbatch and chunk
        weights = _chunk(params["layers"], index)
        _, probe = jax.vjp(lambda w, x: stage.layers(w, x, index, index), weights, stash[0])
        residuals = _Residuals(probe, jax.tree.leaves(weights))
        templates = residuals.templates + [stash[0]]  # + the stage output, for the head
        saved = tuple(jnp.broadcast_to(t, (rounds.num_stash_slots, *t.shape))
                      for t in templates)

    def forward(carry, row):
        stash, _, _, loss, saved = carry
        mb, chunk = row["f_mb"], row["f_chunk"]
        x_in = _read(stash, row["f_slot"])
        if not keep_activations:
            y, contribution = stage(ends, _chunk(params["layers"], chunk), x_in, mb, chunk)
            return y, loss + contribution, ()
        weights = _chunk(params["layers"], chunk)
        x = stage.embed_or_input(ends, x_in, mb, chunk)
        y, vjp_fn = jax.vjp(lambda w, x: stage.layers(w, x, mb, chunk), weights, x)
        kept = tuple(residuals.store(vjp_fn, jax.tree.leaves(weights))) + (y,)
        # Written here, not after the cond, so that ranks with an idle F slot write nothing.
        saved = tuple(lax.dynamic_update_index_in_dim(buffer, value, row["f_slot"], 0)
                      for buffer, value in zip(saved, kept))
        return y, loss + stage.head(ends, y, mb, chunk), saved

    def backward(carry, row):
        stash, gbuf, grads, _, saved = carry
        mb, chunk = row["b_mb"], row["b_chunk"]
        x_in = _read(stash, row["b_slot"])
        g_out = _read(gbuf, row["b_grad_slot"])
        is_last = stage.vstage(chunk) == stage.last
        g_loss = mark_varying(jnp.where(is_last, loss_scale, 0.0).astype(jnp.float32),
                              (DATA, PIPE))
        g_y = jnp.where(is_last, jnp.zeros_like(g_out), g_out)
        weights = _chunk(params["layers"], chunk)
        if not keep_activations:  # recompute the stage's forward inside its vjp
            _, vjp = jax.vjp(lambda e, w, x: stage(e, w, x, mb, chunk), ends, weights, x_in)
            g_ends, g_layers, g_x = vjp((g_y, g_loss))
            return g_x, _accumulate(grads, chunk, g_ends, g_layers)
        kept = [_read(buffer, row["b_slot"]) for buffer in saved]
        _, head_vjp = jax.vjp(lambda e, y: stage.head(e, y, mb, chunk), ends, kept[-1])
        g_head, g_y_head = head_vjp(g_loss)
        vjp_fn = residuals.rebuild(kept[:-1], jax.tree.leaves(weights))
        g_layers, g_x = vjp_fn(g_y + g_y_head)
        _, embed_vjp = jax.vjp(lambda e, x: stage.embed_or_input(e, x, mb, chunk), ends, x_in)
        g_embed, g_x_in = embed_vjp(g_x)
        return g_x_in, _accumulate(grads, chunk, jax.tree.map(jnp.add, g_head, g_embed),
                                   g_layers)

    def idle_forward(carry, row):
        return jnp.zeros_like(carry[0][0]), carry[3], carry[4]

    def one_round(carry, row):
        stash, gbuf, grads, loss, saved = carry
        # F slot: run a forward (or nothing), keep what its backward needs, send its output.
        y, loss, saved = lax.cond(row["f_valid"] > 0, forward, idle_forward, carry, row)
        stash = _send(y, _pairs(p, v, 1), tensor, stash, row["recv_f_valid"], row["recv_f_slot"])
        carry = (stash, gbuf, grads, loss, saved)
        # B slot: a backward (or nothing), then send the input gradient to the previous rank.
        g_x, grads = lax.cond(row["b_valid"] > 0, backward,
                              lambda c, r: (jnp.zeros_like(c[0][0]), c[2]), carry, row)
        gbuf = _send(g_x, _pairs(p, v, -1), tensor, gbuf, row["recv_b_valid"], row["recv_b_slot"])
        return (stash, gbuf, grads, loss, saved), None

    grads = jax.tree.map(jnp.zeros_like, params)
    loss = mark_varying(jnp.zeros((), jnp.float32), (DATA, PIPE))
    carry, _ = lax.scan(one_round, (stash, gbuf, grads, loss, saved),
                        _tables(rounds, stage.rank, FORWARD_FIELDS + BACKWARD_FIELDS))
    return carry[2], carry[3]


def pipeline_loss(params, batch, *, setup):
    """Pipelined local loss of a forward pass alone (no dropout, no backward); runs inside
    the eval step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns this device's loss sum scaled to
    the global token mean (nonzero on the last stage's rank), as pipeline_grads does.
    """
    config = setup.config
    p, v, m = config.parallel.pipe, config.parallel.chunks, config.parallel.microbatches
    rounds = rounds_for(config.parallel.schedule, p, m, v, forward_only=True)
    stage = _Stage(setup, batch, jax.random.key(0), deterministic=True)  # the key is unused
    ends = models.ends(params)

    def forward(carry, row):
        stash, loss = carry
        mb, chunk = row["f_mb"], row["f_chunk"]
        y, contribution = stage(ends, _chunk(params["layers"], chunk),
                                _read(stash, row["f_slot"]), mb, chunk)
        return y, loss + contribution

    def idle(carry, row):
        return jnp.zeros_like(carry[0][0]), carry[1]  # [b, s, h] zeros, like a stage output

    def one_round(carry, row):
        y, loss = lax.cond(row["f_valid"] > 0, forward, idle, carry, row)
        stash = _send(y, _pairs(p, v, 1), config.parallel.tensor, carry[0],
                      row["recv_f_valid"], row["recv_f_slot"])
        return (stash, loss), None

    loss = mark_varying(jnp.zeros((), jnp.float32), (DATA, PIPE))
    (_, loss), _ = lax.scan(one_round, (stage.buffer(rounds.num_stash_slots), loss),
                            _tables(rounds, stage.rank, FORWARD_FIELDS))
    return loss
