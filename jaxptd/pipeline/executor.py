"""The pipeline executor: a validated schedule's lockstep rounds, run inside the step's
fully manual shard_map, with stage-to-stage traffic through `lax.ppermute` over 'pipe'.

Owns how a schedule becomes computation. `lowering.lower` gives, for every round t and pipe
rank r, at most one forward (F slot), one backward (B slot) and one weight-gradient (W
slot, zero-bubble kinds) with the buffer slots they use. A round, read top to bottom in
`_round`, is

    send the previous round's input gradient to r-1 -> F slot -> send its output to r+1
      -> store the gradient that arrived -> B slot -> W slot -> store the output that arrived

A zero-bubble B whose W runs in the same round hands what it keeps for it to the W through
the carry (weight_slot.HANDED), not through a W slot. Nothing in a round reads what is sent
in it: an output travels beside the round's B and W slots and is stored at the end of the
round (messages.py); an input gradient, made at the end of a B slot, is carried into the
next round and sent at its start, so it travels beside that round's F slot (sent at the end
of its own round, it had nothing to overlap: a loop iteration ends with its sends done), and
stored before the B slot that reads it. With chunks (interleaved kinds) a message is stored
only once the slot before the store has made its output (`messages.stored_after`), so that
XLA keeps the transfer in flight across that slot's last GEMMs (V-shaped, an arrived stage
input waits for the round's gradient sums too: the round's W reads the old stash, and XLA
copied the whole stash to keep it); the kept backward a layer at a time (training.py) makes
the middle layer of the slot a message travels beside wait for it (the carry's
training.IN_FLIGHT during the slot), and so does a recomputed stage (stash=inputs,
`_steady_recomputed`), whose messages are also stored only once the slot they travelled
beside has made its output. The last round's input gradient is never sent: no later B slot
reads it. A `lax.scan` runs the rounds of each segment, two a step where zb-v's chunks are
static (static_chunks).

Round forms (parallel.round_form; `segments`):
- cond (the CPU default): every slot, the embedding and the head are a `lax.cond` on the
  rank's row of the tables, so idle work is skipped (simulated devices share the cores);
  no slot buffer passes through a slot's conditional whole (`_conditional`);
- steady (the GPU default): no conditional at all. Rounds in which the same slot kinds are used
  by every rank, by some or by none run as one scan: a kind every rank uses runs
  unconditionally, one some ranks use runs masked on every rank (its results discarded where
  idle), one no rank uses is not traced; the embedding is computed by every rank and selected
  in a scan where some round needs it, and so is the head, or where the microbatch's rows split
  over the ranks each runs it on its part of the last stage's rows (training.py, head.py; the
  tables' head_on and head_mb). On a GPU the ranks run in lockstep, so a round lasts as long as
  its busiest rank's work whatever the idle ones do, while an XLA:GPU conditional outside a
  CUDA graph copies its predicate to the host (XLA records conditionals into graphs only for a
  driver it knows takes them, which a compile without a GPU never does), and the cond form does
  not spread the head: read per rank from its compiled branches, it is slower than steady at
  the papers' depth (bench/cond_rounds.py; figures: the git log);
- masked: no conditional anywhere; an idle slot computes and its results are discarded.

The backward is driven by the schedule, not by autodiff through the loop: what F keeps for B
(parallel.stash) and the zero-bubble split of B and W are training.py's; the embedding and head
pieces of a virtual stage stage.py's; the buffers and sends buffers.py's. The tied embedding's
two gradient contributions (first and last stage) meet in the step's exchange between those two
ranks.

Evaluation (`pipeline_loss`) runs the schedule's forwards alone (`schedules.forward_only`):
rounds of one F slot and one ppermute, no vjp, and a stash slot freed as soon as its forward
has read it: v m + p - 1 rounds for m >= p and a stash of 2 slots for v = 1.

Scatter/gather (PTD-P §4.1): a stage output is the same on every tensor rank, so each
tensor rank sends only its 1/t slice of the hidden dimension (buffers.send).

Parameters: each layer leaf is [v, 1, L/(p v), ...] on a device (chunks, this rank's stage,
layers of the chunk); virtual stage c*p + r runs chunk c on rank r, or for a V-shaped schedule
(zb-v) r and 2p - 1 - r (schedules.virtual_stage): its messages go up or down the ranks by
chunk, or stay on rank p - 1 at the turn, so each is sent both ways and each rank stores what
arrives from either side where the tables' two channels say (buffers.send, `messages.store`)."""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.hlo.cost import ROUNDS_SCOPE
from jaxptd.pipeline import buffers, messages, schedules, static_chunks
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.evaluation import Evaluation
from jaxptd.pipeline.lowering import Rounds, lower
from jaxptd.pipeline.scans import Segment, chunks_done, ends_of, head_rows, round_costs, segments
from jaxptd.pipeline.training import IN_FLIGHT, WRITES_AFTER, Training
from jaxptd.pipeline.weight_slot import HANDED
from jaxptd.parallel.varying import zeros_as

# the carry's B message of the previous round ({x, valid, slot}: what it is and where it
# is stored), sent at the start of the next round (see the module docstring)
PENDING = "pending"
SLOT_FIELDS = {
    "F": ("f_valid", "f_mb", "f_chunk", "f_slot", "f_tslot", "recv_f_slot", "recv_f2_slot",
          "recv_f2_valid"),
    "B": ("b_valid", "b_mb", "b_chunk", "b_slot", "b_grad_slot", "b_wslot", "b_keeps",
          "b_again", "b_stores", "recv_b_slot", "recv_b2_slot", "recv_b2_valid"),
    "W": ("w_valid", "w_mb", "w_chunk", "w_slot", "w_now", "w_tslot"),
}


@lru_cache(maxsize=32)
def rounds_for(kind: str, stages: int, microbatches: int, chunks: int, form: str,
               forward_only: bool = False) -> Rounds:
    """The lowered rounds of a schedule (training, or its forwards alone for evaluation),
    packed for the round form that runs them (`round_costs`: where zero-bubble W's go)."""
    costs = round_costs(form)
    schedule = schedules.make_schedule(kind, stages, microbatches, chunks, costs)
    return lower(schedules.forward_only(schedule) if forward_only else schedule, costs)


# --------------------------------------------------------------------------- rounds


def _tables(rounds: Rounds, rank, kinds: str, seg: Segment, period: int = 1) -> dict:
    """This rank's rows of the segment's tables: a dict of int32 [stop - start] arrays
    ([(stop - start) / period, period] for a body unrolled over `period` rounds); with B
    slots also the last rank's head_on and head_mb (`scans.head_rows`, which a spread
    head reads; XLA drops them where nothing does)."""
    names = [n for k in kinds for n in SLOT_FIELDS[k]]
    rows = {n: jnp.asarray(getattr(rounds, n)[seg.start:seg.stop], jnp.int32)[:, rank]
            for n in names}
    if "B" in kinds:
        rows.update({n: jnp.asarray(column, jnp.int32)
                     for n, column in head_rows(rounds, seg.start, seg.stop).items()})
    return rows if period == 1 else {n: x.reshape(-1, period) for n, x in rows.items()}


def _run_slot(mode, fn, carry, row, valid_field, seg, idle_message):
    """One slot in its mode -> (message or None, carry). fn(carry, row, valid, seg); an
    idle rank of a conditional slot sends `idle_message` (zeros, or None for W)."""
    if mode == "off":
        return None, carry
    if mode == "run":
        return fn(carry, row, True, seg)
    if mode == "mask":
        return fn(carry, row, row[valid_field] > 0, seg)
    return _conditional(fn, carry, row, valid_field, seg, idle_message)


# The name scope of a conditional slot: SLOT_SCOPE + 'f', 'b' or 'w'.
SLOT_SCOPE = "slot_cond_"
# The carry's slot buffers; those each slot kind (by its valid field) writes, by the
# table field that indexes its slot there and the fields that must be set too for it to
# write (a B keeps its taps in its W slot only where its W is a later round's: b_keeps).
SLOT_BUFFERS = ("stash", "gbuf", "saved", "tapes", "wsaved")
SLOT_WRITES = {"f_valid": {"saved": ("f_slot",), "tapes": ("f_tslot",)},
               "b_valid": {"wsaved": ("b_wslot", "b_keeps")}, "w_valid": {}}


def _conditional(fn, carry, row, valid_field, seg, idle_message):
    """A slot as a `lax.cond` on the rank's row -> (message, carry). No slot buffer passes
    through the conditional: each one the slot writes (SLOT_WRITES) is a one-slot buffer of
    zeros inside it, which the slot's writes at the table's index land in (a dynamic
    update's start index is clamped: any index of a one-slot buffer is 0), and which comes
    out to be stored where the slot wrote; the buffers it reads go in whole and stay out of
    its results. A buffer that passed through was copied whole in the conditional's
    branches on XLA:GPU, each buffer of the carry, every time the slot ran (the git log
    has the figures). The rest of the carry (gradient sums, loss) passes through."""
    writes = {k: fields for k, fields in SLOT_WRITES[valid_field].items() if k in carry}
    shapes = jax.eval_shape(lambda: {k: jax.tree.map(lambda b: b[:1], carry[k])
                                     for k in writes})
    rest = {k: x for k, x in carry.items() if k not in writes}

    def results(out):
        return {k: x for k, x in out.items() if k not in SLOT_BUFFERS or k in writes}

    def taken(rest, row):
        message, out = fn({**rest, **zeros_as(shapes)}, row, True, seg)
        return message, results(out)

    def idle(rest, _):
        return idle_message, results({**rest, **zeros_as(shapes)})
    with jax.named_scope(SLOT_SCOPE + valid_field[0]):  # (bench/cond_rounds.py reads it)
        message, out = lax.cond(row[valid_field] > 0, taken, idle, rest, row)
    stored = {}
    for k, (index, *also) in writes.items():
        wrote = row[valid_field] > 0
        for field in also:
            wrote = wrote & (row[field] > 0)
        stored[k] = jax.tree.map(lambda b, v, i=row[index], w=wrote: buffers.write(
            b, i, v[0], w), carry[k], out[k])
    return message, {**carry, **out, **stored}


def _steady_recomputed(program, seg) -> bool:
    """Whether the segment's slots are a recomputed stage's (training.recomputes: stash=
    inputs, unrolled layers) that every rank runs (F and B), whose middle layer then waits
    for the message in flight beside it (its attention output projection). Stored as they
    came, XLA gathered a message over tensor and stored it at the top of the round, where
    the received gradient's fused select and the B slot's read of its input went too, and
    started and finished both transfers back to back; held, and stored late (the round's
    `late`), in the H100 compile of GPT-1.3B at (2,2,2) stash=inputs, every steady send
    has attention or a GEMM in flight, where none had, and the step takes less time and
    memory. In the warm-up and cool-down rounds too, it computed one stage forward more
    (figures: BENCHMARKS.md and the git log)."""
    return getattr(program, "recomputes", False) and seg.modes[:2] == ("run", "run")


def _run_beside(message, mode, fn, carry, row, valid_field, seg, idle_message):
    """_run_slot with `message` (in flight beside the slot; None: nothing waits for it)
    in its carry (training.IN_FLIGHT), taken out of the carry again after the slot."""
    if message is None:
        return _run_slot(mode, fn, carry, row, valid_field, seg, idle_message)
    out, carry = _run_slot(mode, fn, {**carry, IN_FLIGHT: message}, row, valid_field, seg,
                           idle_message)
    return out, {k: x for k, x in carry.items() if k != IN_FLIGHT}


def _round(program, seg: Segment):
    """The scan body of a segment: the slots of `program` in order, then the arrivals."""
    p, v, tensor = program.p, program.v, program.tensor
    v_shape = program.rounds.v_shape  # messages both ways (buffers.send, messages.store)
    wait = v > 1  # messages.stored_after: the interleaved kinds (and zb-v)
    by_layer = getattr(program, "by_layer", False)
    # the slots wait for the message in flight beside them: the kept backward a layer at
    # a time, or a recomputed stage; elsewhere nothing reads it (a conditional slot would
    # take it as an operand, and wait for it)
    held = by_layer or _steady_recomputed(program, seg)
    # late: in the rounds where every rank runs F and B, unless the kept backward a layer at
    # a time holds them itself, the messages are stored only once the slot they travelled
    # beside has made its output (varying.waiting: the message waits, not just the slot it
    # is stored at, which stored_after's wait leaves XLA free to gather and store it
    # early), so that a transfer's done, which XLA's latency-hiding scheduler puts just
    # before what reads it, lands past that slot's last GEMMs. In the H100 compile of
    # GPT-1.3B at (2,2,2) 1F1B (the chunk's kept vjp, no sequence parallelism) every steady
    # send has a GEMM in flight with it (XLA's attention too), where some had none without,
    # at about the same time and memory. Where the sends were all overlapped already (zb-h1,
    # interleaved, zb-interleaved) it costs a little time a step (the select's pass over
    # the message); on the kept backward a layer at a time, memory, so not there (figures:
    # BENCHMARKS.md and the git log).
    late = seg.modes[:2] == ("run", "run") and not by_layer
    merged_f, merged_b = messages.merged(program.rounds, seg)  # V-shaped pairs as one

    def one_round(carry, row):
        idle = program.stage.buffer(1)[0]  # [b, s, h] zeros: what an idle F or B sends
        carry = dict(carry)
        pending = carry.pop(PENDING, None)  # the previous round's B output, sent now
        sent_b = None if pending is None else buffers.send(pending["x"], p, v, -1, tensor,
                                                           v_shape)
        y, carry = _run_beside(sent_b if held else None, seg.modes[0], program.forward,
                               carry, row, "f_valid", seg, idle)
        sent_f = None if y is None else buffers.send(y, p, v, 1, tensor, v_shape)
        carry = dict(carry)
        if sent_b is not None:  # stored after the F slot it travelled beside, for this B
            carry["gbuf"] = messages.store(carry["gbuf"], sent_b, pending,
                                           y if wait else None, y if late else None, tensor,
                                           merged_b)
        if seg.modes[2] != "off" and seg.taps[1] != "slot":  # B hands its taps to W
            carry[HANDED] = program.handover()
        g_x, carry = _run_beside(sent_f if held else None, seg.modes[1], program.backward,
                                 carry, row, "b_valid", seg, idle)
        _, carry = _run_slot(seg.modes[2], program.weight, carry, row, "w_valid", seg, None)
        # what arrived, stored last: no slot of the round waits for it
        carry = {k: x for k, x in carry.items() if k != HANDED}
        if sent_f is not None:
            arrivals = {k.removeprefix("recv_f"): x for k, x in row.items()
                        if k.startswith("recv_f")}  # {'_slot', V-shaped '2_slot', '2_valid'}
            done = (g_x, carry["grads"]["layers"]) if v_shape else g_x if late else None
            carry["stash"] = messages.store(carry["stash"], sent_f, arrivals,
                                            g_x if wait else None, done, tensor, merged_f)
        if pending is not None:
            carry[PENDING] = messages.pending(g_x, idle, row, messages.spare(program.rounds),
                                              v_shape)
        return carry, None
    return one_round


def _run(program, rounds: Rounds, form: str, kinds: str, cuts=(), at_cut=None):
    """Runs every segment's scan over the program's carry; returns the final carry.
    cuts: rounds after which the scans are cut and at_cut(round, carry) is called."""
    carry = program.initial_carry()
    if "gbuf" in carry:  # nothing pending before the first round
        carry[PENDING] = messages.pending(None, program.stage.buffer(1)[0], None,
                                          messages.spare(rounds), rounds.v_shape)
    swaps = getattr(program, "swaps", None)
    held = static_chunks.round_chunks(rounds, swaps) if swaps else None
    for seg in segments(rounds, form, program.stage.context.headless):
        start = seg.start
        for stop in sorted({t for t in cuts if seg.start < t < seg.stop} | {seg.stop}):
            for a, b, phases in static_chunks.runs(held, start, stop):
                part = dataclasses.replace(seg, start=a, stop=b)
                with jax.named_scope(ROUNDS_SCOPE):  # the cost report's rounds phase
                    carry, _ = lax.scan(_unrolled(program, part, phases, rounds), carry,
                                        _tables(rounds, program.stage.rank, kinds, part,
                                                len(phases)))
            if stop in cuts:
                at_cut(stop, carry)
            start = stop
    return carry


def _unrolled(program, seg: Segment, phases, rounds: Rounds):
    """The scan body of rounds in `phases` (static_chunks.runs): one round a phase, each
    with its held chunks static where the phase names them, and the embedding and head
    where its own rounds need them (zb-v's head: one phase of two)."""
    bodies = [_round(program, dataclasses.replace(seg, chunks=phase, ends=seg.ends & ends_of(
        rounds, range(seg.start + i, seg.stop, len(phases))))) for i, phase in enumerate(phases)]
    if len(bodies) == 1:
        return bodies[0]

    def rounds(carry, rows):  # rows: the tables [phases]
        for i, body in enumerate(bodies):
            # (each round's F writes wait for the sums the round before added to, the
            # first round's too, across XLA's double buffering of the loop: so that the B
            # and W there read those buffers first; left free, XLA read some after the
            # next round's writes and copied each such buffer whole)
            before = {WRITES_AFTER: carry["grads"]["layers"]}
            carry, _ = body({**carry, **before}, {k: x[i] for k, x in rows.items()})
            carry = {k: x for k, x in carry.items() if k != WRITES_AFTER}
        return carry, None
    return rounds


# --------------------------------------------------------------------------- programs


def pipeline_grads(params, batch, key, loss_scale, norm, *, context: Context,
                   deterministic: bool, reduce_chunk=None):
    """Pipelined local gradients; runs inside the step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]; norm: the loss's normalisation (the
    step's loss_norm, 1 / the global batch's counted targets). Returns (gradient sums, loss
    sum, statistics) on this device, the loss and its gradients scaled by norm (nonzero on
    the last stage's rank); statistics: the mixture of experts' sums over this rank's
    microbatches for its layers [v, 1, Lc, ...] (None: a dense model).
    reduce_chunk: given, each chunk's layer gradients [1, 1, Lc, ...] go to it between the
    scans as soon as the chunk is done (`chunks_done`), so its data-parallel reduction
    depends on no later round and runs beside them (Megatron's --overlap-grad-reduce);
    the layers' gradients returned are its results, concatenated over the chunks.
    """
    rounds = rounds_for(context.schedule, context.pipe, context.microbatches, context.chunks,
                        context.round_form)
    program = Training(context, rounds, params, batch, key, loss_scale, norm, deterministic)
    done = chunks_done(rounds) if reduce_chunk is not None else ()
    reduced = {}

    def reduce_done(t, carry):  # the chunks done after round t
        for c in (c for c, d in enumerate(done) if d == t):
            reduced[c] = reduce_chunk(jax.tree.map(lambda g: g[c:c + 1],
                                                   program.layer_grads(carry)))
    carry = _run(program, rounds, context.round_form, "FBW", done, reduce_done)
    grads = program.ends_grads(carry)
    if reduce_chunk is not None:
        grads = {**grads, "layers": jax.tree.map(lambda *parts: jnp.concatenate(parts),
                                                 *(reduced[c] for c in range(program.v)))}
    return grads, carry["loss"], carry["stats"]


def pipeline_loss(params, batch, norm, *, context: Context):
    """Pipelined local loss of a forward pass alone (no dropout, no backward); runs inside
    the eval step's shard_map.

    params: local shards (layers [v, 1, Lc, ...]), varying over data and pipe;
    batch: this data rank's rows [m * b, s + 1]. Returns this device's loss sum scaled by
    norm (nonzero on the last stage's rank), as pipeline_grads does.
    """
    rounds = rounds_for(context.schedule, context.pipe, context.microbatches, context.chunks,
                        context.round_form, forward_only=True)
    return _run(Evaluation(context, rounds, params, batch, norm), rounds, context.round_form,
                "F")["loss"]
