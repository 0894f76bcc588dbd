"""What the pipeline executor reads from the run's configuration, as one frozen value.

Owns `Context`: built once per step program by jaxptd/train/step.py (`pipeline_context`) from
the config and Setup, so the executor's modules never see the whole Config or Setup.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxptd.config import ModelConfig
from jaxptd.model.tensor import Layout
from jaxptd.pipeline.schedules import V_SHAPED, head_rank


@dataclasses.dataclass(frozen=True)
class Context:
    """The schedule, the model's functions and the layout one pipeline program runs with."""
    schedule: str  # parallel.schedule (schedules.make_schedule's kind)
    pipe: int  # p: pipeline ranks
    chunks: int  # v: virtual stages (layer chunks) per rank
    microbatches: int  # m
    stash: str  # parallel.stash: 'activations' (keep the vjp) or 'inputs' (recompute)
    round_form: str  # 'cond', 'steady' or 'masked' ('auto' already resolved)
    message_split: int  # tensor ranks that split a stage-to-stage message (1 with SP)
    model: ModelConfig  # passed to the model's functions (dtype, shapes, remat policy)
    layout: Layout  # one tensor rank's view of the parameters (step.Setup.local_layout)
    arch: Any  # the model family's module: embed(...) and head_loss(...)
    # 1 / (global batch x seq_len): the balance terms' normalisation (a mean over every
    # token; the loss's own is the step's loss_norm, given with the batch: `Stage.norm`)
    token_norm: float
    # every rank runs the head on 1/p of the microbatch, its rows cut in this many pieces
    # each (scans.head_pieces); 0: the last stage runs it alone
    head_pieces: int
    # steady form: the shortest stretch of rounds without the head run as a scan of its own
    # (scans.headless_stretch); 0: none
    headless: int
    # FSDP's all-gathers inside the shard_map (step.Setup.gathers); None without FSDP
    gather_ends: Callable | None = None
    gather_layer: Callable | None = None

    @property
    def spread_head(self) -> bool:
        """Whether every pipe rank runs the head on its share (pipeline/head.py)."""
        return self.head_pieces > 0

    @property
    def last_stage(self) -> int:
        """The last virtual stage's index, p v - 1 (it runs the head and the loss)."""
        return self.pipe * self.chunks - 1

    @property
    def v_shape(self) -> bool:
        """Whether the chunks are placed in a V (schedules.virtual_stage)."""
        return self.schedule in V_SHAPED

    @property
    def head_rank(self) -> int:
        """The rank of the last virtual stage: p - 1, or 0 V-shaped."""
        return head_rank(self.v_shape, self.pipe, self.chunks)

