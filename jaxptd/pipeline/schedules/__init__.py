"""Pipeline schedules as data: the per-rank order of forward (F), backward (B) and weight-
gradient (W) actions (actions.py), their generators (make.py), the rules a schedule must
keep (rules.py), the greedy packing of the orders into the lockstep rounds the JAX
executor runs (packing.py) and their text grids (grid.py); this module gathers the
package's public names. Pure Python: never imports JAX. `lowering.py` turns packed rounds
into the executor's slot tables, `simulate.py` times them and holds the CLI
`python -m jaxptd.pipeline.schedules`, which runs it through this package's `__main__.py`
(a package, so that the CLI sits above lowering and simulate instead of in a module they
import).

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
- Zero-bubble kinds are made two ways, and make_schedule keeps the one whose rounds cost
  less (make.py).
- A round's cost (Costs): its busiest rank's work where idle slots are skipped (the cond
  round form), or, Costs.masked, the sum over its slot kinds of the longest action (a
  GPU's forms run a kind some rank uses on every rank); the W's are placed for the one
  given (packing.py), so the executor packs for the round form it runs.
"""
from jaxptd.pipeline.schedules.actions import (KINDS, V_SHAPED, ZERO_BUBBLE, Action, Costs,
                                               Schedule, ScheduleError, head_rank,
                                               stage_place, virtual_stage)
from jaxptd.pipeline.schedules.grid import format_grid, round_cells
from jaxptd.pipeline.schedules.make import forward_only, make_schedule
from jaxptd.pipeline.schedules.packing import pack_rounds, packed_time
from jaxptd.pipeline.schedules.rules import check_layers, validate

__all__ = ["KINDS", "V_SHAPED", "ZERO_BUBBLE", "Action", "Costs", "Schedule", "ScheduleError",
           "check_layers", "forward_only", "format_grid", "head_rank", "make_schedule",
           "pack_rounds", "packed_time", "round_cells", "stage_place", "validate",
           "virtual_stage"]
