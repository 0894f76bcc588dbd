"""The lowering's slot bookkeeping (pipeline/lowering.py): the per-rank slot allocator, the
free stash and tape slots an idle F may write, whether every B (and W) reads a slot some F
wrote, and which zero-bubble B's run again for their W. Pure Python.
"""
from __future__ import annotations


class SlotPool:
    """Lowest-free-index slot allocator for one rank, tracking its size."""

    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
        else:
            slot, self.size = self.size, self.size + 1
        return slot

    def give(self, slot: int) -> None:
        self.free.append(slot)


def idle_f_slots(tab, kept, slots: int, field: str = "f_slot") -> bool:
    """Points every idle F (f_valid 0) at a stash slot that holds no kept values in its
    round: none an F wrote in an earlier round for a B in this one or later. Where each
    finds one (returned True), an F slot that runs masked on every rank may write what it
    keeps unmasked, garbage where it is idle: the masked write read the slot's old values
    first (at (2,2,2) 1F1B enough of them at once to make the step's peak:
    BENCHMARKS.md). Fills those f_slots (kept: (rank, slot, F's round, B's round)); with
    field "f_tslot" the tape slots (kept: `tape_lifetimes`, a W's round for a B's)."""
    found = True
    for t, row in enumerate(tab["f_valid"]):
        for r, valid in enumerate(row):
            if not valid:
                live = {slot for rank, slot, f, b in kept if rank == r and f < t <= b}
                free = [slot for slot in range(slots) if slot not in live]
                tab[field][t][r] = free[0] if free else 0
                found = found and bool(free)
    return found


def b_reads_written(tab, free: bool) -> bool:
    """Whether in every round each rank's B slot, an idle one included (a masked round
    form runs it on every rank), reads a stash slot that an F on its rank wrote in that
    round or before: a valid F, or with `free` (idle_f_slots) an idle one in a round where
    some rank's F is valid (every round form but cond runs it there, unmasked; cond runs
    no idle B). Where so, what F keeps needs no zeros to start from: an idle B's
    residuals are some earlier F's, finite, as its masked cotangent needs."""
    return _reads_written(tab, "f_slot", "b_slot",
                          lambda t, valid: valid or (free and any(tab["f_valid"][t])),
                          lambda t: True)


def _reads_written(tab, written_field: str, read_field: str, writes, reads) -> bool:
    """Whether in every round where `reads(t)`, each rank's slot `read_field` is one that
    its F's wrote at `written_field` in that round or before, an F counting where
    `writes(t, f_valid)`."""
    written = [set() for _ in tab["f_valid"][0]]
    for t, row in enumerate(tab["f_valid"]):
        for r, valid in enumerate(row):
            if writes(t, valid):
                written[r].add(tab[written_field][t][r])
        if reads(t) and any(tab[read_field][t][r] not in written[r] for r in range(len(row))):
            return False
    return True


def reruns(packed: list) -> set:
    """(rank, microbatch, chunk) of each zero-bubble W that runs in a later round than its
    B, in a round where the rank's B slot is free and another rank's is not: that B runs
    again there (b_again), from
    the stash and grad slots its input and output gradient keep until then, and hands what
    it keeps to the W in the round, so no W slot holds it in between (the first B sends
    the input gradient, the second adds nothing to the gradients or the loss). Masked
    rounds run the B slot on every rank where some rank runs it: the second B costs no
    time there (zb-h1's rank r runs the W's of its first r B's after its last B)."""
    done, again = {}, set()
    for t, row in enumerate(packed):
        some_b = any(ba for _, ba, _ in row)  # (else the second B would cost a round's B)
        for r, (_, ba, wa) in enumerate(row):
            if ba:
                done[(r, ba.microbatch, ba.chunk)] = t
            if wa and ba is None and some_b and done[(r, wa.microbatch, wa.chunk)] < t:
                again.add((r, wa.microbatch, wa.chunk))
    return again


def w_reads_written(tab) -> bool:
    """Whether in every round where some rank's W slot runs, each rank's W slot, an idle
    one included (the masked round forms run it), reads a tape slot that a valid F on its
    rank wrote in that round or before. Where so, the tapes need no zeros to start from:
    an idle W's dense inputs are some earlier F's, finite, as its masked output gradients
    need (zeroed, the tape buffers were a fill of every slot a step)."""
    return _reads_written(tab, "f_tslot", "w_tslot", lambda t, valid: valid,
                          lambda t: any(tab["w_valid"][t]))


def tape_lifetimes(tab) -> list:
    """(rank, tape slot, F's round, its W's round) of every valid F (zero-bubble kinds)."""
    lives = []
    for t, row in enumerate(tab["f_valid"]):
        for r in (r for r, valid in enumerate(row) if valid):
            slot = tab["f_tslot"][t][r]
            w = next(u for u in range(t, len(tab["w_valid"]))
                     if tab["w_valid"][u][r] and tab["w_tslot"][u][r] == slot)
            lives.append((r, slot, t, w))
    return lives
