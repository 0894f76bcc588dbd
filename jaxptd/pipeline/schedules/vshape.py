"""The F/B order of ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", the V-shaped
schedule): two chunks a rank placed in a V (actions.virtual_stage: chunk 0 of rank r is
stage r, chunk 1 stage 2p - 1 - r), so a microbatch goes down the ranks and back up, the
turn on rank p - 1 is a hand-off to itself and the first and last stages (embedding,
head and loss) are both on rank 0. Pure Python; make.py places its W's as for the other
zero-bubble kinds.

The order is made by a greedy walk over lockstep rounds (the package docstring's rules:
an F slot, then a B slot, a message usable the round after it is sent), which then packs
to exactly these rounds: in every round each rank runs
- in its F slot its next chunk-1 forward if ready, else its next chunk-0 forward if
  ready while it holds fewer than 2p microbatches from their chunk-0 forward to their
  chunk-0 backward (the cap bounds the stash; a chunk 1 forward takes what arrived
  anyway);
- in its B slot its next chunk-0 backward if ready (it ends the microbatch on the rank),
  else its next chunk-1 backward.
Each microbatch's chunk 0 input is held from its arrival until its B 2(p - 1 - r) + 1
hops and back later, which the cap of 2p keeps to about 1F1B's lockstep stash (2p - 1
whole stages on rank 0) in chunk-sized pieces on every rank, half of it in bytes. In
the simulator (masked, p = 8, m = 32) the cap 2p costs half a unit more than 3p and
holds 20 chunk-stages a rank at most against 24; below 2p it loses more (p: 152 units
against 110.5).

No order does much better in lockstep rounds, where each hop takes a round: rank p - 1
runs its 2m forwards from round p - 1 on, one a round, so its last (microbatch m - 1's
chunk 1, stage p) runs at round 2m + p - 2 or later, and the last stage's, p - 1 hops
further on rank 0, at 2m + 2p - 3 or later; backwards likewise. Masked, the rounds that
hold a forward (half a stage's) number at least 2m + 2(p - 1), as do those that hold a B,
and the step costs at least 3m + 2(p - 1) units: zb-h1's masked time, 110 at p = 8,
m = 32 (the cap 3p reaches it). The paper's zero bubble comes from a chunk starting as
soon as its input exists, half a stage after its sender's, not a whole round later.
"""
from __future__ import annotations

from jaxptd.pipeline.schedules.actions import Action, Schedule
from jaxptd.pipeline.schedules.packing import can_run


def v_order(p: int, m: int) -> Schedule:
    """ZB-V's F/B order (the module docstring's rule) as a Schedule of kind 'zb-v', two
    chunks a rank, without W's (make.py adds and places them)."""
    shape = Schedule("zb-v", p, m, 2, tuple(() for _ in range(p)))
    last, cap = 2 * p - 1, 2 * p
    ran, orders, t = {}, [[] for _ in range(p)], 0  # ran[(kind, mb, virtual stage)] = round
    done = [{("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0} for _ in range(p)]
    while any(len(acts) < 4 * m for acts in orders):
        for r, count in enumerate(done):
            open_mbs = count[("F", 0)] - count[("B", 0)]
            for kind, chunks in (("F", (1, 0)), ("B", (0, 1))):
                for c in chunks:
                    a = Action(kind, count[(kind, c)], c)
                    s = shape.stage(c, r)
                    if a.microbatch < m and not (kind == "F" and c == 0 and open_mbs >= cap) \
                            and can_run(ran, a, s, t, last):
                        ran[(kind, a.microbatch, s)] = t
                        count[(kind, c)] += 1
                        orders[r].append(a)
                        break
        t += 1
        assert t <= 4 * m * p + 4 * p, "the greedy rule stalled"
    return Schedule("zb-v", p, m, 2, tuple(map(tuple, orders)))
