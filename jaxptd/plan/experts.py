"""A mixture of experts as the planner's formulas read it: its shape (`Moe`, from the
config: jaxptd/plan/program.py's moe_shape) and the rows one MoE layer routes, takes and
allocates on a rank (`moe_rows`), which its activations (jaxptd/plan/model.py's
moe_mlp_bytes) and its all-to-all (jaxptd/plan/timing.py's moe_volumes) are counted in.
Shapes being static, a dropless layer with expert parallelism sizes its rows for the worst
routing, all of an expert group's rows arriving at one rank (moe_rows); what that takes
over balanced routing is what the planner reports as the imbalance headroom. No JAX.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Moe:
    """A mixture of experts' shape as the formulas read it (jaxptd/model/moe.py): E routed
    experts of hidden width fe (model.expert_ffn), top_k of them a token, a shared expert
    of width fs (0: none), ep expert-parallel ranks (parallel.expert), capacity factor cf
    (model.moe_capacity, 0: dropless), in one layer of every `every` (model.moe_every; the
    others dense). balanced: the experts' rows as balanced routing would need them, not as
    the layer allocates them (moe_rows)."""
    experts: int
    top_k: int
    ffn: int
    shared_ffn: int = 0
    ep: int = 1
    capacity: float = 0.0
    balanced: bool = False
    every: int = 1


def moe_rows(tokens: float, moe: Moe) -> dict:
    """Rows of one MoE layer on a rank, one microbatch of `tokens` tokens (T = b s / c: with
    sequence parallelism still the microbatch's, the MLP sees them gathered). routed: A = T
    top_k (token, expert) pairs, what dispatch sends and combine brings back. balanced:
    the rows the rank's experts take when routing is balanced, A (each of the e ranks
    receives A / e rows from each of e ranks). allocated: the rows the layer's buffers
    hold, shapes being static: dropless with e > 1 the receive buffer and every expert
    matmul after it are sized for the worst case, all e A rows of the group at one rank
    (rows past those received are zeros); capacity mode (cf > 0) E x ceil(cf A / E) slots
    (an expert's overflow dropped), balanced or not."""
    routed = tokens * moe.top_k
    if moe.capacity:
        slots = moe.experts * max(1, math.ceil(moe.capacity * routed / moe.experts))
        return {"routed": routed, "balanced": slots, "allocated": slots}
    return {"routed": routed, "balanced": routed, "allocated": moe.ep * routed}
