"""How a pipeline's lowered rounds run as scans (`segments`, per round form: see
jaxptd/pipeline/executor.py; where the rounds without the head are cut out,
`headless_stretch`), what the embedding and head need in them (`ends_of`, `head_pieces`,
`head_rows`; the rounds whose scans run the head, `head_rounds`), and the round by which
each chunk's gradients are complete (`chunks_done`).
Pure Python over lowering.Rounds and the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxptd.arch import family
from jaxptd.pipeline import static_chunks
from jaxptd.pipeline.lowering import Rounds
from jaxptd.pipeline.schedules import Costs, stage_place
from jaxptd.train.metrics import recomputed_flops


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


# Steady form: a stretch of at least this many rounds in which no rank runs the head (no
# B slot, forward-only no F slot, is the last virtual stage's) runs as a scan of its own,
# without it, though its slot kinds are those of the rounds around it. In the interleaved
# kinds the last stage's B slots come p rounds on, p off: every rank computed its part of
# the head in rounds that discard it (at p = 8, m = 32, 56 rounds for 32 heads). Shorter
# stretches stay: each scan is one more loop body to compile (figures: BENCHMARKS.md and
# the git log).
HEADLESS = 4
# ... and only where the head is at least this share of a steady round's matmul work
# (`headless_stretch`). Each cut is two more loops, and XLA packs their buffers apart: the
# step's temporary memory grows though what is live at its peak barely does. Where the
# head is a small part of a round (PTD-P's sizes) the cut saves less time than it costs
# memory (figures: BENCHMARKS.md and the git log).
HEAD_SHARE = 0.03


def headless_stretch(config, recompute: str) -> int:
    """The shortest stretch of rounds without the head that `segments` cuts out of a steady
    scan: HEADLESS, or 0 (none) where the head's part of a round (its forward and two
    backward matmuls over 1/p of a microbatch: the head spread) is under HEAD_SHARE of the
    stage's F and B (each layer's forward, its backward's two, what `recompute` runs again).
    Both are per token and split alike over tensor."""
    # the model's modules start JAX: imported on use, as the planner imports this module
    # before `python -m jaxptd.plan --verify` sets XLA_FLAGS (jaxptd/plan/verify.py)
    from jaxptd.model.registry import get
    model, par = config.model, config.parallel
    per_token = get(model).forward_flops(model, model.padded_vocab(par.tensor))
    layers = model.num_layers // (par.pipe * par.chunks)
    stage = layers * (3 * per_token["layer"] + recomputed_flops(model, per_token, recompute))
    return HEADLESS if 3 * per_token["head"] / par.pipe >= HEAD_SHARE * stage else 0


def segments(rounds: Rounds, form: str, headless: int = HEADLESS) -> list:
    """Splits the rounds into scans for a round form (see the module docstring): steady,
    runs of rounds whose slot kinds are used alike, each stretch of at least `headless`
    rounds that run no head cut out (0: none; `headless_stretch`)."""
    tables = {k: getattr(rounds, f"{k.lower()}_valid") for k in "FBW"}
    used = tuple("off" if not any(map(any, tables[k])) else None for k in "FBW")
    if form != "steady":
        modes = tuple(u or ("cond" if form == "cond" else "mask") for u in used)
        everywhere = frozenset((n, k) for n in ("embed", "head") for k in "FB")
        return [Segment(0, rounds.num_rounds, modes, inline=form == "masked",
                        ends=everywhere, taps=_taps(rounds, range(rounds.num_rounds)))]
    runs = []  # [start, stop, slot states] of equal slot states
    for t in range(rounds.num_rounds):
        states = (*(_slot_state(tables[k][t]) for k in "FBW"), _taps(rounds, [t]))
        if runs and runs[-1][2] == states:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1, states])
    ends = [ends_of(rounds, [t]) for t in range(rounds.num_rounds)]
    piece = ("head", "F" if rounds.forward_only else "B")  # the slot that runs the head
    need = [piece in e for e in ends]
    return [Segment(a, b, tuple("mask" if s == "some" else s for s in states[:3]),
                    inline=True, ends=frozenset().union(*ends[a:b]), taps=states[3])
            for start, stop, states in runs
            for a, b in _headless_cuts(need, start, stop, headless)]


def head_rounds(rounds: Rounds, form: str, headless: int = HEADLESS, swaps=None) -> int:
    """The rounds in which the scans of `segments` run the head, against the m rounds whose
    slots use it: what a step computes of the head (the planner's time model). Inline, a
    scan runs it in every round of a phase some of whose rounds need it (the executor's:
    two phases where static_chunks.runs finds them with the rank's chunk `swaps`); the
    cond form's conditionals run it where a round needs it."""
    piece = ("head", "F" if rounds.forward_only else "B")
    held = static_chunks.round_chunks(rounds, swaps) if swaps else None
    count = 0
    for seg in (s for s in segments(rounds, form, headless) if piece in s.ends):
        if not seg.inline:
            count += sum(piece in ends_of(rounds, [t]) for t in range(seg.start, seg.stop))
            continue
        for a, b, phases in static_chunks.runs(held, seg.start, seg.stop):
            n = len(phases)
            count += sum(len(range(a + i, b, n)) for i in range(n)
                         if piece in ends_of(rounds, range(a + i, b, n)))
    return count


def _headless_cuts(need: list, start: int, stop: int, least: int) -> list:
    """[start, stop) as [(a, b)]: where some of its rounds run the head (need[t]), each
    stretch of at least `least` rounds that do not is a piece of its own (0: none)."""
    cuts = {start, stop}
    if least and any(need[start:stop]):
        t = start
        while t < stop:
            u = t
            while u < stop and not need[u]:
                u += 1
            if u - t >= least:
                cuts |= {t, u}
            t = u + 1
    edges = sorted(cuts)
    return list(zip(edges, edges[1:]))


def ends_of(rounds: Rounds, ts) -> frozenset:
    """Segment.ends of rounds ts: ('embed', k) where some rank's slot k is virtual stage 0,
    ('head', k) where some rank's is the last, but for a B that runs again (b_again: its
    first run kept the head's output gradient for it, b_stores)."""
    last = rounds.stages * rounds.chunks - 1

    def runs(k: str, stage: int, t: int, r: int) -> bool:
        return bool(getattr(rounds, f"{k}_valid")[t][r]) and rounds.stage(
            getattr(rounds, f"{k}_chunk")[t][r], r) == stage and not (
            stage == last and k == "b" and rounds.b_again[t][r])
    return frozenset((name, k) for name, stage in (("embed", 0), ("head", last)) for k in "FB"
                     if any(runs(k.lower(), stage, t, r) for t in ts
                            for r in range(rounds.stages)))


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
