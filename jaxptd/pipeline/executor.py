"""The pipeline executor: a validated schedule's lockstep rounds, run inside the step's
fully manual shard_map, with stage-to-stage traffic through `lax.ppermute` over 'pipe'.

Owns how a schedule becomes computation. `lowering.lower` gives, for every round t and pipe
rank r, at most one forward (F slot), one backward (B slot) and one weight-gradient (W
slot, zero-bubble kinds) with the buffer slots they use. A round, read top to bottom in
`_round`, is

    F slot -> send its output to r+1 -> B slot -> send its input gradient to r-1 -> W slot
           -> store what arrived

Nothing in a round reads what arrives in it: each message is stored at the end of the round
(`_Buffers.arrive`) and used from the next, so XLA's asynchronous collective-permutes can
run beside the round's later slots. A `lax.scan` runs the rounds of each segment.

Round forms (parallel.round_form; `segments`):
- cond (the CPU default): every slot, the embedding and the head are a `lax.cond` on the
  rank's row of the tables, so idle work is skipped (simulated devices share the cores);
- steady (the GPU default): no conditional at all. Rounds in which the same slot kinds
  are used by every rank, by some or by none run as one scan: a kind every rank uses runs
  unconditionally, one some ranks use runs masked on every rank (its results discarded
  where idle), one no rank uses is not traced; the embedding and head are computed by
  every rank and selected in a scan where some round needs them. On a GPU the ranks run
  in lockstep, so a round lasts as long as its busiest rank's work whatever the idle ones
  do, while an XLA:GPU conditional copies its predicate to the host and, in the compiled
  H100 program, copied the whole stash it passed through (19.7 GB a step at (2,2,2));
- masked: no conditional anywhere; an idle slot computes and its results are discarded.

The backward is driven by the schedule, not by autodiff through the loop. parallel.stash
chooses what a stash slot keeps between a stage's F and B slot:
- activations (default): the F slot takes `jax.vjp` of its layer chunk and keeps what the
  backward closes over, as arrays (`kept.Kept`: `jax.make_jaxpr` of the backward; the chunk's
  own weights, which the backward closes over too, are passed again instead of kept);
- inputs: only the stage input [b, s, h] is kept and the B slot takes `jax.vjp` of the whole
  stage on it, recomputing the forward (per-stage activation recomputation).
Zero-bubble kinds split the backward: B computes the input gradient and the gradients of
everything but the dense() weights, keeping each dense() matmul's input and output gradient
(the model's taps) in a W slot; W computes those weights' gradients from them alone
(`model.dense_weight_grads`): no second forward.

The first virtual stage also runs the embedding, the last the head and the loss (in the B
slot, from the kept stage output: the loss is the head's primal there), so a microbatch's
backward can start in the round its forward ends; the tied embedding's two gradient
contributions (first and last stage) meet in the step's exchange between those two ranks.

Evaluation (`pipeline_loss`) runs the schedule's forwards alone (`schedules.forward_only`):
rounds of one F slot and one ppermute, no vjp, and a stash slot freed as soon as its forward
has read it: v m + p - 1 rounds for m >= p and a stash of 2 slots for v = 1.

Scatter/gather (PTD-P §4.1): a stage output is the same on every tensor rank, so each
tensor rank sends only its 1/t slice of the hidden dimension and the receiver all-gathers
it over 'tensor'.

Parameters: each layer leaf is [v, 1, L/(p v), ...] on a device (chunks, this rank's
stage, layers of the chunk); virtual stage c*p + r runs chunk c on rank r.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from jaxptd import model as models
from jaxptd.mesh import BATCH, PIPE, TENSOR
from jaxptd.pipeline import schedules
from jaxptd.pipeline.kept import Kept
from jaxptd.pipeline.lowering import Rounds, Segment, chunks_done, lower, segments
from jaxptd.sharding import gather_invariant, mark_varying, regather, varying_axes

FORMS = ("cond", "steady", "masked")
SLOT_FIELDS = {
    "F": ("f_valid", "f_mb", "f_chunk", "f_slot", "recv_f_valid", "recv_f_slot"),
    "B": ("b_valid", "b_mb", "b_chunk", "b_slot", "b_grad_slot", "b_wslot", "recv_b_valid",
          "recv_b_slot"),
    "W": ("w_valid", "w_mb", "w_chunk", "w_slot"),
}


@lru_cache(maxsize=32)
def rounds_for(kind: str, stages: int, microbatches: int, chunks: int,
               forward_only: bool = False) -> Rounds:
    """The lowered rounds of a schedule (training, or its forwards alone for evaluation)."""
    schedule = schedules.make_schedule(kind, stages, microbatches, chunks)
    return lower(schedules.forward_only(schedule) if forward_only else schedule)


def round_form(config, platform: str) -> str:
    """parallel.round_form, with 'auto' resolved for the target's platform: cond on CPU,
    steady on a GPU."""
    form = config.parallel.round_form
    if form == "auto":
        return "steady" if platform == "gpu" else "cond"
    return form


# --------------------------------------------------------------------------- buffers


def _read(buffer, slot):
    return lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)


def _write(buffer, slot, value, valid):
    """buffer[slot] = value where valid (True: unconditionally)."""
    if valid is not True:
        value = jnp.where(valid, value, _read(buffer, slot))
    return lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), slot, 0)


def _masked(tree, valid):
    """tree where valid, zeros elsewhere (valid True: tree itself)."""
    return tree if valid is True else jax.tree.map(lambda x: jnp.where(valid, x, 0), tree)


def _chunk(layers, c):
    """Chunk c's layers from a local [v, 1, Lc, ...] stack -> [Lc, ...]."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, c, 0, keepdims=False)[0], layers)


def _chunk_of(row, slot: str, chunks: int):
    """The chunk a slot works on: the table's, or with one chunk a static 0 (a dynamic
    index made XLA copy the chunk's weights out of the stack in every slot)."""
    return row[f"{slot}_chunk"] if chunks > 1 else 0


def _add_chunk(grads_layers, c, chunk_grads):
    """grads[c, 0] += chunk_grads for the leaves chunk_grads has (a subtree of the layers)."""
    flat = traverse_util.flatten_dict(grads_layers)

    def add(total, g):
        current = lax.dynamic_index_in_dim(total, c, 0, keepdims=True)
        update = current + g.astype(total.dtype)[None, None]
        return lax.dynamic_update_index_in_dim(total, update, c, 0)
    for path, g in traverse_util.flatten_dict(chunk_grads).items():
        flat[path] = add(flat[path], g)
    return traverse_util.unflatten_dict(flat)


def _cast(tree, dtype):
    """Master weights -> the compute dtype, done before a vjp so that a kept backward closes
    over the very values it is given again (not over a cast copy of them)."""
    return jax.tree.map(lambda w: w.astype(dtype), tree)


def _scatter(x, tensor: int):
    """[b, s, h] (same on every tensor rank) -> this rank's [b, s, h/t] slice."""
    if tensor == 1:
        return x
    width = x.shape[-1] // tensor
    return lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * width, width, axis=-1)


def _gather(x, tensor: int):
    """[b, s, h/t] slices -> [b, s, h], the same (and typed so) on every tensor rank."""
    return x if tensor == 1 else gather_invariant(x, TENSOR, x.ndim - 1, tensor)


def _pairs(p: int, v: int, step: int) -> list:
    """ppermute (source, destination) pairs r -> r + step over 'pipe': activations (step
    1) or gradients (step -1); the wrap-around link is used only by interleaving."""
    return [(r, (r + step) % p) for r in range(p) if v > 1 or 0 <= r + step < p]


def _send(x, p: int, v: int, step: int, tensor: int):
    """Starts sending x [b, s, h] along the chain (each tensor rank its 1/t slice; with
    sequence parallelism, tensor = 1 here: x is already this rank's [b, s/t, h])."""
    return lax.ppermute(_scatter(x, tensor), PIPE, _pairs(p, v, step))


def _arrive(buffer, message, valid, slot, tensor: int):
    """Stores a message that arrived (gathered over tensor) in buffer[slot] where valid."""
    return _write(buffer, slot, _gather(message, tensor), valid > 0)


def _message_split(setup) -> int:
    """How many tensor ranks split a stage-to-stage message (PTD-P §4.1's scatter/gather);
    1 with sequence parallelism, whose activations are already split over the sequence."""
    return 1 if setup.local_layout.split_sequence else setup.config.parallel.tensor


# --------------------------------------------------------------------------- stages


class _Stage:
    """One virtual stage in three pieces: [embedding] -> a chunk of layers -> [head + loss].

    `ends` holds the parameters of the pieces at the two ends (model.ends), each leaf
    [1, ...] this rank's slot (jaxptd/step.py's Setup); `layers` one chunk's stack
    [Lc, ...]. The embedding runs on virtual stage 0 only and the head on the last only:
    a `lax.cond` on the rank, or (inline) computed by every rank and selected.
    """

    def __init__(self, setup, batch, key, deterministic):
        config, m = setup.config, setup.config.parallel.microbatches
        self.config, self.layout, self.arch = config, setup.local_layout, setup.arch
        self.micro = batch.reshape(m, -1, batch.shape[-1])  # [m, b, row width]
        self.key, self.rank = key, lax.axis_index(PIPE)
        self.deterministic = deterministic
        self.last = config.parallel.pipe * config.parallel.chunks - 1
        self.norm = setup.loss_norm
        gather_ends, gather_layer = setup.gather()  # FSDP: shards -> what is computed with
        gather_ends = gather_ends or (lambda ends: ends)
        # ends leaves [1, ...]: this stage's slot (zeros where the stage does not read it)
        self.gather_ends = lambda ends: jax.tree.map(lambda x: x[0], gather_ends(ends))
        self.prepare = None if gather_layer is None else (lambda p, _: gather_layer(p))
        self.keep = gather_layer and regather

    def vstage(self, chunk):
        return chunk * self.config.parallel.pipe + self.rank

    def buffer(self, slots):
        """Zeros [slots, b, s, h] for stage inputs or their gradients: varying over data and
        pipe and the same on every tensor rank, like the activations they receive (with
        sequence parallelism [slots, b, s/t, h], varying over tensor too)."""
        model, split = self.config.model, self.layout.split_sequence
        seq = model.seq_len // (self.layout.tensor if split else 1)
        shape = (slots, self.micro.shape[1], seq, model.hidden_size)
        axes = (*BATCH, PIPE, TENSOR) if split else (*BATCH, PIPE)
        return mark_varying(jnp.zeros(shape, jnp.dtype(model.dtype)), axes)

    def tokens(self, mb):
        return lax.dynamic_index_in_dim(self.micro, mb, 0, keepdims=False)  # [b, row width]

    def stage_key(self, mb, chunk):
        return jax.random.fold_in(jax.random.fold_in(self.key, mb), self.vstage(chunk))

    def embed_or_input(self, ends, x_in, mb, chunk, how: str):
        """Virtual stage 0 embeds its microbatch; the others take the received input.
        how: 'cond', 'inline' (every rank embeds, stage 0 keeps it) or 'off' (no rank's
        slot is stage 0)."""
        def embed():
            return self.arch.embed(self.gather_ends(ends), self.tokens(mb),
                                   self.stage_key(mb, chunk), self.config.model, self.layout,
                                   self.deterministic)
        if how == "cond":
            return lax.cond(self.vstage(chunk) == 0, embed, lambda: x_in)
        return jnp.where(self.vstage(chunk) == 0, embed(), x_in) if how == "inline" else x_in

    def layers(self, layers, x, mb, chunk, perturbations=None):
        return models.apply_layers(layers, x, self.tokens(mb), self.stage_key(mb, chunk),
                                   self.config.model, self.layout, self.deterministic,
                                   perturbations, self.prepare, keep=self.keep)

    def head(self, ends, y, mb, chunk, how: str):
        """The loss contribution (scaled to the global token mean) of the last stage; 0
        elsewhere. how: as for embed_or_input."""
        def loss():
            return self.arch.head_loss(self.gather_ends(ends), y, self.tokens(mb),
                                       self.config.model, self.layout) * self.norm

        def zero():
            return mark_varying(jnp.zeros((), jnp.float32), (*BATCH, PIPE))
        is_last = self.vstage(chunk) == self.last
        if how == "cond":
            return lax.cond(is_last, loss, zero)
        return jnp.where(is_last, loss(), 0.0) if how == "inline" else zero()


# --------------------------------------------------------------------------- rounds


def _tables(rounds: Rounds, rank, kinds: str, seg: Segment) -> dict:
    """This rank's rows of the segment's tables: a dict of int32 [stop - start] arrays."""
    names = [n for k in kinds for n in SLOT_FIELDS[k]]
    return {n: jnp.asarray(getattr(rounds, n)[seg.start:seg.stop], jnp.int32)[:, rank]
            for n in names}


def _run_slot(mode, fn, carry, row, valid_field, seg, idle_message):
    """One slot in its mode -> (message or None, carry). fn(carry, row, valid, seg); an
    idle rank of a conditional slot sends `idle_message` (zeros, or None for W)."""
    if mode == "off":
        return None, carry
    if mode == "run":
        return fn(carry, row, True, seg)
    if mode == "mask":
        return fn(carry, row, row[valid_field] > 0, seg)
    return lax.cond(row[valid_field] > 0, lambda c, r: fn(c, r, True, seg),
                    lambda c, r: (idle_message, c), carry, row)


def _round(program, seg: Segment):
    """The scan body of a segment: the slots of `program` in order, then the arrivals."""
    p, v, tensor = program.p, program.v, program.tensor

    def one_round(carry, row):
        idle = program.stage.buffer(1)[0]  # [b, s, h] zeros: what an idle F or B sends
        y, carry = _run_slot(seg.modes[0], program.forward, carry, row, "f_valid", seg, idle)
        sent_f = None if y is None else _send(y, p, v, 1, tensor)
        g_x, carry = _run_slot(seg.modes[1], program.backward, carry, row, "b_valid", seg, idle)
        sent_b = None if g_x is None else _send(g_x, p, v, -1, tensor)
        _, carry = _run_slot(seg.modes[2], program.weight, carry, row, "w_valid", seg, None)
        carry = dict(carry)  # what arrived, stored last: no slot of the round waits for it
        if sent_f is not None:
            carry["stash"] = _arrive(carry["stash"], sent_f, row["recv_f_valid"],
                                     row["recv_f_slot"], tensor)
        if sent_b is not None:
            carry["gbuf"] = _arrive(carry["gbuf"], sent_b, row["recv_b_valid"],
                                    row["recv_b_slot"], tensor)
        return carry, None
    return one_round


def _run(program, rounds: Rounds, form: str, kinds: str, cuts=(), at_cut=None):
    """Runs every segment's scan over the program's carry; returns the final carry.
    cuts: rounds after which the scans are cut and at_cut(round, carry) is called."""
    carry = program.initial_carry()
    for seg in segments(rounds, form):
        start = seg.start
        for stop in sorted({t for t in cuts if seg.start < t < seg.stop} | {seg.stop}):
            part = dataclasses.replace(seg, start=start, stop=stop)
            carry, _ = lax.scan(_round(program, part), carry,
                                _tables(rounds, program.stage.rank, kinds, part))
            if stop in cuts:
                at_cut(stop, carry)
            start = stop
    return carry


# --------------------------------------------------------------------------- programs


def _slots(template, slots: int):
    """[slots, ...] zeros like every leaf of `template`, varying over the axes the leaf
    varies over and over pipe: a slot is written at an index that varies over pipe (the
    rank's table), which makes even an invariant leaf (an empty cuDNN attention residual,
    shape [0]) varying, and a buffer written in one branch of a conditional only must
    not change type."""
    return jax.tree.map(lambda t: mark_varying(
        jnp.broadcast_to(jnp.zeros_like(t), (slots, *t.shape)),
        (*sorted(varying_axes(t)), PIPE)), template)


def _write_tree(buffers, slot, values, valid):
    return jax.tree.map(lambda b, x: _write(b, slot, x, valid), buffers, values)


def _read_tree(buffers, slot):
    return jax.tree.map(lambda b: _read(b, slot), buffers)


class _Training:
    """The slots of a training schedule on this pipe rank: forward, backward and weight,
    each (carry, row, valid, seg) -> (message, carry). The carry holds the stage-input
    stash, the received output gradients (gbuf), what F keeps for B (saved: the backward's
    values, the stage output, the dense inputs), what B keeps for W (wsaved: dense inputs
    and output gradients), the gradient sums and the loss."""

    def __init__(self, params, batch, key, loss_scale, setup, deterministic):
        par = setup.config.parallel
        self.p, self.v, self.tensor = par.pipe, par.chunks, _message_split(setup)
        self.rounds = rounds_for(par.schedule, par.pipe, par.microbatches, par.chunks)
        self.stage = _Stage(setup, batch, key, deterministic)
        self.params, self.ends, self.loss_scale = params, models.ends(params), loss_scale
        self.model, self.layout = setup.config.model, setup.local_layout
        # the dense() weights in the compute dtype, cast once for every round (each F and B
        # slot cast its chunk's float32 masters again: 1.8 GB a round at (2,2,2) on H100)
        dense, rest = models.split_dense(params["layers"])
        self.layers = models.merge_dense(_cast(dense, jnp.dtype(self.model.dtype)), rest)
        self.keep_activations = par.stash == "activations"
        self.split = self.rounds.split_backward
        self.probe = self._probe() if self.keep_activations or self.split else None

    def chunk_weights(self, chunk):
        """Chunk c's layers [Lc, ...], dense() weights already in the compute dtype."""
        return _chunk(self.layers, chunk)

    def vjp_weights(self, chunk):
        """(the chunk's weights as its backward closes over them, split: (dense() weights,
        the rest)). With unrolled layers a list of per-layer trees, sliced here, outside the
        vjp: the backward then closes over these very values, which Kept finds among the
        ones the B slot passes again (sliced inside, each layer's weights were kept in the
        stash as copies of their own, seen in the compiled H100 program)."""
        weights = self.chunk_weights(chunk)
        parts = models.split_dense(weights) if self.split else weights
        if models.scans_layers(self.model, self.layout):
            return parts
        return tuple(map(models.per_layer, parts)) if self.split else models.per_layer(parts)

    def layer_vjp(self, x, mb, chunk):
        """jax.vjp of the chunk's layers at x -> (y, backward, dense inputs, the weights it
        was given). Split: in (x, rest, perturbations), dense inputs taped; else in
        (weights, x), no dense inputs."""
        given = self.vjp_weights(chunk)
        if not self.split:
            y, backward = jax.vjp(lambda w, x: self.stage.layers(w, x, mb, chunk), given, x)
            return y, backward, None, jax.tree.leaves(given)
        dense, rest = given
        added = models.perturbations(self.chunk_weights(chunk), x, self.model, self.layout,
                                     self.stage.prepare)

        def layers(x, rest, added):
            merged = [models.merge_dense(d, r) for d, r in zip(dense, rest)] \
                if isinstance(rest, list) else models.merge_dense(dense, rest)
            return self.stage.layers(merged, x, mb, chunk, added)
        y, backward, inputs = jax.vjp(layers, x, rest, added, has_aux=True)
        return y, backward, inputs, jax.tree.leaves(given)

    def _probe(self):
        """Traces one chunk to fix what F keeps for B and B for W (XLA drops its compute)."""
        index = self.stage.rank * 0  # traced, like the slots' microbatch and chunk
        x = self.stage.buffer(1)[0]
        y, backward, inputs, given = self.layer_vjp(x, index, index)
        kept = Kept(backward, y, given) if self.keep_activations else None
        added = models.perturbations(self.chunk_weights(index), x, self.model, self.layout,
                                     self.stage.prepare)
        return kept, y, (inputs, added) if self.split else None

    def initial_carry(self):
        rounds, stage = self.rounds, self.stage
        kept, y, wkept = self.probe or (None, None, None)
        saved = ()
        if self.keep_activations:
            saved = _slots((kept.templates, y, wkept[0] if self.split else ()),
                           rounds.num_stash_slots)
        return {"stash": stage.buffer(rounds.num_stash_slots),
                "gbuf": stage.buffer(rounds.num_grad_slots), "saved": saved,
                "wsaved": _slots(wkept, rounds.num_w_slots) if self.split else (),
                "grads": jax.tree.map(jnp.zeros_like, self.params),
                "loss": mark_varying(jnp.zeros((), jnp.float32), (*BATCH, PIPE))}

    def forward(self, carry, row, valid, seg):
        """F: the stage's forward -> its output; keeps what B needs (activations mode)."""
        mb, chunk, slot = row["f_mb"], _chunk_of(row, "f", self.v), row["f_slot"]
        x = self.stage.embed_or_input(self.ends, _read(carry["stash"], slot), mb, chunk,
                                      seg.piece("embed", "F"))
        if not self.keep_activations:
            return self.stage.layers(self.chunk_weights(chunk), x, mb, chunk), carry
        y, backward, inputs, given = self.layer_vjp(x, mb, chunk)
        kept = (self.probe[0].keep(backward, y, given), y, inputs if self.split else ())
        return y, {**carry, "saved": _write_tree(carry["saved"], slot, kept, valid)}

    def backward(self, carry, row, valid, seg):
        """B: the input gradient (sent to the previous stage) and the gradients of the ends
        and of the chunk (split: all but the dense() weights, whose W slot gets the taps)."""
        mb, chunk = row["b_mb"], _chunk_of(row, "b", self.v)
        x_in = _read(carry["stash"], row["b_slot"])
        is_last = self.stage.vstage(chunk) == self.stage.last
        g_loss = mark_varying(jnp.where(is_last, self.loss_scale, 0.0).astype(jnp.float32),
                              (*BATCH, PIPE))
        g_out = jnp.where(is_last, 0.0, _read(carry["gbuf"], row["b_grad_slot"]))
        if self.keep_activations:
            loss, g_ends, g_layers, g_x, taps = self._backward_kept(
                carry, row, x_in, g_out, g_loss, seg)
        else:
            loss, g_ends, g_layers, g_x, taps = self._backward_recomputed(
                x_in, mb, chunk, g_out, g_loss, seg)
        grads = carry["grads"]
        grads = {**{k: jax.tree.map(jnp.add, grads[k], g) for k, g in
                    _masked(g_ends, valid).items()},
                 "layers": _add_chunk(grads["layers"], chunk, _masked(g_layers, valid))}
        carry = {**carry, "grads": grads, "loss": carry["loss"] + _masked(loss, valid)}
        if self.split:
            carry["wsaved"] = _write_tree(carry["wsaved"], row["b_wslot"], taps, valid)
        return g_x.astype(x_in.dtype), carry

    def _backward_kept(self, carry, row, x_in, g_out, g_loss, seg):
        mb, chunk = row["b_mb"], _chunk_of(row, "b", self.v)
        residuals, y, inputs = _read_tree(carry["saved"], row["b_slot"])
        loss, head_vjp = jax.vjp(
            lambda e, y: self.stage.head(e, y, mb, chunk, seg.piece("head", "B")), self.ends, y)
        g_head, g_y = head_vjp(g_loss)
        given = jax.tree.leaves(self.vjp_weights(chunk))
        out = self.probe[0].run(g_out + g_y.astype(g_out.dtype), residuals, given)
        if self.split:
            g_x, g_layers, g_taps = out
        else:
            g_layers, g_x = out
        g_layers = models.stacked(g_layers)
        _, embed_vjp = jax.vjp(lambda e, x: self.stage.embed_or_input(
            e, x, mb, chunk, seg.piece("embed", "B")), self.ends, x_in)
        g_embed, g_x_in = embed_vjp(g_x)
        g_ends = jax.tree.map(jnp.add, g_head, g_embed)
        return loss, g_ends, g_layers, g_x_in, (inputs, g_taps) if self.split else None

    def _backward_recomputed(self, x_in, mb, chunk, g_out, g_loss, seg):
        """parallel.stash=inputs: the B slot takes the vjp of the whole stage at its input
        (split: in everything but the dense() weights, whose W slot gets the taps)."""
        weights = self.chunk_weights(chunk)
        dense, _ = models.split_dense(weights)

        def stage(ends, layers, x_in, added=None):
            x = self.stage.embed_or_input(ends, x_in, mb, chunk, seg.piece("embed", "B"))
            w = models.merge_dense(dense, layers) if self.split else layers
            out = self.stage.layers(w, x, mb, chunk, added)
            y, inputs = out if self.split else (out, None)
            return (self.stage.head(ends, y, mb, chunk, seg.piece("head", "B")), y), inputs

        if not self.split:
            (loss, _), backward, _ = jax.vjp(stage, self.ends, weights, x_in, has_aux=True)
            g_ends, g_layers, g_x = backward((g_loss, g_out))
            return loss, g_ends, g_layers, g_x, None
        added = models.perturbations(weights, x_in, self.model, self.layout,
                                     self.stage.prepare)
        rest = models.split_dense(weights)[1]
        (loss, _), backward, inputs = jax.vjp(stage, self.ends, rest, x_in, added, has_aux=True)
        g_ends, g_layers, g_x, g_taps = backward((g_loss, g_out))
        return loss, g_ends, g_layers, g_x, (inputs, g_taps)

    def weight(self, carry, row, valid, seg):
        """W: the dense() weights' gradients from what the microbatch's B kept."""
        inputs, g_taps = _read_tree(carry["wsaved"], row["w_slot"])
        chunk = _chunk_of(row, "w", self.v)
        dense, _ = models.split_dense(_chunk(self.params["layers"], chunk))
        g_dense = models.dense_weight_grads(dense, inputs, g_taps, self.layout,
                                            self.stage.prepare)
        grads = {**carry["grads"], "layers": _add_chunk(carry["grads"]["layers"],
                                                        chunk, _masked(g_dense, valid))}
        return None, {**carry, "grads": grads}


class _Evaluation:
    """The F slots of a forward-only schedule: embedding, layers and head, the loss summed."""

    def __init__(self, params, batch, setup):
        par = setup.config.parallel
        self.p, self.v, self.tensor = par.pipe, par.chunks, _message_split(setup)
        self.rounds = rounds_for(par.schedule, par.pipe, par.microbatches, par.chunks,
                                 forward_only=True)
        self.stage = _Stage(setup, batch, jax.random.key(0), deterministic=True)
        self.params, self.ends = params, models.ends(params)
        self.backward = self.weight = None  # their slots are 'off'

    def initial_carry(self):
        return {"stash": self.stage.buffer(self.rounds.num_stash_slots),
                "loss": mark_varying(jnp.zeros((), jnp.float32), (*BATCH, PIPE))}

    def forward(self, carry, row, valid, seg):
        mb, chunk = row["f_mb"], _chunk_of(row, "f", self.v)
        x = self.stage.embed_or_input(self.ends, _read(carry["stash"], row["f_slot"]), mb,
                                      chunk, seg.piece("embed", "F"))
        y = self.stage.layers(_chunk(self.params["layers"], chunk), x, mb, chunk)
        loss = self.stage.head(self.ends, y, mb, chunk, seg.piece("head", "F"))
        return y, {**carry, "loss": carry["loss"] + _masked(loss, valid)}


def pipeline_grads(params, batch, key, loss_scale, *, setup, deterministic: bool,
                   reduce_chunk=None):
    """Pipelined local gradients; runs inside the step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns (gradient sums, loss sum) on this
    device, scaled to the global token mean (the loss is nonzero on the last stage's rank).
    reduce_chunk: given, each chunk's layer gradients [1, 1, Lc, ...] go to it between the
    scans as soon as the chunk is done (`chunks_done`), so its data-parallel reduction
    depends on no later round and runs beside them (Megatron's --overlap-grad-reduce);
    the layers' gradients returned are its results, concatenated over the chunks.
    """
    program = _Training(params, batch, key, loss_scale, setup, deterministic)
    done = chunks_done(program.rounds) if reduce_chunk is not None else ()
    reduced = {}

    def reduce_done(t, carry):  # the chunks done after round t
        for c in (c for c, d in enumerate(done) if d == t):
            reduced[c] = reduce_chunk(jax.tree.map(lambda g: g[c:c + 1],
                                                   carry["grads"]["layers"]))
    carry = _run(program, program.rounds, round_form(setup.config, setup.target.platform), "FBW", done, reduce_done)
    grads = carry["grads"]
    if reduce_chunk is not None:
        grads = {**grads, "layers": jax.tree.map(lambda *parts: jnp.concatenate(parts),
                                                 *(reduced[c] for c in range(program.v)))}
    return grads, carry["loss"]


def pipeline_loss(params, batch, *, setup):
    """Pipelined local loss of a forward pass alone (no dropout, no backward); runs inside
    the eval step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns this device's loss sum scaled to
    the global token mean (nonzero on the last stage's rank), as pipeline_grads does.
    """
    program = _Evaluation(params, batch, setup)
    return _run(program, program.rounds, round_form(setup.config, setup.target.platform), "F")["loss"]
