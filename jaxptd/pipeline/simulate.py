"""Timing a schedule: the lockstep simulator (what the executor runs), an event-driven one
(each rank runs its order back to back, as Megatron's asynchronous executor would), the
papers' bubble formulas, and the CLI `python -m jaxptd.pipeline.schedules` (`main`, run
by jaxptd/pipeline/schedules/__main__.py).

Lockstep cost model: in a round every rank runs its F, B and W slots back to back and the
messages of the round are stored at its end, so a round costs the busiest rank's work,
max over ranks of (t_f [F] + t_b [B] + t_w [W]) / v, plus one hop latency (the executor's
messages overlap the rest of the round; the last one's latency is exposed). A kind without
W runs B + W in its B. Masked costs (Costs.masked: the steady and masked round forms, a
GPU's) run every slot kind some rank uses on every rank: a round costs the sum over its
kinds of the longest action of each. Pure Python.

With uniform costs the lockstep bubble is (p-1)/m for gpipe and 1f1b, (p-1)/(v m) for
interleaved (m >= p), and for the zero-bubble kinds the paper's (p-1)(t_f+t_b-t_w) /
(m (t_f+t_b+t_w)): for zb-h1 from m >= p on, for zb-interleaved (divided by v) from
m >= 2p-2 on; see schedules/make.py for below that. Masked, the same for the kinds without
W, and 2(p-1) / (3 v m) for the zero-bubble kinds at every m (from m >= p for v > 1): the
W's fill no bubble there, they only stop adding to it (jaxptd/plan/timing.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, fields

from jaxptd.pipeline.draw import draw_timeline
from jaxptd.pipeline.lowering import Rounds, lower
from jaxptd.pipeline.schedules import (KINDS, V_SHAPED, ZERO_BUBBLE, Costs, Schedule,
                                       ScheduleError, forward_only, make_schedule)


# The CLI's limit on a schedule's actions: at the limit it answers in 3 (1f1b) to 15 s
# (zb-h1, two makings packed) on a 2-core CPU shared with other jobs.
MAX_ACTIONS = 200_000


@dataclass
class Stats:
    total_time: float
    ideal_time: float
    bubble_fraction: float
    peak_stash: list  # per rank: most microbatch-stages held at once (F to last backward)
    num_rounds: int
    messages: dict  # {'forward': activation sends, 'backward': gradient sends}
    async_total_time: float  # event-driven (no lockstep) makespan of the same orders
    paper_bubble: float  # the kind's formula (see paper_bubble)
    timeline: list = field(repr=False)  # per rank: [(start, end, Action)]
    rounds: Rounds = field(repr=False)  # the lowered rounds timed (their grid, slots)

    def summary(self) -> dict:
        """The statistics as a JSON-ready dict, without the timeline and the rounds."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("timeline", "rounds")}


def paper_bubble(kind: str, p: int, m: int, v: int, costs: Costs) -> float:
    """The published bubble fraction: (p-1)/m (GPipe, 1F1B), (p-1)/(v m) (PTD-P §2.2.2),
    (p-1)(t_f+t_b-t_w)/(m(t_f+t_b+t_w)) (ZB-H1, Qi et al. §3), / v when interleaved;
    ZB-V's (their §6, with a chunk's times, half a stage's): that of ZB-H2,
    (p-1)(t_f+t_b-2t_w)/(v m(t_f+t_b+t_w)), zero when t_w >= (t_f+t_b)/2."""
    if kind in ZERO_BUBBLE:
        f, b, w = costs.fwd, costs.bwd, costs.wgt
        filled = 2 * w if kind in V_SHAPED else w  # the W time that fills the bubble
        return max(0.0, (p - 1) * (f + b - filled)) / (v * m * (f + b + w))
    return (p - 1) / (v * m)


def _async_time(schedule: Schedule, costs: Costs, hop: float) -> float:
    """Event-driven makespan: each rank runs its order back to back, an action starts
    when its rank is free and its input has arrived (hop latency after the sender)."""
    p, S, v = schedule.stages, schedule.stages * schedule.chunks, schedule.chunks
    split = schedule.split_backward
    done, free, pos = {}, [0.0] * p, [0] * p
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s = schedule.stage(a.chunk, r)
                dep, latency = {"F": (("F", a.microbatch, s - 1), hop),
                                "B": (("B", a.microbatch, s + 1), hop),
                                "W": (("B", a.microbatch, s), 0.0)}[a.kind]
                if (a.kind == "F" and s == 0) or (a.kind == "B" and s == S - 1):
                    dep = ("F", a.microbatch, s) if a.kind == "B" else None
                    latency = 0.0
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] + latency if dep else 0.0)
                free[r] = done[(a.kind, a.microbatch, s)] = start + costs.of(a, split, v)
                pos[r] += 1
                remaining -= 1
    return max(free)


def simulate(schedule: Schedule, costs: Costs = Costs(), hop_latency: float = 0.0) -> Stats:
    """Times the lockstep executor on the lowered schedule (see the module docstring).

    Args: costs: one microbatch's F, B and W over all of a rank's layers (a kind without
      W runs B + W in its B); hop_latency: per round (forward-only: the same).
    Returns: Stats. The ideal time is m (t_f + t_b + t_w) (forward-only: m t_f).
    """
    rounds = lower(schedule, costs)
    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    split = schedule.split_backward
    timeline, now = [[] for _ in range(p)], 0.0
    for row in rounds.packed:
        # masked: each slot kind starts where the longer earlier slots end on every rank
        lasts = costs.slot_times(row, split, v)
        offsets = (0.0, lasts[0], lasts[0] + lasts[1])
        for r, slots in enumerate(row):
            start = now
            for k, action in enumerate(slots):
                if action:
                    start = now + offsets[k] if costs.masked else start
                    end = start + costs.of(action, split, v)
                    timeline[r].append((start, end, action))
                    start = end
        now += costs.round(row, split, v) + hop_latency
    ideal = m * (costs.fwd + (0.0 if schedule.forward_only else costs.bwd + costs.wgt))
    sends = tuple(sum(map(sum, getattr(rounds, f"recv_{k}_valid"))) +
                  sum(map(sum, getattr(rounds, f"recv_{k}2_valid"))) for k in "fb")
    return Stats(total_time=now, ideal_time=ideal, bubble_fraction=(now - ideal) / ideal,
                 peak_stash=rounds.peak_stash(), num_rounds=rounds.num_rounds,
                 messages={"forward": sends[0], "backward": sends[1]},
                 async_total_time=_async_time(schedule, costs, hop_latency),
                 paper_bubble=paper_bubble(schedule.kind, p, m, v, costs),
                 timeline=timeline, rounds=rounds)


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.pipeline.schedules",
        description="Print a pipeline schedule's lockstep grid and its simulated statistics.")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks a rank (default 1; zb-v: 2, its only choice)")
    parser.add_argument("--fwd-cost", type=float, default=1.0)
    parser.add_argument("--bwd-cost", type=float, default=1.0,
                        help="the input-gradient part of a backward (B)")
    parser.add_argument("--wgt-cost", type=float, default=None,
                        help="the weight-gradient part (W); default: --bwd-cost. Kinds "
                             "without W run B + W in one backward")
    parser.add_argument("--hop-latency", type=float, default=0.0)
    parser.add_argument("--masked", action="store_true",
                        help="pack and time the rounds as a GPU's round forms (steady, "
                             "masked) run them: a slot kind some rank uses runs on every "
                             "rank (default: as the cond form does, idle slots skipped)")
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


def _check_size(args, costs: Costs) -> None:
    """Refuses at once a schedule of more than MAX_ACTIONS actions (F, B and W apart), in
    one line that says what to do: packing, lowering and timing it in pure Python would
    take minutes (p = 64, m = 100000: 12.8 million actions), for a grid of p lines of
    about m rounds each and the statistics the papers' formulas give (tested equal)."""
    p, v, m = args.stages, args.chunks, args.microbatches
    per_microbatch = 1 if args.forward_only else 3 if args.kind in ZERO_BUBBLE else 2
    actions = p * v * m * per_microbatch
    if actions > MAX_ACTIONS:
        size = f"--stages {p} x --microbatches {m}" + (f" x --chunks {v}" if v > 1 else "")
        _fail(f"{size} is {actions:,} actions, over the {MAX_ACTIONS:,} this simulator "
              f"times in seconds: lower --microbatches (past m = 2p only steady rounds are "
              f"added; the paper's bubble here is "
              f"{paper_bubble(args.kind, p, m, v, costs):.2g}), or plan the configuration "
              f"with python -m jaxptd.plan")


def main(argv=None) -> int:
    """CLI entry: grid + statistics, or --json; bad arguments -> 'error: ...', exit 2."""
    args = _parse_args(argv)
    args.chunks = args.chunks or (2 if args.kind in V_SHAPED else 1)
    wgt = args.bwd_cost if args.wgt_cost is None else args.wgt_cost
    if min(args.fwd_cost, args.bwd_cost, wgt) <= 0 or args.hop_latency < 0:
        _fail("--fwd-cost, --bwd-cost and --wgt-cost must be > 0 and --hop-latency >= 0")
    costs = Costs(args.fwd_cost, args.bwd_cost, wgt, args.masked)
    _check_size(args, costs)
    try:
        schedule = make_schedule(args.kind, args.stages, args.microbatches, args.chunks, costs)
        schedule = forward_only(schedule) if args.forward_only else schedule
        stats = simulate(schedule, costs, args.hop_latency)
    except ScheduleError as e:
        _fail(str(e))
    if args.png:
        try:
            draw_timeline(stats, schedule, args.png)
        except (ImportError, OSError) as e:
            _fail(f"--png {args.png}: {e}")
    if args.json:
        print(json.dumps(stats.summary()))
        return 0
    print(stats.rounds.grid())
    print(f"total_time {stats.total_time:g}  ideal_time {stats.ideal_time:g}  "
          f"bubble_fraction {stats.bubble_fraction:.4f}  (paper: {stats.paper_bubble:.4f})  "
          f"async_total_time {stats.async_total_time:g}")
    print(f"rounds {stats.num_rounds}  peak_stash {stats.peak_stash}  messages {stats.messages}")
    return 0

