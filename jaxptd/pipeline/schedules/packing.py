"""The greedy packing of each rank's order into the lockstep rounds the JAX executor runs
(the rules of a round: the package docstring), and the time of packed rounds. Pure Python.

F and B first: each rank takes its next action in the first slot of its kind where it is
ready, never reorders (a `one_per_round` schedule: every action so, at most one a rank a
round). Then, for zero-bubble kinds, the W's in the slots (`_place_weight_grads`): round
by round, each rank runs at most one pending W, where it must (the microbatches a rank
holds from F to W would exceed the base kind's peak stash) or where it costs nothing. With
a round lasting its busiest rank's work, that is where the rank has slack in a round whose
cost another rank sets. Masked (Costs.masked: a W slot, once some rank runs one, lasts a W
on every rank), the W slot opens where some rank must, or where every rank with the most
W's left can run one (such a round brings the W slots still needed, at least that most,
one down), and then every rank with a W ready runs one. Leftover W's run after the last B.
Which of a rank's ready W's a slot runs: the W of the B in the same round where there is
one, else the oldest. The slots are the same as in order; only their microbatches move,
so that a B's W is in its own round wherever it can be, and what the B keeps for it is
handed over in the round, not stored in a W slot (lowering's `w_now`): with W's in order a
rank runs each W some rounds after its B, all through the steady rounds.
make.py compares this with the other making of zero-bubble schedules.
"""
from __future__ import annotations

from collections import deque

from jaxptd.pipeline.schedules.actions import (Action, Costs, Schedule, ScheduleError,
                                               stage_place)
from jaxptd.pipeline.schedules.grid import format_grid, round_cells


def pack_rounds(schedule: Schedule, costs: Costs = Costs()) -> list:
    """Assigns actions to lockstep rounds: F and B greedily, each rank in its order; then,
    for zero-bubble kinds, W by the rule of the module docstring, each rank's W's in its
    order (costs decide where a W is free). A `one_per_round` schedule: every action
    greedily in its rank's order, at most one a rank a round.

    Returns: per round, per rank, a triple (F action or None, B action or None, W action
      or None). Raises: ScheduleError with the rounds so far when a round makes no progress.
    """
    if schedule.one_per_round:
        return _pack_in_order(schedule, one_per_round=True)
    packed = _pack_in_order(schedule, one_per_round=False)
    return _place_weight_grads(schedule, packed, costs) if schedule.split_backward else packed


def packed_time(packed: list, costs: Costs, split: bool, chunks: int) -> float:
    """The lockstep time of packed rounds, each round as costs.round prices it."""
    return sum(costs.round(row, split, chunks) for row in packed)


def can_run(ran: dict, a: Action, s: int, t: int, last: int) -> bool:
    """Whether a, on virtual stage s (last: the last one), can run in round t, given
    ran[(kind, microbatch, virtual stage)] = the round of each action run so far."""
    if a.kind == "F":  # strict '<': an activation sent in round t is usable from t+1
        return s == 0 or ran.get(("F", a.microbatch, s - 1), t) < t
    if a.kind == "W":  # its own B, in this round's B slot or before
        return ran.get(("B", a.microbatch, s), t + 1) <= t
    return (ran.get(("F", a.microbatch, s), t + 1) <= t
            and (s == last or ran.get(("B", a.microbatch, s + 1), t) < t))


def _pack_in_order(schedule: Schedule, one_per_round: bool) -> list:
    """Each rank's order, each action in the first round where it is ready, never
    reordered: the F and B actions, at most one of each a round (F first; W's are placed
    afterwards), or, one_per_round, every action, at most one a round."""
    p, S = schedule.stages, schedule.stages * schedule.chunks
    orders = [[a for a in acts if one_per_round or a.kind != "W"] for acts in schedule.actions]
    ran, pos, rounds = {}, [0] * p, []  # ran[(kind, microbatch, virtual stage)] = round
    while any(pos[r] < len(acts) for r, acts in enumerate(orders)):
        t, row = len(rounds), []
        for r, acts in enumerate(orders):
            slots = [None, None, None]
            for wanted in ("any",) if one_per_round else ("F", "B"):
                a = acts[pos[r]] if pos[r] < len(acts) else None
                if a and wanted in (a.kind, "any") and can_run(
                        ran, a, schedule.stage(a.chunk, r), t, S - 1):
                    slots["FBW".index(a.kind)] = a
                    ran[(a.kind, a.microbatch, schedule.stage(a.chunk, r))] = t
                    pos[r] += 1
            row.append(tuple(slots))
        if not any(any(slots) for slots in row):
            raise _deadlock_error(schedule, rounds, pos, orders)
        rounds.append(row)
    return rounds


def _deadlock_error(schedule: Schedule, rounds: list, pos: list, orders: list
                    ) -> ScheduleError:
    """The rounds so far, then each rank's blocked next action marked '!'."""
    rows = round_cells(rounds, schedule.chunks) or [[] for _ in orders]
    for r, acts in enumerate(orders):
        rows[r].append(acts[pos[r]].label(schedule.chunks) + "!" if pos[r] < len(acts) else ".")
    return ScheduleError(f"deadlock at round {len(rounds)}: no rank's next action (marked !) "
                         f"can ever become ready\n{format_grid(rows, 'round')}")


def _place_weight_grads(schedule: Schedule, packed: list, costs: Costs) -> list:
    """Puts each rank's W's, in its order, into the W slots of F/B-packed rounds (see the
    module docstring for the rule), appending rounds of W's alone after the last B.

    The cap on microbatch-stages a rank holds (from their input's arrival to their W) is
    the F/B packing's peak stash (from arrival to B; its max over ranks): zb-h1 keeps
    1F1B's peak.
    """
    p, v = schedule.stages, schedule.chunks
    arrivals = [_arrivals(row, schedule) for row in packed]
    live, cap = [0] * p, 0  # live[r]: held from arrival until B, as lowering counts it
    for row, arrived in zip(packed, arrivals):
        for r, (_, ba, _) in enumerate(row):
            live[r] += arrived[r]
            cap = max(cap, live[r])
            live[r] -= ba is not None
    queues = [deque(a for a in acts if a.kind == "W") for acts in schedule.actions]
    backward_done, held, out, t = set(), [0] * p, [], 0  # held: arrived, W not done
    while t < len(packed) or any(queues):
        row = packed[t] if t < len(packed) else [(None, None, None)] * p
        work = [sum(costs.of(a, True, v) for a in slots if a) for slots in row]
        left = [len(q) for q in queues]  # W's each rank has still to run, this round's too
        chosen = [None] * p
        for r, (fa, ba, _) in enumerate(row):
            held[r] += arrivals[t][r] if t < len(packed) else 0
            if ba:
                backward_done.add((r, ba.microbatch, ba.chunk))
        ready = [bool(q) and (r, q[0].microbatch, q[0].chunk) in backward_done
                 for r, q in enumerate(queues)]
        for r in range(p):
            coming = arrivals[t + 1][r] if t + 1 < len(packed) else 0
            if ready[r] and (held[r] + coming > cap or t >= len(packed)):
                chosen[r] = _take(queues[r], row[r][1])
                work[r] += costs.wgt / v
        if costs.masked:
            open_slot = any(chosen) or all(ready[r] for r in range(p) if left[r] == max(left))
            free = [open_slot] * p
        else:
            free = [work[r] + costs.wgt / v <= max(work) + 1e-12 for r in range(p)]
        for r in range(p):
            if chosen[r] is None and ready[r] and free[r]:
                chosen[r] = _take(queues[r], row[r][1])
            held[r] -= chosen[r] is not None
        assert t < len(packed) or any(chosen), "a W that no B precedes (validate's rule)"
        out.append([(fa, ba, wa) for (fa, ba, _), wa in zip(row, chosen)])
        t += 1
    return out


def _take(queue: deque, backward) -> Action:
    """From a rank's pending W's (oldest first), the W of `backward` (this round's B, or
    None) if it is pending, else the oldest."""
    for a in queue:
        if backward and (a.microbatch, a.chunk) == (backward.microbatch, backward.chunk):
            queue.remove(a)
            return a
    return queue.popleft()


def _arrivals(row: list, schedule: Schedule) -> list:
    """Per rank: stage inputs that arrive in a round (virtual stage 0: made by its F)."""
    p, v = schedule.stages, schedule.chunks
    arrived = [0] * p
    for r, (fa, _, _) in enumerate(row):
        s = schedule.stage(fa.chunk, r) if fa else None
        if s == 0:
            arrived[r] += 1
        if fa and s < p * v - 1:
            arrived[stage_place(schedule.v_shape, p, s + 1)[1]] += 1
    return arrived
