"""The per-slot work of a forward-only schedule (evaluation): F slots alone.

Owns `Evaluation`: each F slot runs the embedding (virtual stage 0), its chunk of layers
and the head (the last virtual stage), no vjp, the loss summed in the carry.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxptd import model as models
from jaxptd.parallel.mesh import PIPE, TOKENS
from jaxptd.pipeline import buffers
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.lowering import Rounds
from jaxptd.pipeline.stage import Stage
from jaxptd.parallel.varying import mark_varying


class Evaluation:
    """The F slots of a forward-only schedule: embedding, layers and head, the loss summed."""

    def __init__(self, context: Context, rounds: Rounds, params, batch, norm):
        self.p, self.v, self.tensor = context.pipe, context.chunks, context.message_split
        self.rounds = rounds
        self.stage = Stage(context, batch, jax.random.key(0), deterministic=True, norm=norm)
        self.params, self.ends = params, models.ends(params)
        self.backward = self.weight = None  # their slots are 'off'

    def initial_carry(self):
        return {"stash": self.stage.buffer(self.rounds.spare("stash") + 1),
                "loss": mark_varying(jnp.zeros((), jnp.float32), (*TOKENS, PIPE))}

    def forward(self, carry, row, valid, seg):
        mb, chunk = row["f_mb"], buffers.chunk_of(row, "f", self.v)
        x = self.stage.embed_or_input(self.ends, buffers.read(carry["stash"], row["f_slot"]),
                                      mb, chunk, seg.piece("embed", "F"))
        y = self.stage.layers(buffers.chunk(self.params["layers"], chunk), x, mb, chunk)
        loss = self.stage.head(self.ends, y, mb, chunk, seg.piece("head", "F"))
        return y, {**carry, "loss": carry["loss"] + buffers.masked(loss, valid)}
