"""Lowering: a validated schedule's packed rounds -> the slot tables the executor runs.

Owns the buffers a pipeline needs and which slot of each every action uses. Pure Python.
`Rounds` tables are [T][p] tuples of ints (round t, rank r); unused entries are 0 (but an
idle F's f_slot and f_tslot: slots free of kept values and of tapes, slot_pool.idle_f_slots).
Per round and rank: an F slot (microbatch, chunk, the stash slot of its input, and with
zero-bubble kinds the tape slot it fills), a B slot (its input's stash slot, the grad slot
of its output gradient, and with zero-bubble kinds the W slot it fills), a W slot (the W
and tape slots it empties), and the messages that arrive at the end of the round
(activations into a stash slot, gradients into a grad slot, each with the rank it comes
from: a V-shaped schedule's go both ways, in two channels, and its turn on rank p - 1 to
the rank itself).

Slot lifetimes (lowest free index first; a slot freed in round t is reusable from t + 1
unless said otherwise):
- stash: a stage input from its arrival (virtual stage 0: from its forward) until its B
  (forward-only: until its F), or until that B runs again for its W (b_again,
  slot_pool.reruns: packed for masked rounds, a W in a later round where the rank's B slot
  is free and another's is not);
- grad: an incoming output gradient from its arrival until the B that reads it (the
  last, where it runs again); a grad slot freed by round t's B may receive round t's
  message (arrivals are stored after the round's slots have read their inputs);
- W (zero-bubble kinds): what a B keeps for its W (each weight matmul's output gradient,
  and with parallel.stash=inputs its input too) from the B until the W; none where the W
  runs in its B's round (w_now: handed over in the round, packing's `_take`) or its B
  runs again there;
- tape (zero-bubble kinds, used with parallel.stash=activations): each weight matmul's
  input as the F computed it, from the F until the W, so the B neither reads nor copies
  it (a slot taken by a round's F is not one its W frees).
The stash the schedule reports (`peak_stash`) counts, per rank, the microbatch-stages held
at once: stash slots plus W slots, i.e. from arrival until the last backward piece.

Also how the rounds run as scans (`segments`: per round form, see jaxptd/pipeline/
executor.py) and the round by which each chunk's gradients are complete (`chunks_done`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxptd.arch import family
from jaxptd.pipeline.slot_pool import (SlotPool, b_reads_written, idle_f_slots, reruns,
                                       tape_lifetimes, w_reads_written)
from jaxptd.pipeline.schedules import (Costs, Schedule, format_grid, round_cells, stage_place,
                                       validate, virtual_stage)

TABLES = ("f_valid", "f_mb", "f_chunk", "f_slot", "b_valid", "b_mb", "b_chunk", "b_slot",
          "b_grad_slot", "b_wslot", "b_keeps", "b_again", "w_valid", "w_mb", "w_chunk",
          "w_slot", "w_now",
          "f_tslot", "w_tslot", "recv_f_valid", "recv_f_slot", "recv_f2_valid",
          "recv_f2_slot", "recv_b_valid", "recv_b_slot", "recv_b2_valid", "recv_b2_slot")


@dataclass(frozen=True)
class Rounds:
    """Lockstep tables, each [num_rounds][stages] of ints (see module docstring)."""
    num_rounds: int
    stages: int
    chunks: int
    microbatches: int
    f_valid: tuple
    f_mb: tuple
    f_chunk: tuple
    f_slot: tuple
    b_valid: tuple
    b_mb: tuple
    b_chunk: tuple
    b_slot: tuple
    b_grad_slot: tuple
    b_wslot: tuple
    b_keeps: tuple  # the B fills its W slot b_wslot
    b_again: tuple  # the B runs again for its W (slot_pool.reruns): it adds nothing
    w_valid: tuple
    w_mb: tuple
    w_chunk: tuple
    w_slot: tuple
    w_now: tuple
    f_tslot: tuple
    w_tslot: tuple
    recv_f_valid: tuple
    recv_f_slot: tuple
    recv_f2_valid: tuple
    recv_f2_slot: tuple
    recv_b_valid: tuple
    recv_b_slot: tuple
    recv_b2_valid: tuple
    recv_b2_slot: tuple
    num_stash_slots: int
    num_grad_slots: int
    num_w_slots: int
    num_tape_slots: int
    v_shape: bool  # chunks placed in a V (schedules.virtual_stage)
    idle_f_slots_free: bool  # every idle F's f_slot holds no kept values (idle_f_slots)
    b_reads_written: bool  # every B slot reads a stash slot an F wrote (b_reads_written)
    w_reads_written: bool  # every W slot reads a tape slot an F wrote (w_reads_written)
    idle_f_tslots_free: bool  # likewise (idle_f_slots) every idle F's f_tslot
    forward_only: bool
    split_backward: bool
    packed: tuple  # per round, per rank: (F, B, W) actions or None (schedules.pack_rounds)

    def stage(self, chunk: int, rank: int) -> int:
        """The virtual stage of a rank's chunk (schedules.virtual_stage)."""
        return virtual_stage(self.v_shape, self.stages, chunk, rank)

    def grid(self) -> str:
        """Rank x round text grid: each round shows its F, B (and W) slots."""
        return format_grid(round_cells(self.packed, self.chunks), "round")

    def peak_stash(self) -> list:
        """Per rank: most microbatch-stages held at once (see module docstring)."""
        peaks = []
        for r in range(self.stages):
            live = peak = 0
            for t in range(self.num_rounds):
                stage0 = self.f_valid[t][r] and r == 0 and self.f_chunk[t][r] == 0
                live += stage0 + self.recv_f_valid[t][r] + self.recv_f2_valid[t][r]
                peak = max(peak, live)
                done = self.f_valid if self.forward_only else \
                    self.w_valid if self.split_backward else self.b_valid
                live -= done[t][r]
            peaks.append(peak)
        return peaks


def lower(schedule: Schedule, costs: Costs = Costs()) -> Rounds:
    """Validates and packs a schedule (costs place zero-bubble W's), then assigns stash,
    grad and W slots.

    Returns: Rounds with [T][p] tables. Raises: ScheduleError (validate's).
    """
    packed = validate(schedule, costs)
    p, v, T = schedule.stages, schedule.chunks, len(packed)
    split = schedule.split_backward and not schedule.forward_only
    lowering = _Lowering(schedule, T, reruns(packed) if costs.masked and split else set())
    for t, row in enumerate(packed):
        lowering.lower_round(t, row)
    tab, pools = lowering.tab, lowering.pools
    size = {k: max(pool.size for pool in pools[k]) for k in pools}
    free = not schedule.forward_only and idle_f_slots(tab, lowering.kept, size["stash"])
    free_tapes = split and idle_f_slots(tab, tape_lifetimes(tab), size["tape"], "f_tslot")
    frozen = {k: tuple(tuple(x) for x in rows) for k, rows in tab.items()}
    return Rounds(T, p, v, schedule.microbatches, **frozen, num_stash_slots=size["stash"],
                  num_grad_slots=size["grad"], num_w_slots=size["w"],
                  num_tape_slots=size["tape"], v_shape=schedule.v_shape,
                  idle_f_slots_free=free,
                  b_reads_written=not schedule.forward_only and b_reads_written(tab, free),
                  w_reads_written=split and w_reads_written(tab), idle_f_tslots_free=free_tapes,
                  forward_only=schedule.forward_only,
                  split_backward=schedule.split_backward, packed=tuple(map(tuple, packed)))


class _Lowering:
    """lower's walk over the packed rounds, a round at a time (`lower_round`): the tables it
    fills, a slot pool per rank and kind, and which slot holds what of (rank, microbatch,
    virtual stage), as the module docstring's lifetimes say."""

    def __init__(self, schedule: Schedule, rounds: int, again: set):
        p = schedule.stages
        self.schedule, self.p, self.stages = schedule, p, p * schedule.chunks
        self.tab = {k: [[0] * p for _ in range(rounds)] for k in TABLES}
        self.pools = {k: [SlotPool() for _ in range(p)] for k in ("stash", "grad", "w", "tape")}
        self.again = again  # (rank, mb, chunk) of the B's that run again for their W
        self.stash_of, self.grad_of, self.w_of, self.tape_of = {}, {}, {}, {}  # -> slot
        # F's round of (rank, mb, virtual stage); (rank, slot, F's round, B's round)
        self.kept_from, self.kept = {}, []
        self.taped = schedule.split_backward and not schedule.forward_only

    def lower_round(self, t: int, row) -> None:
        """Round t's slots, row: each rank's (F, B, W) actions or None."""
        freed_w = []
        for r, (fa, _, _) in enumerate(row):  # F slot, then activation arrivals
            if fa:
                self._forward(t, r, fa)
        for r, (fa, _, _) in enumerate(row):  # forward-only: an input is done after its F
            if fa and self.schedule.forward_only:
                self.pools["stash"][r].give(
                    self.stash_of.pop((r, fa.microbatch, self.schedule.stage(fa.chunk, r))))
        for r, (_, ba, wa) in enumerate(row):  # B slot, then W slot
            now = bool(ba and wa) and (ba.microbatch, ba.chunk) == (wa.microbatch, wa.chunk)
            if ba:
                self._backward(t, r, ba, keeps=not now)
            if wa and (r, wa.microbatch, wa.chunk) in self.again:
                self._backward(t, r, wa, keeps=False, again=True)
                now = True
            if wa:
                key = (r, wa.microbatch, self.schedule.stage(wa.chunk, r))
                slot, tslot = self.w_of.pop(key, 0), self.tape_of.pop(key)  # (now: none)
                _put(self.tab, "w", t, r, wa, w_slot=slot, w_now=int(now), w_tslot=tslot)
                freed_w.append((r, None if now else slot, tslot))
        for r, (_, ba, _) in enumerate(row):  # gradient arrivals
            s = self.schedule.stage(ba.chunk, r) if ba else 0
            if s > 0:
                dst, key = self._rank_of(s - 1), (ba.microbatch, s - 1)
                self.grad_of[(dst,) + key] = slot = self.pools["grad"][dst].take()
                self._receive("b", t, r, dst, slot)
        for r, slot, tslot in freed_w:  # a W reads its slots after the round's B and F
            if slot is not None:  # (wrote theirs)
                self.pools["w"][r].give(slot)
            self.pools["tape"][r].give(tslot)

    def _receive(self, kind: str, t: int, src: int, dst: int, slot: int) -> None:
        """Round t's message of `kind` ('f' or 'b') from rank src arrives at rank dst, in
        `slot`: recv_f_* from rank dst - 1 (the ring's wrap-around too), recv_b_* from
        dst + 1; V-shaped, a message the other way arrives apart, in recv_f2_* (from
        dst + 1) or recv_b2_* (from dst - 1), and the turn's on rank p - 1 (src = dst) in
        the channel no rank above uses there (recv_f2_*, recv_b_*)."""
        above = src >= dst if self.schedule.v_shape else kind == "b"
        channel = kind + ("" if above == (kind == "b") else "2")
        assert not self.tab[f"recv_{channel}_valid"][t][dst], "two arrivals in one channel"
        self.tab[f"recv_{channel}_valid"][t][dst] = 1
        self.tab[f"recv_{channel}_slot"][t][dst] = slot

    def _rank_of(self, stage: int) -> int:
        return stage_place(self.schedule.v_shape, self.p, stage)[1]

    def _forward(self, t: int, r: int, fa) -> None:
        """Rank r's F in round t: its input's stash slot (virtual stage 0: taken now), its
        tape slot, and the slot its output arrives in at the next rank."""
        j, s = fa.microbatch, self.schedule.stage(fa.chunk, r)
        if s == 0:
            self.stash_of[(r, j, s)] = self.pools["stash"][r].take()
        tslot = 0
        if self.taped:
            self.tape_of[(r, j, s)] = tslot = self.pools["tape"][r].take()
        _put(self.tab, "f", t, r, fa, f_slot=self.stash_of[(r, j, s)], f_tslot=tslot)
        self.kept_from[(r, j, s)] = t
        if s < self.stages - 1:
            dst = self._rank_of(s + 1)
            self.stash_of[(dst, j, s + 1)] = slot = self.pools["stash"][dst].take()
            self._receive("f", t, r, dst, slot)

    def _backward(self, t: int, r: int, ba, keeps: bool, again: bool = False) -> None:
        """Rank r's B in round t: frees its input's stash slot and its output gradient's
        grad slot, takes a W slot (zero-bubble kinds, keeps: its W is a later round's),
        but for a B that runs again for its W (`again`): the first time it holds both
        slots until then and takes none."""
        j, s = ba.microbatch, self.schedule.stage(ba.chunk, r)
        hold = not again and (r, j, ba.chunk) in self.again
        slot = self.stash_of[(r, j, s)]
        grad_slot = self.grad_of[(r, j, s)] if s < self.stages - 1 else 0
        keeps = self.schedule.split_backward and keeps and not hold
        wslot = 0
        if keeps:
            self.w_of[(r, j, s)] = wslot = self.pools["w"][r].take()
        _put(self.tab, "b", t, r, ba, b_slot=slot, b_grad_slot=grad_slot, b_wslot=wslot,
             b_keeps=int(keeps), b_again=int(again))
        if hold:
            return
        self.kept.append((r, slot, self.kept_from.pop((r, j, s)), t))
        del self.stash_of[(r, j, s)]
        self.grad_of.pop((r, j, s), None)
        self.pools["stash"][r].give(slot)
        if s < self.stages - 1:
            self.pools["grad"][r].give(grad_slot)


def _put(tab, prefix, t, r, action, **slots) -> None:
    tab[f"{prefix}_valid"][t][r] = 1
    tab[f"{prefix}_mb"][t][r] = action.microbatch
    tab[f"{prefix}_chunk"][t][r] = action.chunk
    for name, value in slots.items():
        tab[name][t][r] = value


# --------------------------------------------------------------------------- scans


@dataclass(frozen=True)
class Segment:
    """Rounds [start, stop) run by one scan. modes[k] for slot kind k in 'FBW': 'off' (no
    rank uses it: not traced, nothing sent), 'run' (every rank, every round), 'cond' or
    'mask' (some ranks). inline: the embedding and head are computed by every rank and
    selected, where `ends` says a slot needs them: ('embed', 'F') when some rank's F is
    virtual stage 0, ('embed', 'B'), ('head', 'B') (training) or ('head', 'F') likewise.
    taps: (whether some B keeps for a later W, in a W slot; whence W's read what their B
    kept: its 'slot', 'now' (handed over in the round: w_now) or 'either'; whether some B
    runs again for its W: b_again). chunks: the (F, B, W) held chunks, static (the
    executor's, static_chunks.runs) or None (the tables')."""
    start: int
    stop: int
    modes: tuple
    inline: bool
    ends: frozenset = frozenset()
    taps: tuple = (True, "slot", False)
    chunks: tuple = (None, None, None)

    def piece(self, name: str, slot: str) -> str:
        """How a slot runs the embedding or head: 'cond', 'inline' or 'off'."""
        return "cond" if not self.inline else "inline" if (name, slot) in self.ends else "off"


def round_form(config, platform: str) -> str:
    """parallel.round_form, with 'auto' resolved for the target's platform: cond on CPU,
    steady on a GPU."""
    form = config.parallel.round_form
    if form == "auto":
        return "steady" if platform == "gpu" else "cond"
    return form


def head_pieces(config, form: str) -> int:
    """How the last stage's microbatch [b, s] is dealt out when every pipe rank computes the
    head and loss of 1/p of it (pipeline/head.py): each row cut into k pieces of s/k
    tokens, the b k pieces split evenly over the p ranks; 0 where the head is not spread.

    Spread where every rank runs the head anyway (`form`: a round form without
    conditionals). k = 1 (whole rows) where p divides b; with fewer rows a row is cut
    (k = p / gcd(b, p)) where the head is token-wise (a decoder without context
    parallelism, whose rows are not whole on a rank) and k divides s into pieces that
    sequence parallelism can split over tensor again. Left whole, the head of b < p rows
    ran on every rank: the costliest kernels of a deep pipeline."""
    par, rows, seq = config.parallel, config.microbatch_size, config.model.seq_len
    if form == "cond" or par.pipe == 1:
        return 0
    if rows % par.pipe == 0:
        return 1
    k = par.pipe // math.gcd(rows, par.pipe)
    unit = par.tensor if par.sequence_parallel else 1
    tokenwise = not family(config.model).encoder and par.context == 1
    return k if tokenwise and seq % k == 0 and (seq // k) % unit == 0 else 0


def head_rows(rounds: Rounds, start: int, stop: int) -> dict:
    """Per round of [start, stop): whether the head's rank's B slot is the last virtual
    stage's (head_on), its microbatch (head_mb) and whether it runs again (head_again: its
    loss and gradients count nothing), which every rank reads when the head is spread (the
    same on every rank)."""
    chunk, last = stage_place(rounds.v_shape, rounds.stages, rounds.stages * rounds.chunks - 1)
    on = [int(rounds.b_valid[t][last] and rounds.b_chunk[t][last] == chunk)
          for t in range(start, stop)]
    return {"head_on": on, "head_mb": [rounds.b_mb[t][last] for t in range(start, stop)],
            "head_again": [rounds.b_again[t][last] for t in range(start, stop)]}


def round_costs(form: str) -> Costs:
    """How a round form's rounds cost (Costs.masked: every form but cond runs a slot kind
    some rank uses on every rank), uniform t_f = t_b = t_w: what the schedule is packed for
    (where zero-bubble W's go) and timed by."""
    return Costs(masked=form != "cond")


def _slot_state(valid_row) -> str:
    return "run" if all(valid_row) else "some" if any(valid_row) else "off"


def segments(rounds: Rounds, form: str) -> list:
    """Splits the rounds into scans for a round form (see the module docstring)."""
    tables = {k: getattr(rounds, f"{k.lower()}_valid") for k in "FBW"}
    used = tuple("off" if not any(map(any, tables[k])) else None for k in "FBW")
    if form != "steady":
        modes = tuple(u or ("cond" if form == "cond" else "mask") for u in used)
        everywhere = frozenset((n, k) for n in ("embed", "head") for k in "FB")
        return [Segment(0, rounds.num_rounds, modes, inline=form == "masked",
                        ends=everywhere, taps=_taps(rounds, range(rounds.num_rounds)))]
    runs = []  # [start, stop, slot states, pieces needed] of equal slot states
    for t in range(rounds.num_rounds):
        states = (*(_slot_state(tables[k][t]) for k in "FBW"), _taps(rounds, [t]))
        ends = ends_of(rounds, [t])
        if runs and runs[-1][2] == states:
            runs[-1][1], runs[-1][3] = t + 1, runs[-1][3] | ends
        else:
            runs.append([t, t + 1, states, ends])
    return [Segment(start, stop, tuple("mask" if s == "some" else s for s in states[:3]),
                    inline=True, ends=ends, taps=states[3])
            for start, stop, states, ends in runs]


def ends_of(rounds: Rounds, ts) -> frozenset:
    """Segment.ends of rounds ts: ('embed', k) where some rank's slot k is virtual stage 0,
    ('head', k) where some rank's is the last."""
    last = rounds.stages * rounds.chunks - 1
    return frozenset((name, k) for name, stage in (("embed", 0), ("head", last)) for k in "FB"
                     if any(getattr(rounds, f"{k.lower()}_valid")[t][r] and rounds.stage(
                         getattr(rounds, f"{k.lower()}_chunk")[t][r], r) == stage
                         for t in ts for r in range(rounds.stages)))


def _taps(rounds: Rounds, ts) -> tuple:
    """Segment.taps of rounds ts."""
    def some(table, now=None) -> bool:
        return any(table[t][r] and now in (None, rounds.w_now[t][r]) for t in ts
                   for r in range(rounds.stages))
    now, later = some(rounds.w_valid, 1), some(rounds.w_valid, 0)
    return (some(rounds.b_keeps), "either" if now and later else "now" if now else "slot",
            some(rounds.b_again))


def chunks_done(rounds: Rounds) -> tuple:
    """For each chunk, the round by which every rank has run its last B and W slot: from
    then on nothing adds to the chunk's gradients."""
    done = [0] * rounds.chunks
    for kind in "bw":
        valid, chunk = getattr(rounds, f"{kind}_valid"), getattr(rounds, f"{kind}_chunk")
        for t in range(rounds.num_rounds):
            for r in range(rounds.stages):
                if valid[t][r]:
                    done[chunk[t][r]] = max(done[chunk[t][r]], t + 1)
    return tuple(done)
