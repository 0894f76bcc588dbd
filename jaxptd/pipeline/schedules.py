"""Pipeline schedules as data: generators, lockstep lowering, validator, simulator, grid.

Owns the per-rank order of forward (F) and backward (B) actions for GPipe, 1F1B
(PipeDream-Flush) and interleaved 1F1B (PTD-P paper §2.2), their forward-only versions
(what evaluation runs), and their lowering to the lockstep rounds the JAX executor runs.
Pure Python: never imports JAX.

Invariants:
- p ranks, v chunks per rank, m microbatches; virtual stage s = c*p + r for chunk c on
  rank r; stages run in order 0..p*v-1; activations go r -> (r+1)%p, gradients r -> (r-1)%p.
- A training `Schedule` that `validate` accepts holds every (microbatch, chunk) F and B
  exactly once per rank, each F before its B, and lowers without deadlock. A forward-only
  one (made by `forward_only`, and flagged so) holds every F exactly once per rank and no B.
- `lower` is greedy and in order: each rank takes its next action as soon as it is ready,
  never reorders. `Rounds` tables are [T][p] tuples of ints; unused entries are 0.
- Stash slots hold a stage input from its arrival (virtual stage 0: from its forward)
  until the end of its backward (forward-only: of its forward); a slot freed in round t
  is reusable from round t + 1. Grad slots hold an incoming output-gradient from its
  arrival until the B that consumes it; a grad slot freed by round t's B may receive
  round t's incoming gradient (the executor writes it after that B has read it).
  Forward-only rounds have no grad slots. Freed slots are reused lowest index first.
- Lockstep changes one thing from the paper: 1f1b warms up with 2*(p-r-1) forwards, not
  PipeDream-Flush's p-r-1 (see make_schedule), so that the greedy lowering reaches the
  bubble (p-1)/m; interleaved keeps Megatron's count and reaches (p-1)/(v*m) for m >= p.
  Forward-only, every kind reaches (p-1)/(v*m) for m >= p (v*m + p - 1 rounds).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace

KINDS = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule or its parameters break a rule; the message names value and rule."""


@dataclass(frozen=True)
class Action:
    kind: str  # 'F' or 'B'
    microbatch: int
    chunk: int

    def label(self, chunks: int = 1) -> str:
        """'F3' for one chunk per rank, 'F3.1' (microbatch 3, chunk 1) otherwise."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if chunks > 1 else "")


@dataclass(frozen=True)
class Schedule:
    kind: str
    stages: int
    microbatches: int
    chunks: int
    actions: tuple  # actions[r]: rank r's ordered tuple of Action
    forward_only: bool = False  # no backward: a pipelined forward pass (evaluation)


def check_layers(num_layers: int, stages: int, chunks: int) -> int:
    """Returns layers per chunk; raises ScheduleError unless p*v chunks divide num_layers
    exactly (a silently smaller model is the worst outcome)."""
    if num_layers < 1 or num_layers % (stages * chunks):
        raise ScheduleError(f"num_layers={num_layers} must be a positive multiple of "
                            f"stages*chunks={stages}*{chunks}={stages * chunks}")
    return num_layers // (stages * chunks)


def _check_params(kind: str, stages: int, microbatches: int, chunks: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"kind={kind!r} must be one of {', '.join(KINDS)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be an integer >= 1")
    if kind != "interleaved" and chunks != 1:
        raise ScheduleError(f"chunks={chunks} must be 1 for kind={kind!r} (use 'interleaved')")


def _one_f_one_b(fwd: list, bwd: list, warmup: int) -> tuple:
    """Warm-up forwards, then (F, B) pairs, then the remaining backwards."""
    steady = len(fwd) - warmup
    order = [Action("F", j, c) for j, c in fwd[:warmup]]
    for k in range(steady):
        order += [Action("F", *fwd[warmup + k]), Action("B", *bwd[k])]
    order += [Action("B", j, c) for j, c in bwd[steady:]]
    return tuple(order)


def _groups(p: int, m: int) -> list:
    """Splits microbatches 0..m-1 into max(1, m // p) consecutive groups whose sizes
    differ by at most one, larger first: every group has >= p microbatches when m >= p."""
    n = max(1, m // p)
    sizes = [m // n + (i < m % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [range(a, a + g) for a, g in zip(starts, sizes)]


def make_schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Builds the per-rank action order.

    Args: kind in KINDS; stages p >= 1; microbatches m >= 1; chunks v (1 for gpipe and
      1f1b, >= 1 for interleaved, where v = 1 gives exactly the 1f1b schedule).
    Returns: a Schedule. gpipe: all forwards, then all backwards. 1f1b and interleaved:
      warm-up forwards, then (F, B) pairs, then the remaining backwards, with forwards
      taken group by group, chunk-major within a group, and backwards likewise with the
      chunks reversed (Megatron's order). Groups: max(1, m // p) of near-equal size, so
      m = k*p gives Megatron's groups of p, and any m >= 1 is accepted (Megatron needs
      m % p == 0; a group smaller than p would stall rank 0 waiting for its own
      activations to come round the ring). Warm-up on rank r: (v-1)*g + 2*(p-r-1)
      forwards, g the largest group, capped at m*v: Megatron's count for interleaving.
      For v = 1 that is 2*(p-r-1), twice PipeDream-Flush's p-r-1, because in lockstep
      rounds a gradient needs p-1-r rounds to come back to rank r after the last stage,
      and rank r must keep forwarding meanwhile or every rank's F slot waits on it (with
      p-r-1, p=4 m=8 lowers to a bubble of 1.0 instead of (p-1)/m = 0.375). The price is
      a stash of 2p-1 on rank 0 instead of p.
    """
    _check_params(kind, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    groups = _groups(p, m)
    fwd = [(j, c) for grp in groups for c in range(v) for j in grp]
    bwd = [(j, c) for grp in groups for c in reversed(range(v)) for j in grp]
    actions = []
    for r in range(p):
        warmup = m * v if kind == "gpipe" else (v - 1) * len(groups[0]) + 2 * (p - r - 1)
        actions.append(_one_f_one_b(fwd, bwd, min(warmup, m * v)))
    return Schedule(kind, p, m, v, tuple(actions))


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in each rank's order (so in the kind's microbatch and
    chunk order): the pipelined forward pass that evaluation runs."""
    actions = tuple(tuple(a for a in acts if a.kind == "F") for acts in schedule.actions)
    return replace(schedule, actions=actions, forward_only=True)


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
    recv_f_valid: tuple
    recv_f_slot: tuple
    recv_b_valid: tuple
    recv_b_slot: tuple
    num_stash_slots: int
    num_grad_slots: int
    forward_only: bool

    def grid(self) -> str:
        """Rank x round text grid; each round shows its F slot then its B slot (forward-only:
        its F slot)."""
        slots = [("F", self.f_valid, self.f_mb, self.f_chunk),
                 ("B", self.b_valid, self.b_mb, self.b_chunk)][:1 if self.forward_only else 2]
        cells = [[[_cell(*slot, t, r, self.chunks) for slot in slots]
                  for t in range(self.num_rounds)] for r in range(self.stages)]
        width = max(len(x) for row in cells for pair in row for x in pair)
        return _format_grid([[" ".join(x.ljust(width) for x in pair).rstrip() for pair in row]
                             for row in cells], "round")


def _cell(kind, valid, mb, chunk, t, r, chunks) -> str:
    return Action(kind, mb[t][r], chunk[t][r]).label(chunks) if valid[t][r] else "."


def _format_grid(rows: list, column_name: str, marks: dict | None = None) -> str:
    """rows[r][t] strings -> aligned text; marks {(r, t): '!'} appended to cells."""
    marks = marks or {}
    rows = [[c + marks.get((r, t), "") for t, c in enumerate(row)] for r, row in enumerate(rows)]
    width = max([len(c) for row in rows for c in row] + [2])
    ncol = max(len(row) for row in rows)
    head = f"{column_name:>7} " + " ".join(f"{t:<{width}}" for t in range(ncol))
    body = [f"rank {r:<2} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(rows)]
    return "\n".join(line.rstrip() for line in [head] + body)


class _SlotPool:
    """Lowest-free-index slot allocator for one rank, tracking its peak."""

    def __init__(self):
        self.free, self.size, self.live, self.peak = [], 0, 0, 0

    def take(self) -> int:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
        else:
            slot, self.size = self.size, self.size + 1
        self.live += 1
        self.peak = max(self.peak, self.live)
        return slot

    def give(self, slot: int) -> None:
        self.free.append(slot)
        self.live -= 1


def _greedy_rounds(schedule: Schedule) -> list:
    """Assigns actions to rounds greedily in rank order.

    Returns: per round, per rank, a pair (F action or None, B action or None).
    Raises: ScheduleError with the grid so far when a round makes no progress.
    """
    p, S = schedule.stages, schedule.stages * schedule.chunks
    ran, pos, rounds = {}, [0] * p, []  # ran[(kind, microbatch, virtual stage)] = round

    def ready(a: Action, r: int, t: int) -> bool:
        s = a.chunk * p + r
        if a.kind == "F":  # strict '<': an activation sent in round t is usable from t+1
            return s == 0 or ran.get(("F", a.microbatch, s - 1), t) < t
        return (ran.get(("F", a.microbatch, s), t + 1) <= t
                and (s == S - 1 or ran.get(("B", a.microbatch, s + 1), t) < t))

    while any(pos[r] < len(acts) for r, acts in enumerate(schedule.actions)):
        t, row = len(rounds), []
        for r, acts in enumerate(schedule.actions):
            pair = [None, None]
            for slot, kind in enumerate("FB"):
                a = acts[pos[r]] if pos[r] < len(acts) else None
                if a and a.kind == kind and ready(a, r, t):
                    pair[slot], ran[(kind, a.microbatch, a.chunk * p + r)] = a, t
                    pos[r] += 1
            row.append(tuple(pair))
        if not any(fa or ba for fa, ba in row):
            raise _deadlock_error(schedule, rounds, pos)
        rounds.append(row)
    return rounds


def _deadlock_error(schedule: Schedule, rounds: list, pos: list) -> ScheduleError:
    """The rounds so far, then each rank's blocked next action marked '!'."""
    v = schedule.chunks
    rows = [[f"{fa.label(v) if fa else '.'} {ba.label(v) if ba else '.'}"
             for fa, ba in (row[r] for row in rounds)] for r in range(schedule.stages)]
    for r, acts in enumerate(schedule.actions):
        rows[r].append(acts[pos[r]].label(v) + "!" if pos[r] < len(acts) else ".")
    return ScheduleError(f"deadlock at round {len(rounds)}: no rank's next action (marked !) "
                         f"can ever become ready\n{_format_grid(rows, 'round')}")


def lower(schedule: Schedule) -> Rounds:
    """Lowers a schedule (training or forward-only) to lockstep rounds and assigns stash
    and gradient slots. Assumes the per-rank rules hold; `validate` checks them and then
    calls this.

    Returns: Rounds with [T][p] tables. Raises: ScheduleError on deadlock.
    """
    p, v = schedule.stages, schedule.chunks
    S, rounds = p * v, _greedy_rounds(schedule)
    T = len(rounds)
    tab = {k: [[0] * p for _ in range(T)] for k in (
        "f_valid", "f_mb", "f_chunk", "f_slot", "b_valid", "b_mb", "b_chunk", "b_slot",
        "b_grad_slot", "recv_f_valid", "recv_f_slot", "recv_b_valid", "recv_b_slot")}
    stash, grads = [_SlotPool() for _ in range(p)], [_SlotPool() for _ in range(p)]
    stash_of, grad_of = {}, {}  # (rank, microbatch, virtual stage) -> slot
    for t, row in enumerate(rounds):
        for r, (fa, _) in enumerate(row):  # F slot, then activation arrivals
            if fa:
                j, s = fa.microbatch, fa.chunk * p + r
                if s == 0:
                    stash_of[(r, j, s)] = stash[r].take()
                _put(tab, "f", t, r, fa, f_slot=stash_of[(r, j, s)])
                if s < S - 1:
                    dst = (r + 1) % p
                    stash_of[(dst, j, s + 1)] = slot = stash[dst].take()
                    tab["recv_f_valid"][t][dst], tab["recv_f_slot"][t][dst] = 1, slot
        for r, (fa, _) in enumerate(row):  # forward-only: an input is done after its F
            if fa and schedule.forward_only:
                stash[r].give(stash_of.pop((r, fa.microbatch, fa.chunk * p + r)))
        for r, (_, ba) in enumerate(row):  # B slot, then gradient arrivals
            if ba:
                j, s = ba.microbatch, ba.chunk * p + r
                slot = stash_of.pop((r, j, s))
                grad_slot = grad_of.pop((r, j, s)) if s < S - 1 else 0
                _put(tab, "b", t, r, ba, b_slot=slot, b_grad_slot=grad_slot)
                stash[r].give(slot)
                if s < S - 1:
                    grads[r].give(grad_slot)
        for r, (_, ba) in enumerate(row):
            if ba and ba.chunk * p + r > 0:
                dst, key = (r - 1) % p, (ba.microbatch, ba.chunk * p + r - 1)
                grad_of[(dst,) + key] = slot = grads[dst].take()
                tab["recv_b_valid"][t][dst], tab["recv_b_slot"][t][dst] = 1, slot
    frozen = {k: tuple(tuple(x) for x in rows) for k, rows in tab.items()}
    return Rounds(T, p, v, schedule.microbatches, **frozen,
                  num_stash_slots=max(x.size for x in stash),
                  num_grad_slots=max(x.size for x in grads),
                  forward_only=schedule.forward_only)


def _put(tab, prefix, t, r, action, **slots) -> None:
    tab[f"{prefix}_valid"][t][r] = 1
    tab[f"{prefix}_mb"][t][r] = action.microbatch
    tab[f"{prefix}_chunk"][t][r] = action.chunk
    for name, value in slots.items():
        tab[name][t][r] = value


def validate(schedule: Schedule) -> Rounds:
    """Checks a schedule against its rule (training or forward-only); returns its lowering.

    Raises: ScheduleError naming the rule, with a rank x position grid (offending action
      marked '!') for per-rank errors, or the rank x round grid for a deadlock.
    """
    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"actions has {len(schedule.actions)} ranks, stages={p}")
    kinds, rule = ("F", "forward-only: each F exactly once, no B") if schedule.forward_only \
        else ("FB", "each F and B exactly once, F before its B")
    for r, acts in enumerate(schedule.actions):
        seen, bad = {}, None
        for i, a in enumerate(acts):
            key = (a.kind, a.microbatch, a.chunk)
            if a.kind not in kinds or len(a.kind) != 1 or not (0 <= a.microbatch < m
                                                              and 0 <= a.chunk < v):
                bad = (i, f"{a} is outside kind {'/'.join(kinds)}, microbatch < {m}, "
                          f"chunk < {v}")
            elif key in seen:
                bad = (i, f"{a.label(v)} appears twice")
            elif a.kind == "B" and ("F", a.microbatch, a.chunk) not in seen:
                bad = (i, f"{a.label(v)} comes before its forward")
            seen[key] = i
            if bad:
                break
        missing = [Action(k, j, c) for k in kinds for j in range(m) for c in range(v)
                   if (k, j, c) not in seen] if not bad else []
        if bad or missing:
            rows = [[a.label(v) for a in x] for x in schedule.actions]
            if missing:
                rows[r].append(f"(missing {missing[0].label(v)})")
                bad = (len(rows[r]) - 1, f"{missing[0].label(v)} is missing")
            grid = _format_grid(rows, "pos", {(r, bad[0]): "!"})
            raise ScheduleError(f"rank {r}: {bad[1]} ({rule})\n{grid}")
    return lower(schedule)


@dataclass
class Stats:
    total_time: float
    ideal_time: float
    bubble_fraction: float
    peak_stash: list  # per rank: most stage inputs stashed at once
    num_rounds: int
    messages: dict  # {'forward': activation sends, 'backward': gradient sends}
    async_total_time: float  # event-driven (Megatron-style, no lockstep) makespan
    timeline: list = field(repr=False)  # per rank: [(start, end, Action)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["timeline"] = [[(s, e, a.label(2)) for s, e, a in row] for row in self.timeline]
        return d


def _peak_stash(rounds: Rounds) -> list:
    """Per-rank peak live stash slots, recounted from the tables: within a round the
    forward (virtual stage 0) and arrival allocations precede the free by the backward
    (forward-only: by the forward)."""
    peaks = []
    for r in range(rounds.stages):
        live = peak = 0
        for t in range(rounds.num_rounds):
            stage0 = rounds.f_valid[t][r] and r == 0 and rounds.f_chunk[t][r] == 0
            live += stage0 + rounds.recv_f_valid[t][r]
            peak = max(peak, live)
            live -= (rounds.f_valid if rounds.forward_only else rounds.b_valid)[t][r]
        peaks.append(peak)
    return peaks


def _async_time(schedule: Schedule, f_cost: float, b_cost: float, hop: float) -> float:
    """Event-driven makespan: each rank runs its order back to back, an action starts
    when its rank is free and its input has arrived (hop latency after the sender)."""
    p, S = schedule.stages, schedule.stages * schedule.chunks
    done, free, pos = {}, [0.0] * p, [0] * p
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s = a.chunk * p + r
                dep = ("F", a.microbatch, s - 1) if a.kind == "F" else ("B", a.microbatch, s + 1)
                if (a.kind == "F" and s == 0) or (a.kind == "B" and s == S - 1):
                    ready = 0.0
                elif dep in done:
                    ready = done[dep] + hop
                else:
                    break
                start = max(free[r], ready)
                free[r] = done[(a.kind, a.microbatch, s)] = start + (
                    f_cost if a.kind == "F" else b_cost)
                pos[r] += 1
                remaining -= 1
    return max(free)


def simulate(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0,
             hop_latency: float = 0.0) -> Stats:
    """Times the lockstep executor on the lowered schedule.

    Args: fwd_cost, bwd_cost: one microbatch's forward/backward over all of a rank's
      layers (one chunk's action costs 1/v of it); hop_latency: per ppermute, paid twice
      every round since the executor runs both ppermutes unconditionally (once for a
      forward-only schedule: no gradients to send).
    Returns: Stats; a round costs the F slot if any rank uses it, then the B slot if any.
      A forward-only schedule's ideal time is m * fwd_cost.
    """
    rounds = validate(schedule)
    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    f_cost, b_cost = fwd_cost / v, bwd_cost / v
    timeline, now = [[] for _ in range(p)], 0.0
    for t in range(rounds.num_rounds):
        f_len = f_cost if any(rounds.f_valid[t]) else 0.0
        b_start = now + f_len + hop_latency
        b_len = b_cost if any(rounds.b_valid[t]) else 0.0
        for r in range(p):
            if rounds.f_valid[t][r]:
                timeline[r].append((now, now + f_cost, Action(
                    "F", rounds.f_mb[t][r], rounds.f_chunk[t][r])))
            if rounds.b_valid[t][r]:
                timeline[r].append((b_start, b_start + b_cost, Action(
                    "B", rounds.b_mb[t][r], rounds.b_chunk[t][r])))
        now = b_start + b_len + (0.0 if rounds.forward_only else hop_latency)
    ideal = m * (fwd_cost + (0.0 if rounds.forward_only else bwd_cost))
    sends = sum(map(sum, rounds.recv_f_valid)), sum(map(sum, rounds.recv_b_valid))
    return Stats(total_time=now, ideal_time=ideal, bubble_fraction=(now - ideal) / ideal,
                 peak_stash=_peak_stash(rounds), num_rounds=rounds.num_rounds,
                 messages={"forward": sends[0], "backward": sends[1]},
                 async_total_time=_async_time(schedule, f_cost, b_cost, hop_latency),
                 timeline=timeline)


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.pipeline.schedules",
        description="Print a pipeline schedule's lockstep grid and its simulated statistics.")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--fwd-cost", type=float, default=1.0)
    parser.add_argument("--bwd-cost", type=float, default=2.0)
    parser.add_argument("--hop-latency", type=float, default=0.0)
    parser.add_argument("--forward-only", action="store_true",
                        help="the schedule's forwards alone (what evaluation runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="draw the timeline (needs matplotlib)")
    # argparse's own errors print usage and exit 2; keep them to one line like ours
    parser.error = lambda message: _fail(message)
    return parser.parse_args(argv)


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    """CLI entry: grid + statistics, or --json; bad arguments -> 'error: ...', exit 2."""
    args = _parse_args(argv)
    if min(args.fwd_cost, args.bwd_cost) <= 0 or args.hop_latency < 0:
        _fail("--fwd-cost and --bwd-cost must be > 0 and --hop-latency >= 0")
    try:
        schedule = make_schedule(args.kind, args.stages, args.microbatches, args.chunks)
        schedule = forward_only(schedule) if args.forward_only else schedule
        stats = simulate(schedule, args.fwd_cost, args.bwd_cost, args.hop_latency)
    except ScheduleError as e:
        _fail(str(e))
    if args.png:
        from jaxptd.pipeline.draw import draw_timeline
        try:
            draw_timeline(stats, schedule, args.png)
        except (ImportError, OSError) as e:
            _fail(f"--png {args.png}: {e}")
    if args.json:
        summary = stats.to_dict()
        del summary["timeline"]  # the grid's data; keeps the object one screen long
        print(json.dumps(summary))
        return 0
    print(lower(schedule).grid())
    print(f"total_time {stats.total_time:g}  ideal_time {stats.ideal_time:g}  "
          f"bubble_fraction {stats.bubble_fraction:.4f}  (paper: "
          f"{(args.stages - 1) / (args.chunks * args.microbatches):.4f})  "
          f"async_total_time {stats.async_total_time:g}")
    print(f"rounds {stats.num_rounds}  peak_stash {stats.peak_stash}  messages {stats.messages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
