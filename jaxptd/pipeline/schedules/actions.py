"""What a schedule is: its `Action`s (F, B, W of a microbatch's chunk), their `Costs`, the
`Schedule` record of each rank's order, the kinds, and `ScheduleError`. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved", "zb-v")
# kind -> its F/B order (zb-v's is its own: vshape.py)
ZERO_BUBBLE = {"zb-h1": "1f1b", "zb-interleaved": "interleaved", "zb-v": "zb-v"}
V_SHAPED = ("zb-v",)  # kinds whose chunk 1 runs back up the ranks (virtual_stage)


def virtual_stage(v_shape: bool, p: int, chunk, rank):
    """The virtual stage chunk c of rank r runs (ints, or traced arrays alike): c p + r,
    or V-shaped (two chunks) r for chunk 0 and 2p - 1 - r for chunk 1, so that stage
    p - 1's output feeds stage p on the same rank and the last stage is on rank 0."""
    if v_shape:
        return rank + chunk * (2 * p - 1 - 2 * rank)
    return chunk * p + rank


def stage_place(v_shape: bool, p: int, stage: int) -> tuple:
    """(chunk, rank) of a virtual stage: virtual_stage's inverse."""
    chunk = stage // p
    return chunk, (2 * p - 1 - stage if v_shape and chunk else stage % p)


def head_rank(v_shape: bool, p: int, v: int) -> int:
    """The rank of the last virtual stage (the head and the loss): p - 1, V-shaped 0."""
    return stage_place(v_shape, p, p * v - 1)[1]


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
    of a rank's layers (a kind without W runs B + W in its B), and how a lockstep round
    costs them. masked=False: a round lasts its busiest rank's work, idle slots skipped
    (the executor's cond round form). masked=True: a slot kind that some rank uses in a
    round runs on every rank (the steady and masked forms, a GPU's: no conditional), so
    the round lasts the sum over its slot kinds of the longest action of that kind; a W
    placed where no other rank has one costs every rank a W."""
    fwd: float = 1.0
    bwd: float = 1.0
    wgt: float = 1.0
    masked: bool = False

    def of(self, action: Action, split: bool, chunks: int) -> float:
        """The time of one action (one chunk's share of the rank's layers)."""
        full = {"F": self.fwd, "B": self.bwd if split else self.bwd + self.wgt, "W": self.wgt}
        return full[action.kind] / chunks

    def slot_times(self, row, split: bool, chunks: int) -> tuple:
        """Masked: how long each slot (F, B, W) of a round lasts on every rank, its longest
        action (0 where no rank uses it). row: per rank, its (F, B, W) actions or None."""
        return tuple(max((self.of(slots[k], split, chunks) for slots in row if slots[k]),
                         default=0.0) for k in range(3))

    def round(self, row, split: bool, chunks: int) -> float:
        """The time of one round (the model of the class docstring)."""
        if self.masked:
            return sum(self.slot_times(row, split, chunks))
        return max(sum(self.of(a, split, chunks) for a in slots if a) for slots in row)


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

    @property
    def v_shape(self) -> bool:
        """True when the chunks are placed in a V (virtual_stage)."""
        return self.kind in V_SHAPED

    def stage(self, chunk: int, rank: int) -> int:
        """The virtual stage of a rank's chunk (virtual_stage)."""
        return virtual_stage(self.v_shape, self.stages, chunk, rank)
