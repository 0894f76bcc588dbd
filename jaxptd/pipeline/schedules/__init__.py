"""Pipeline schedules as data: the per-rank order of forward (F), backward (B) and weight-
gradient (W) actions, their generators, the rules a schedule must keep, and the greedy
packing of the orders into the lockstep rounds the JAX executor runs. Pure Python: never
imports JAX. `lowering.py` turns packed rounds into the executor's slot tables,
`simulate.py` times them and holds the CLI `python -m jaxptd.pipeline.schedules`, which
runs it through this package's `__main__.py` (a package, so that the CLI sits above
lowering and simulate instead of in a module they import).

Kinds: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (PTD-P paper §2.2), and the zero-
bubble schedules of Qi et al. (ICLR 2024), which split each backward into B, the gradient
of the stage input (the previous stage waits for it), and W, the weight gradients (nobody
waits): zb-h1 (1F1B's F/B order, W placed in the bubbles) and zb-interleaved (the same on
interleaved chunks). Other kinds have no W: their B computes every gradient.

Invariants:
- p ranks, v chunks per rank, m microbatches; virtual stage s = c*p + r for chunk c on
  rank r; stages run in order 0..p*v-1; activations go r -> (r+1)%p, gradients r -> (r-1)%p.
- A training `Schedule` that `validate` accepts holds every (microbatch, chunk) F and B
  exactly once per rank, each F before its B, and, for zero-bubble kinds, one W after each
  B; its packing has no deadlock. A forward-only one (made by `forward_only`, and flagged
  so) holds every F exactly once per rank and nothing else.
- A round has an F slot, a B slot and a W slot, in that order, on every rank. A message
  (an activation or an input gradient) sent in round t is usable from round t + 1; the
  last virtual stage may run the B of a microbatch in the round of its F, and a W may run
  in the round of its B. `pack_rounds` is greedy and in order: each rank takes its next
  action in the first slot of its kind where it is ready, never reorders. A schedule made
  `one_per_round` is packed the same way with at most one action a rank a round.
- Lockstep changes one thing from the papers: 1f1b warms up with 2*(p-r-1) forwards, not
  PipeDream-Flush's p-r-1 (see make_schedule), so that the greedy packing reaches the
  bubble (p-1)/m; interleaved keeps Megatron's count and reaches (p-1)/(v*m) for m >= p.

Zero-bubble kinds are made two ways, and make_schedule keeps the one whose rounds cost
less under its costs (on a tie, the one with fewer rounds):
- W's in the slots (`_place_weight_grads`; both kinds): the F/B order of the base kind is
  packed first; then, round by round, each rank runs at most one pending W, where it costs
  nothing (the rank has slack in a round whose cost another rank sets) or where it must
  (the microbatches a rank holds from F to W would exceed the base kind's peak stash).
  Leftover W's run after the last B. About m + 3p rounds (v = 1), most of them full on
  every rank (what the steady round form runs without conditionals). With uniform costs
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

from collections import deque
from dataclasses import dataclass, replace

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved")
ZERO_BUBBLE = {"zb-h1": "1f1b", "zb-interleaved": "interleaved"}  # kind -> its F/B order


class ScheduleError(ValueError):
    """A schedule or its parameters break a rule; the message names value and rule."""


@dataclass(frozen=True)
class Action:
    kind: str  # 'F', 'B' or 'W'
    microbatch: int
    chunk: int

    def label(self, chunks: int = 1) -> str:
        """'F3' for one chunk per rank, 'F3.1' (microbatch 3, chunk 1) otherwise."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if chunks > 1 else "")


@dataclass(frozen=True)
class Costs:
    """One microbatch's forward, input-gradient (B) and weight-gradient (W) time over all
    of a rank's layers; a kind without W runs B + W in its B."""
    fwd: float = 1.0
    bwd: float = 1.0
    wgt: float = 1.0

    def of(self, action: Action, split: bool, chunks: int) -> float:
        """The time of one action (one chunk's share of the rank's layers)."""
        full = {"F": self.fwd, "B": self.bwd if split else self.bwd + self.wgt, "W": self.wgt}
        return full[action.kind] / chunks


@dataclass(frozen=True)
class Schedule:
    kind: str
    stages: int
    microbatches: int
    chunks: int
    actions: tuple  # actions[r]: rank r's ordered tuple of Action
    forward_only: bool = False  # no backward: a pipelined forward pass (evaluation)
    one_per_round: bool = False  # each rank runs at most one action a round (zb-h1, small m)

    @property
    def split_backward(self) -> bool:
        """True when B is the input gradient alone and W the weight gradients."""
        return self.kind in ZERO_BUBBLE and not self.forward_only


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
    if "interleaved" not in kind and chunks != 1:
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
      and zb-h1, >= 1 for the interleaved kinds, where v = 1 gives exactly the v = 1 kind);
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
    """(the base kind's F/B order with each rank's W's placed by `_place_weight_grads`,
    the per-rank order as packed; its packed rounds)."""
    base = make_schedule(ZERO_BUBBLE[kind], p, m, v)
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
            a = next((a for a in wanted if a.microbatch < m and _ready(ran, a, r, t, p - 1)),
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
    """The lockstep time of packed rounds: each round costs its busiest rank's work."""
    return sum(max(sum(costs.of(a, split, chunks) for a in slots if a) for slots in row)
               for row in packed)


def _ready(ran: dict, a: Action, s: int, t: int, last: int) -> bool:
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
                if a and wanted in (a.kind, "any") and _ready(ran, a, a.chunk * p + r, t,
                                                               S - 1):
                    slots["FBW".index(a.kind)] = a
                    ran[(a.kind, a.microbatch, a.chunk * p + r)] = t
                    pos[r] += 1
            row.append(tuple(slots))
        if not any(any(slots) for slots in row):
            raise _deadlock_error(schedule, rounds, pos, orders)
        rounds.append(row)
    return rounds


def format_grid(rows: list, column_name: str, marks: dict | None = None) -> str:
    """rows[r][t] strings -> aligned text; marks {(r, t): '!'} appended to cells."""
    marks = marks or {}
    rows = [[c + marks.get((r, t), "") for t, c in enumerate(row)] for r, row in enumerate(rows)]
    width = max([len(c) for row in rows for c in row] + [2])
    ncol = max(len(row) for row in rows)
    head = f"{column_name:>7} " + " ".join(f"{t:<{width}}" for t in range(ncol))
    body = [f"rank {r:<2} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(rows)]
    return "\n".join(line.rstrip() for line in [head] + body)


def round_cells(packed: list, chunks: int) -> list:
    """Per rank, per round: the round's actions as 'F0 B1 W0' text ('.' for an empty slot;
    the B and W columns only when some round uses them)."""
    width = max([i + 1 for row in packed for slots in row for i, a in enumerate(slots) if a]
                + [1])
    return [[" ".join(a.label(chunks) if a else "." for a in row[r][:width]).rstrip()
             for row in packed] for r in range(len(packed[0]) if packed else 0)]


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
    arrivals = [_arrivals(row, p, v) for row in packed]
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
        chosen = [None] * p
        for r, (fa, ba, _) in enumerate(row):
            held[r] += arrivals[t][r] if t < len(packed) else 0
            if ba:
                backward_done.add((r, ba.microbatch, ba.chunk))
            ready = queues[r] and (r, queues[r][0].microbatch, queues[r][0].chunk) in \
                backward_done
            coming = arrivals[t + 1][r] if t + 1 < len(packed) else 0
            if ready and (held[r] + coming > cap or t >= len(packed)):
                chosen[r] = queues[r].popleft()
                work[r] += costs.wgt / v
        round_cost = max(work)
        for r in range(p):
            ready = queues[r] and (r, queues[r][0].microbatch, queues[r][0].chunk) in \
                backward_done
            if chosen[r] is None and ready and work[r] + costs.wgt / v <= round_cost + 1e-12:
                chosen[r] = queues[r].popleft()
            held[r] -= chosen[r] is not None
        assert t < len(packed) or any(chosen), "a W that no B precedes (validate's rule)"
        out.append([(fa, ba, wa) for (fa, ba, _), wa in zip(row, chosen)])
        t += 1
    return out


def _arrivals(row: list, p: int, v: int) -> list:
    """Per rank: stage inputs that arrive in a round (virtual stage 0: made by its F)."""
    arrived = [0] * p
    for r, (fa, _, _) in enumerate(row):
        if fa and fa.chunk * p + r == 0:
            arrived[r] += 1
        if fa and fa.chunk * p + r < p * v - 1:
            arrived[(r + 1) % p] += 1
    return arrived


def validate(schedule: Schedule, costs: Costs = Costs()) -> list:
    """Checks a schedule against its rule (training or forward-only); returns its packed
    rounds (see pack_rounds).

    Raises: ScheduleError naming the rule, with a rank x position grid (offending action
      marked '!') for per-rank errors, or the rank x round grid for a deadlock.
    """
    p, v, m = schedule.stages, schedule.chunks, schedule.microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"actions has {len(schedule.actions)} ranks, stages={p}")
    kinds = "F" if schedule.forward_only else "FBW" if schedule.split_backward else "FB"
    rule = {"F": "forward-only: each F exactly once, no B",
            "FB": "each F and B exactly once, F before its B",
            "FBW": "each F, B and W exactly once, F before its B before its W"}[kinds]
    before = {"B": "F", "W": "B"}
    for r, acts in enumerate(schedule.actions):
        seen, bad = {}, None
        for i, a in enumerate(acts):
            key = (a.kind, a.microbatch, a.chunk)
            if a.kind not in kinds or not (0 <= a.microbatch < m and 0 <= a.chunk < v):
                bad = (i, f"{a} is outside kind {'/'.join(kinds)}, microbatch < {m}, "
                          f"chunk < {v}")
            elif key in seen:
                bad = (i, f"{a.label(v)} appears twice")
            elif a.kind in before and (before[a.kind], a.microbatch, a.chunk) not in seen:
                bad = (i, f"{a.label(v)} comes before its "
                          f"{'forward' if a.kind == 'B' else 'backward'}")
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
            grid = format_grid(rows, "pos", {(r, bad[0]): "!"})
            raise ScheduleError(f"rank {r}: {bad[1]} ({rule})\n{grid}")
    return pack_rounds(schedule, costs)

