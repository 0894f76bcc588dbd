"""The schedule generators: `make_schedule` for every kind (GPipe, 1F1B, interleaved 1F1B,
the zero-bubble kinds; the package docstring says what each is) and `forward_only`.
Pure Python.

Zero-bubble kinds are made two ways, and make_schedule keeps the one whose rounds cost
less under its costs (on a tie, the one with fewer rounds):
- W's in the slots (`_weight_grads_in_slots`; every zero-bubble kind, zb-v's only
  making, on vshape.py's F/B order): the F/B order of the base kind is packed first; then its W's are placed by packing.py's rule (at most one a rank a
  round, where it costs nothing or where the stash demands it). About m + 3p rounds
  (v = 1), most of them full on every rank (what the steady round form runs without
  conditionals). With uniform costs
  it reaches the paper's bubble (p-1)(t_f+t_b-t_w) / (m(t_f+t_b+t_w)) = (p-1)/(3m) only
  from m >= 2p-2 (divided by v for zb-interleaved): below, the rounds that carry the first
  gradient back to rank 0 cost two actions each (the last rank runs an F and a B in each)
  while rank 0, out of forwards, idles (0.417 instead of 0.250 at p = m = 4).
- One action a round (`_one_per_round`; v = 1): every rank chooses, in every round,
  its next B if ready, else its next F while it holds fewer than 2p - r - 1 microbatches
  from F to W, else its oldest W. With uniform costs it ends in 3m + p - 1 rounds of one
  slot, the paper's bubble for every m >= p (a limit of p - r doubles it), but once
  m > p it has more rounds (messages, loop steps, conditionals) than the other (~m + 3p).
So with uniform costs zb-h1 reaches (p-1)/(3m) for every m >= p ((2p-1-m)/(3m) below):
one action a round for 2 <= m < 2p - 2, W's in the slots otherwise. Its peak stash (from
a stage input's arrival to its W, as the lowering counts it) is min(m, 2p - 1) on the
busiest rank at every m, 1F1B's. zb-interleaved (v > 1) keeps the small-m excess
(2p-2-m)/(3vm) (simulate.py).
"""
from __future__ import annotations

from dataclasses import replace

from jaxptd.pipeline.schedules.actions import (KINDS, V_SHAPED, ZERO_BUBBLE, Action, Costs,
                                               Schedule, ScheduleError)
from jaxptd.pipeline.schedules.packing import can_run, pack_rounds, packed_time
from jaxptd.pipeline.schedules.vshape import v_order


def _check_params(kind: str, stages: int, microbatches: int, chunks: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"kind={kind!r} must be one of {', '.join(KINDS)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be an integer >= 1")
    if kind in V_SHAPED and chunks != 2:
        raise ScheduleError(f"chunks={chunks} must be 2 for kind={kind!r} (its V: chunk 0 "
                            "down the ranks, chunk 1 back up)")
    if "interleaved" not in kind and kind not in V_SHAPED and chunks != 1:
        raise ScheduleError(f"chunks={chunks} must be 1 for kind={kind!r} (use an "
                            "interleaved kind)")


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


def make_schedule(kind: str, stages: int, microbatches: int, chunks: int = 1,
                  costs: Costs = Costs()) -> Schedule:
    """Builds the per-rank action order.

    Args: kind in KINDS; stages p >= 1; microbatches m >= 1; chunks v (1 for gpipe, 1f1b
      and zb-h1, 2 for zb-v, >= 1 for the interleaved kinds, where v = 1 gives exactly the v = 1 kind);
      costs: where zero-bubble kinds place W (the executor uses the uniform default).
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
      p-r-1, p=4 m=8 packs to a bubble of 1.0 instead of (p-1)/m = 0.375). The price is
      a stash of 2p-1 on rank 0 instead of p. Zero-bubble kinds: the cheaper under
      costs of their two makings (module docstring).
    """
    _check_params(kind, stages, microbatches, chunks)
    if kind in ZERO_BUBBLE:
        return _zero_bubble(kind, stages, microbatches, chunks, costs)
    p, m, v = stages, microbatches, chunks
    groups = _groups(p, m)
    fwd = [(j, c) for grp in groups for c in range(v) for j in grp]
    bwd = [(j, c) for grp in groups for c in reversed(range(v)) for j in grp]
    actions = []
    for r in range(p):
        warmup = m * v if kind == "gpipe" else (v - 1) * len(groups[0]) + 2 * (p - r - 1)
        actions.append(_one_f_one_b(fwd, bwd, min(warmup, m * v)))
    return Schedule(kind, p, m, v, tuple(actions))


def _zero_bubble(kind: str, p: int, m: int, v: int, costs: Costs) -> Schedule:
    """Of a zero-bubble kind's makings (module docstring), the one whose packed rounds
    cost least under costs; on a tie, the one with fewer rounds."""
    makings = [_weight_grads_in_slots(kind, p, m, v, costs)]
    if v == 1:  # zb-h1, and zb-interleaved with one chunk (the same schedule)
        one = _one_per_round(kind, p, m)
        makings.append((one, pack_rounds(one)))

    def price(making: tuple) -> tuple:
        return round(packed_time(making[1], costs, True, v), 9), len(making[1])
    return min(makings, key=price)[0]


def _weight_grads_in_slots(kind: str, p: int, m: int, v: int, costs: Costs) -> tuple:
    """(the base kind's F/B order (zb-v: vshape.v_order) with each rank's W's placed by
    packing's `_place_weight_grads`, the per-rank order as packed; its packed rounds)."""
    base = v_order(p, m) if kind in V_SHAPED else make_schedule(ZERO_BUBBLE[kind], p, m, v)
    draft = replace(base, kind=kind, actions=tuple(
        acts + tuple(Action("W", a.microbatch, a.chunk) for a in acts if a.kind == "B")
        for acts in base.actions))
    packed = pack_rounds(draft, costs)
    return replace(draft, actions=tuple(
        tuple(a for row in packed for a in row[r] if a) for r in range(p))), packed


def _one_per_round(kind: str, p: int, m: int) -> Schedule:
    """zb-h1 (or zb-interleaved with v = 1) with one action a rank a round, each rank
    choosing in every round: its next B if ready, else its next F if ready while it holds
    fewer than 2p - r - 1 microbatches from F to W, else its oldest W (module docstring)."""
    ran, orders, t = {}, [[] for _ in range(p)], 0  # ran[(kind, microbatch, rank)] = round
    done = [{"F": 0, "B": 0, "W": 0} for _ in range(p)]  # per rank: how many ran, by kind
    while any(len(acts) < 3 * m for acts in orders):
        progress = False
        for r, count in enumerate(done):
            wanted = [Action("B", count["B"], 0), Action("W", count["W"], 0)]
            if count["F"] - count["W"] < 2 * p - r - 1:
                wanted.insert(1, Action("F", count["F"], 0))
            a = next((a for a in wanted if a.microbatch < m and can_run(ran, a, r, t, p - 1)),
                     None)
            if a:
                ran[(a.kind, a.microbatch, r)], progress = t, True
                count[a.kind] += 1
                orders[r].append(a)
        assert progress, "the greedy rule stalled"
        t += 1
    return Schedule(kind, p, m, 1, tuple(map(tuple, orders)), one_per_round=True)


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in each rank's order (so in the kind's microbatch and
    chunk order): the pipelined forward pass that evaluation runs."""
    actions = tuple(tuple(a for a in acts if a.kind == "F") for acts in schedule.actions)
    return replace(schedule, actions=actions, forward_only=True)
