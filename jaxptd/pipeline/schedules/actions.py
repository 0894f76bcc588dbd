"""What a schedule is: its `Action`s (F, B, W of a microbatch's chunk), their `Costs`, the
`Schedule` record of each rank's order, the kinds, and `ScheduleError`. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass

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
