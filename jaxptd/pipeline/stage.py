"""One virtual stage of the pipeline on this rank: [embedding] -> a chunk of layers ->
[head + loss], and the stage-input buffers its slots read.

Owns how a slot calls the model (its microbatch's tokens and dropout key, FSDP's gathers)
and where the embedding and the head run: on virtual stage 0 and on the last only, as a
`lax.cond` on the rank, or (inline) computed by every rank and selected.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd import model as models
from jaxptd.parallel.mesh import PIPE, TENSOR, TOKENS
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.schedules import virtual_stage
from jaxptd.parallel.sharding import regather
from jaxptd.parallel.varying import mark_varying


# The name scopes of the embedding's and the head's conditionals (what a static reading
# of a conditional round form tells them by: bench/cond_rounds.py).
EMBED_SCOPE, HEAD_SCOPE = "embed_cond", "head_cond"


class Stage:
    """The pieces of a virtual stage, for one step's batch on this pipe rank.

    `ends` holds the parameters of the pieces at the two ends (model.ends), each leaf
    [1, ...] this rank's slot (jaxptd/train/step.py's Setup); `layers` one chunk's stack
    [Lc, ...]. Chunk c on rank r runs virtual stage c p + r, or V-shaped r and
    2p - 1 - r (schedules.virtual_stage).
    """

    def __init__(self, context: Context, batch, key, deterministic: bool, norm):
        """norm: the loss's normalisation, 1 / the global batch's counted targets (the
        step's loss_norm: with packed rows a traced scalar, invariant over the mesh)."""
        self.context, self.model, self.layout = context, context.model, context.layout
        self.norm = norm
        self.micro = batch.reshape(context.microbatches, -1, batch.shape[-1])  # [m, b, w]
        self.key, self.rank = key, lax.axis_index(PIPE)
        self.deterministic = deterministic
        self.last = context.last_stage
        gather_ends = context.gather_ends or (lambda ends: ends)  # FSDP: shards -> whole
        # ends leaves [1, ...]: this stage's slot (zeros where the stage does not read it)
        self.gather_ends = lambda ends: jax.tree.map(lambda x: x[0], gather_ends(ends))
        gather_layer = context.gather_layer
        self.prepare = None if gather_layer is None else (lambda p, _: gather_layer(p))
        self.keep = gather_layer and regather

    def vstage(self, chunk):
        return virtual_stage(self.context.v_shape, self.context.pipe, chunk, self.rank)

    def buffer(self, slots):
        """Zeros [slots, b, s/c, h] for stage inputs or their gradients (c: context ranks):
        varying over data, context and pipe and the same on every tensor rank, like the
        activations they receive (with sequence parallelism [slots, b, s/(c t), h], varying
        over tensor too)."""
        split = self.layout.split_sequence
        seq = self.model.seq_len // self.layout.context // (self.layout.tensor if split else 1)
        shape = (slots, self.micro.shape[1], seq, self.model.hidden_size)
        axes = (*TOKENS, PIPE, TENSOR) if split else (*TOKENS, PIPE)
        return mark_varying(jnp.zeros(shape, jnp.dtype(self.model.dtype)), axes)

    def tokens(self, mb):
        return lax.dynamic_index_in_dim(self.micro, mb, 0, keepdims=False)  # [b, row width]

    def stage_key(self, mb, chunk):
        return jax.random.fold_in(jax.random.fold_in(self.key, mb), self.vstage(chunk))

    def embed_or_input(self, ends, x_in, mb, chunk, how: str):
        """Virtual stage 0 embeds its microbatch; the others take the received input.
        how: 'cond', 'inline' (every rank embeds, stage 0 keeps it) or 'off' (no rank's
        slot is stage 0)."""
        def embed():
            return self.context.arch.embed(self.gather_ends(ends), self.tokens(mb),
                                           self.stage_key(mb, chunk), self.model,
                                           self.layout, self.deterministic)
        if how == "cond":
            with jax.named_scope(EMBED_SCOPE):
                return lax.cond(self.vstage(chunk) == 0, embed, lambda: x_in)
        return jnp.where(self.vstage(chunk) == 0, embed(), x_in) if how == "inline" else x_in

    def layers(self, layers, x, mb, chunk, perturbations=None, with_stats=False, wait=None,
               apart=False):
        """The chunk's layers at x (models.apply_layers; wait: what its middle layer
        waits for; apart: for a backward that runs apart from them, as `layer`)."""
        return models.apply_layers(layers, x, self.tokens(mb), self.stage_key(mb, chunk),
                                   self.model, self.layout, self.deterministic,
                                   perturbations, self.prepare, keep=self.keep,
                                   with_stats=with_stats, wait=wait, apart=apart)

    def layer(self, params, x, mb, chunk, index: int):
        """Layer `index` of a chunk on its own, as `layers` runs it, for a backward that
        runs apart from it (a kept backward: models.layer_function) -> (y, statistics)."""
        return models.apply_layer(params, x, index, self.tokens(mb), self.stage_key(mb, chunk),
                                  self.model, self.layout, self.deterministic, self.prepare,
                                  keep=self.keep, apart=True)

    def head(self, ends, y, mb, chunk, how: str):
        """The loss contribution (its token sum times `norm`) of the last stage; 0
        elsewhere. how: as for embed_or_input."""
        def loss():
            return self.context.arch.head_loss(self.gather_ends(ends), y, self.tokens(mb),
                                               self.model, self.layout) * self.norm

        def zero():
            return mark_varying(jnp.zeros((), jnp.float32), (*TOKENS, PIPE))
        is_last = self.vstage(chunk) == self.last
        if how == "cond":
            with jax.named_scope(HEAD_SCOPE):
                return lax.cond(is_last, loss, zero)
        return jnp.where(is_last, loss(), 0.0) if how == "inline" else zero()
