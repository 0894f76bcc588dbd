"""Where a slot of a two-chunk schedule can name its chunk statically.

Owns the per-rank swap of a rank's two chunks and, per round and slot kind, the chunk (as
held, after the swap) that every rank using the kind runs. A slot whose chunk index is
traced (the tables' f_chunk, b_chunk, w_chunk vary by rank) copies its chunk's weights out
of the [v, 1, Lc, ...] stack before its GEMMs (XLA's GPU GEMMs read no dynamic slice in
place) and adds its gradients to the float32 sums at a dynamic index, a kernel of its own;
with a static index each held chunk's weights and sums are arrays of their own, which the
GEMMs read and add into (their epilogue).

A V-shaped schedule (zb-v) runs chunk (t + r + c) mod 2 on rank r in most rounds t: with
the chunks of odd ranks swapped, every rank runs the same held chunk, alternating round by
round, so the rounds' scan body unrolled over two rounds names it (`runs`). Interleaved
schedules' chunks change in groups of p rounds, shifted by one a rank: no swap makes them
agree, and they keep the traced index. Pure Python.
"""
from __future__ import annotations

KINDS = "fbw"
ANY = -1  # no rank runs the kind in the round: any chunk will do
_CLASH = "clash"  # two entries that no one entry matches (`_merge`)


def _held(rounds, t: int, kind: str, swap: tuple):
    """The held chunk every rank that runs `kind` in round t runs: an int, ANY (no rank
    runs it) or None (ranks differ)."""
    valid, chunk = getattr(rounds, f"{kind}_valid")[t], getattr(rounds, f"{kind}_chunk")[t]
    held = {chunk[r] ^ swap[r] for r in range(rounds.stages) if valid[r]}
    return ANY if not held else held.pop() if len(held) == 1 else None


def round_chunks(rounds, swap: tuple) -> list:
    """Per round, the (F, B, W) held chunks of `_held`."""
    return [tuple(_held(rounds, t, k, swap) for k in KINDS) for t in range(rounds.num_rounds)]


def _static_share(rounds, swap: tuple) -> float:
    """The share of the rounds' used slot kinds whose held chunk is static."""
    cells = [c for row in round_chunks(rounds, swap) for c in row if c != ANY]
    return sum(c is not None for c in cells) / max(len(cells), 1)


def swaps(rounds) -> tuple | None:
    """Per rank, 1 where it holds its two chunks swapped: none swapped, or the odd ranks,
    whichever makes more slots static; None where the schedule has not two chunks or fewer
    than half its used slot kinds would be static (the traced index everywhere)."""
    if rounds.chunks != 2:
        return None
    p = rounds.stages
    best = max([(0,) * p, tuple(r % 2 for r in range(p))],
               key=lambda s: _static_share(rounds, s))
    return best if _static_share(rounds, best) >= 0.5 else None


def _merge(a, b):
    """a and b as one phase entry (ANY matches anything) -> the entry, or _CLASH."""
    return b if a == ANY else a if b in (ANY, a) else _CLASH


def runs(chunks: list | None, start: int, stop: int) -> list:
    """Rounds [start, stop) as [(start, stop, phases)]: scans of (stop - start) / len(phases)
    iterations, each the rounds of `phases` in turn, phase i's (F, B, W) held chunks
    static (None: traced; ANY left: 0; chunks None, no held chunks: one phase of traced
    chunks). One phase where every round agrees; two where the rounds alternate and
    there are at least four (an odd first round a scan of its own); else one phase of
    traced chunks. A scan of one iteration is inlined, where XLA fused a round's writes
    with the next one's reads (kernels that read whole slot buffers): so no shorter runs
    of two phases, nor cuts of a scan into pieces."""
    if chunks is None:
        return [(start, stop, ((None,) * 3,))]
    rows = [list(chunks[t]) for t in range(start, stop)]
    phases = _periodic(rows, 1) or (_periodic(rows, 2) if len(rows) >= 4 else None)
    if phases is None:
        return [(start, stop, ((None,) * 3,))]
    phases = tuple(tuple(0 if c == ANY else c for c in p) for p in phases)
    if len(rows) % len(phases) == 0:
        return [(start, stop, phases)]
    # the odd round first: last, it was inlined before the rounds after it (the cool-down's
    # scans of one round), whose reads XLA then fused with its writes
    return [(start, start + 1, phases[:1]), (start + 1, stop, phases[1:] + phases[:1])]


def _periodic(rows: list, period: int):
    """The `period` phases every row keeps to (merged entries), or None."""
    phases = [[ANY] * 3 for _ in range(period)]
    for i, row in enumerate(rows):
        merged = [_merge(a, b) for a, b in zip(phases[i % period], row)]
        if _CLASH in merged:
            return None
        phases[i % period] = merged
    return phases
