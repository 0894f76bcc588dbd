"""The rules a schedule must keep (the package docstring's invariants): `validate` for a
schedule's actions, `check_layers` for how the model's layers split into its chunks.
Pure Python."""
from __future__ import annotations

from jaxptd.pipeline.schedules.actions import Action, Costs, Schedule, ScheduleError
from jaxptd.pipeline.schedules.grid import format_grid
from jaxptd.pipeline.schedules.packing import pack_rounds


def check_layers(num_layers: int, stages: int, chunks: int) -> int:
    """Returns layers per chunk; raises ScheduleError unless p*v chunks divide num_layers
    exactly (a silently smaller model is the worst outcome)."""
    if num_layers < 1 or num_layers % (stages * chunks):
        raise ScheduleError(f"num_layers={num_layers} must be a positive multiple of "
                            f"stages*chunks={stages}*{chunks}={stages * chunks}")
    return num_layers // (stages * chunks)


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
