"""Lowering: a validated schedule's packed rounds -> the slot tables the executor runs.

Owns the buffers a pipeline needs and which slot of each every action uses. Pure Python.
`Rounds` tables are [T][p] tuples of ints (round t, rank r); unused entries are 0 (but an
idle F's f_slot and f_tslot: slots free of kept values and of tapes, slot_pool.idle_f_slots;
and an idle arrival's slot: its buffer's spare, `Rounds.spare`).
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
  message (arrivals are stored after the round's slots have read their inputs); on the
  last virtual stage the head's output gradient, from a B that runs again (b_stores)
  until that B runs again, which reads it instead of running the head;
- W (zero-bubble kinds): what a B keeps for its W (each weight matmul's output gradient,
  and with parallel.stash=inputs its input too) from the B until the W; none where the W
  runs in its B's round (w_now: handed over in the round, packing's `_take`) or its B
  runs again there;
- tape (zero-bubble kinds, used with parallel.stash=activations): each weight matmul's
  input as the F computed it, from the F until the W, so the B neither reads nor copies
  it (a slot taken by a round's F is not one its W frees); packed for masked rounds, one
  slot more where some idle F finds none free, so every idle F tapes unmasked (a masked
  tape write read the slot's old values first: figures in BENCHMARKS.md).
The stash the schedule reports (`peak_stash`) counts, per rank, the microbatch-stages held
at once: stash slots plus W slots, i.e. from arrival until the last backward piece.

How the rounds run as scans is scans.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxptd.pipeline.slot_pool import (SlotPool, b_reads_written, idle_f_slots, reruns,
                                       tape_lifetimes, w_reads_written)
from jaxptd.pipeline.schedules import (Costs, Schedule, format_grid, round_cells, stage_place,
                                       validate, virtual_stage)

TABLES = ("f_valid", "f_mb", "f_chunk", "f_slot", "b_valid", "b_mb", "b_chunk", "b_slot",
          "b_grad_slot", "b_wslot", "b_keeps", "b_again", "b_stores", "w_valid", "w_mb",
          "w_chunk", "w_slot", "w_now",
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
    b_stores: tuple  # the last stage's B that runs again keeps its output gradient (the
    # head's) in its grad slot b_grad_slot, where the second one reads it (no head again)
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

    def spare(self, buffer: str) -> int:
        """The slot past the last of the stash ('stash') or grad ('grad') slots, which
        every idle arrival's table points at (recv_*_slot where recv_*_valid is 0), so the
        executor stores every message that arrives unmasked, garbage in the spare where
        nothing did: a masked store read the slot's old value first and selected, two
        passes over the message more (figures: BENCHMARKS.md and the git log). Its
        buffer holds this many slots and one more; nothing reads the spare."""
        return self.num_stash_slots if buffer == "stash" else self.num_grad_slots

    def one_channel(self, kind: str, start: int, stop: int) -> bool:
        """Whether in rounds [start, stop) no rank receives a message of `kind` ('f', 'b')
        in both channels at once (recv_* and recv_*2)."""
        one, two = getattr(self, f"recv_{kind}_valid"), getattr(self, f"recv_{kind}2_valid")
        return not any(a and b for t in range(start, stop) for a, b in zip(one[t], two[t]))

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
    if split and costs.masked and not free_tapes:  # one tape slot more: each idle F has one
        size["tape"] += 1
        free_tapes = idle_f_slots(tab, tape_lifetimes(tab), size["tape"], "f_tslot")
    for channel in ("f", "f2", "b", "b2"):  # idle arrivals at the spare slot (Rounds.spare)
        spare = size["stash" if channel[0] == "f" else "grad"]
        for valid, slot in zip(tab[f"recv_{channel}_valid"], tab[f"recv_{channel}_slot"]):
            slot[:] = [s if ok else spare for ok, s in zip(valid, slot)]
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
        slots until then and takes none (on the last virtual stage it takes a grad slot
        for the head's output gradient: b_stores)."""
        j, s = ba.microbatch, self.schedule.stage(ba.chunk, r)
        hold = not again and (r, j, ba.chunk) in self.again
        slot = self.stash_of[(r, j, s)]
        stores = hold and s == self.stages - 1
        if stores:
            self.grad_of[(r, j, s)] = self.pools["grad"][r].take()
        grad_slot = self.grad_of.get((r, j, s), 0)  # (the last stage's, but kept: none)
        keeps = self.schedule.split_backward and keeps and not hold
        wslot = 0
        if keeps:
            self.w_of[(r, j, s)] = wslot = self.pools["w"][r].take()
        _put(self.tab, "b", t, r, ba, b_slot=slot, b_grad_slot=grad_slot, b_wslot=wslot,
             b_keeps=int(keeps), b_again=int(again), b_stores=int(stores))
        if hold:
            return
        self.kept.append((r, slot, self.kept_from.pop((r, j, s)), t))
        del self.stash_of[(r, j, s)]
        self.pools["stash"][r].give(slot)
        if self.grad_of.pop((r, j, s), None) is not None:
            self.pools["grad"][r].give(grad_slot)


def _put(tab, prefix, t, r, action, **slots) -> None:
    tab[f"{prefix}_valid"][t][r] = 1
    tab[f"{prefix}_mb"][t][r] = action.microbatch
    tab[f"{prefix}_chunk"][t][r] = action.chunk
    for name, value in slots.items():
        tab[name][t][r] = value
