"""The per-slot work of a training schedule on this pipe rank: F, B and W.

Owns what each slot computes and keeps, its carry and the gradient sums; the vjps of a
layer chunk and the kept backward a layer at a time are chunk.py's (`Chunks`), the
embedding and the head stage.py's and head.py's. parallel.stash chooses what a stash slot
keeps between a stage's F and B slot:
- activations (default): the F slot takes `jax.vjp` of its layer chunk and keeps its
  backward's residuals as arrays (`kept.Kept`; the chunk's own weights, which the backward
  reads too, are passed in again instead of kept). With unrolled layers (a GPU's) and
  sequence parallelism or one tensor rank (`kept_by_layer`) it takes one vjp a layer and
  stores each layer's residuals before the next layer runs; the B slot reads them a
  layer at a time as its gradient reaches the layer, adds each layer's weight gradients
  to the sums as they are made, and runs the recomputation without a barrier
  (model.fused.backward_apart, model.layer_function's apart): the forward is another
  slot's. Elsewhere B runs the chunk's kept backward whole, as apart, and one chunk of
  unrolled layers adds each layer's gradients to per-layer sums too (`_add_layers`);
- inputs: only the stage input [b, s, h] is kept and the B slot takes `jax.vjp` of the whole
  stage on it, recomputing the forward (per-stage activation recomputation).
Zero-bubble kinds split the backward: B computes the input gradient and the gradients of
everything but the dense() weights, keeping each dense() matmul's output gradient (the
model's taps) in a W slot; W computes those weights' gradients from them and the matmuls'
inputs alone (`model.dense_weight_grads`): no second forward. With stash=activations the
F slot writes those inputs into a tape slot that W reads (lowering.py), so they are stored
once from F to W; with stash=inputs they are the B slot's recomputation and go into the W
slot beside the taps. The W slot, and how B's taps reach it, are weight_slot.py's.

The first virtual stage also runs the embedding, the last the head and the loss (in the B
slot, from the kept stage output: the loss is the head's primal there), so a microbatch's
backward can start in the round its forward ends; in the round forms without conditionals
every rank runs the head on 1/p of its rows instead (`head.SpreadHead`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxptd import model as models
from jaxptd.parallel.mesh import PIPE, TOKENS
from jaxptd.pipeline import buffers, static_chunks
from jaxptd.pipeline.chunk import Chunks
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.head import SpreadHead
from jaxptd.pipeline.lowering import Rounds
from jaxptd.pipeline.stage import Stage
from jaxptd.pipeline.weight_slot import WeightSlot
from jaxptd.model import fused, moe
from jaxptd.parallel.varying import after, mark_varying, zeros_as

# the carry's entry for the message in flight beside a slot (put there by the executor for
# the slot's call): the kept backward a layer at a time makes its middle layer wait for it
# (F: that layer's stores; B: its reads), so that the transfer's done lands mid-slot and
# XLA's latency-hiding scheduler starts it among the slot's GEMMs. Left free, it started
# each transfer just before its done, beside small fusions: in the H100 compile of GPT-1.3B
# at (2,2,2), 1F1B, SP, minimal_mlp, ZeRO-1 no steady send had a GEMM in flight (some with
# minimal), every one with this, at the same static time.
IN_FLIGHT = "in_flight"
# the carry's entry, in a scan body of several rounds (executor._unrolled), for what an F
# slot's writes of what it keeps wait for: the round before's gradient sums
WRITES_AFTER = "writes_after"

def _add_slot(total, g):
    """total + g for an ends leaf [1, ...] (this rank's slot), added as [...]: XLA folds
    the add of a scatter-add into zeros (the embedding's gradient) into a scatter-add into
    the sum, but not through the [1, ...] reshape."""
    return (total[0] + g[0])[None]


def kept_by_layer(context: Context, split: bool) -> bool:
    """Whether the kept backward is taken, stored and read a layer at a time (Training's
    `forward_by_layer` and chunk.Chunks' `backward_by_layer`): kept activations of unrolled
    layers, no zero-bubble split, and the layers' kept values varying over the mesh axes
    their input does (sequence parallelism, or one tensor rank), so that F's stores can be
    tied to the next layer. Elsewhere XLA forwarded F's values to B's reads past the
    stores: in the H100 compile of (2,2,2) 1F1B without sequence parallelism a layer at a
    time had a far lower MFU ceiling and more memory; with it, a slightly higher ceiling
    and much less memory, with model.remat=minimal and without. With model.remat=full (its
    layers keep only their inputs) the ceiling is the same and the middle layer's stores
    can hold the message in flight (buffers.row_major). Figures: BENCHMARKS.md and the
    git log."""
    model, layout = context.model, context.layout
    return context.stash == "activations" and not split and \
        not models.scans_layers(model, layout.platform) and \
        (layout.split_sequence or layout.tensor == 1)


class Training(WeightSlot):
    """The slots of a training schedule on this pipe rank: forward, backward and weight,
    each (carry, row, valid, seg) -> (message, carry). The carry holds the stage-input
    stash, the received output gradients (gbuf), what F keeps for B (saved: the backward's
    residuals and the stage output), for W (tapes: the dense inputs) and what B keeps for W
    (wsaved: the dense output gradients; with stash=inputs the dense inputs too), the
    gradient sums and the loss (a spread head: its weights' gradient sums, head_grads)."""

    def __init__(self, context: Context, rounds: Rounds, params, batch, key, loss_scale,
                 norm, deterministic: bool):
        self.p, self.v, self.tensor = context.pipe, context.chunks, context.message_split
        self.rounds = rounds
        self.stage = Stage(context, batch, key, deterministic, norm)
        self.params, self.ends, self.loss_scale = params, models.ends(params), loss_scale
        self.model, self.layout = context.model, context.layout
        self.keep_activations = context.stash == "activations"
        self.split = rounds.split_backward
        self.taped = self.split and self.keep_activations  # F writes the dense inputs
        self.by_layer = kept_by_layer(context, self.split)
        # stash=inputs, unrolled layers: a slot's middle layer waits for the message in
        # flight (IN_FLIGHT), as the kept backward a layer at a time does, in the rounds
        # executor._steady_recomputed says
        self.recomputes = not self.keep_activations and not self.split and \
            not models.scans_layers(self.model, self.layout.platform)
        # two chunks of unrolled layers whose slots mostly run the same held chunk on every
        # rank (static_chunks: zb-v): the executor's scans name it statically
        self.swaps = static_chunks.swaps(rounds) if self.v == 2 and not self.by_layer and \
            not models.scans_layers(self.model, self.layout.platform) else None
        self.chunks = Chunks(context, self.stage, params, self.split, self.by_layer,
                             self.swaps)
        self.layer_sums = self.chunks.layer_sums  # (_zero_grads)
        self.token_norm = context.token_norm
        self.stats_template = self._stats_template()
        self.head = SpreadHead(self.stage, self.ends) if context.head_pieces else None

    def _stats_template(self):
        """Zeros like a chunk's mixture-of-experts statistics [Lc, ...] (None: a dense
        model), from a trace of its forward."""
        if not self.model.moe:
            return None
        index = self.stage.rank * 0
        return zeros_as(jax.eval_shape(lambda: self.stage.layers(
            self.chunks.weights(index), self.stage.buffer(1)[0], index, index,
            with_stats=True)[1]))

    def _stats_seed(self):
        """The cotangent of a chunk's statistics: the balance terms' weights in the
        objective, times the loss scale and their normalisation (a mean over every token,
        as the step's)."""
        return moe.objective_cotangent(self.stats_template, self.model,
                                       self.loss_scale * self.token_norm)

    def _add_stats(self, carry, chunk, stats, valid):
        """The statistics of an F slot's chunk added to the rank's sums [v, 1, Lc, ...]."""
        if stats is None:
            return carry
        return {**carry, "stats": buffers.add_chunk(carry["stats"], chunk,
                                                    buffers.masked(stats, valid))}

    def initial_carry(self):
        rounds, stage = self.rounds, self.stage
        kept, y, wkept = self.chunks.probe or (None, None, None)
        saved = ()
        if self.keep_activations:
            templates = [k.templates for k in kept] if self.by_layer else kept.templates
            # every B reads what some F wrote (lowering's b_reads_written): no zeros
            saved = buffers.slots((templates, y), rounds.num_stash_slots,
                                  unwritten=rounds.b_reads_written)
        inputs, taps = wkept or (None, None)
        carry = {"stash": stage.buffer(rounds.spare("stash") + 1),  # (+ the spare slot)
                 "gbuf": stage.buffer(rounds.spare("grad") + 1), "saved": saved,
                 # (every W reads what some F wrote, lowering's w_reads_written: no zeros)
                 "tapes": buffers.slots(inputs, rounds.num_tape_slots,
                                        unwritten=rounds.w_reads_written)
                 if self.taped else (),
                 "wsaved": buffers.slots(taps if self.taped else wkept, rounds.num_w_slots)
                 if self.split else (),
                 "grads": self._zero_grads(),
                 "loss": mark_varying(jnp.zeros((), jnp.float32), (*TOKENS, PIPE)),
                 "stats": jax.tree.map(lambda t: buffers.slots(t, self.v)[:, None],
                                       self.stats_template)}
        if self.head is not None:
            carry["head_grads"] = self.head.zeros()
        return carry

    def _zero_grads(self):
        """Zeros for the gradient sums, like the params; `layer_sums` (the kept backward of
        one chunk of unrolled layers): the layers' as a list of each layer's tree, which B
        adds to in place. Summed into the [v, 1, Lc, ...] stack, each layer's add was a
        dynamic-update-slice of it that XLA fused with other layers' slices and rounds' into
        copies, time lost every step (the H100 compile of GPT-1.3B at (2,2,2), 1F1B). With
        chunks B's chunk is the table's (traced): the stack."""
        grads = jax.tree.map(jnp.zeros_like, self.params)
        if self.swaps:  # held chunks: [held chunk: [layer: its tree]] (Chunks.add_held)
            grads["layers"] = [jax.tree.map(jnp.zeros_like, models.per_layer(
                buffers.chunk(self.params["layers"], c))) for c in range(self.v)]
        if self.layer_sums:
            grads["layers"] = jax.tree.map(jnp.zeros_like, models.per_layer(
                buffers.chunk(self.params["layers"], 0)))
        return grads

    def layer_grads(self, carry):
        """The carry's layer gradient sums as the params' [v, 1, Lc, ...] stack."""
        layers = carry["grads"]["layers"]
        if self.swaps:  # logical chunk c: held chunk c ^ swap
            held = [models.stacked(h) for h in layers]
            swapped = self.chunks.swap > 0
            return jax.tree.map(lambda *h: jnp.stack([jnp.where(swapped, h[1 - c], h[c])[None]
                                                      for c in range(self.v)]), *held)
        return jax.tree.map(lambda x: x[None, None], models.stacked(layers)) \
            if self.layer_sums else layers

    def ends_grads(self, carry):
        """The final carry's gradient sums (the layers' stacked), a spread head's added to
        the ends slots."""
        grads = {**carry["grads"], "layers": self.layer_grads(carry)}
        if self.head is None:
            return grads
        return {**grads, **jax.tree.map(jnp.add, models.ends(grads),
                                        self.head.grads(carry["head_grads"]))}

    def forward(self, carry, row, valid, seg):
        """F: the stage's forward -> its output; keeps what B needs (activations mode)."""
        mb, chunk, slot = row["f_mb"], buffers.chunk_of(row, "f", self.v), row["f_slot"]
        x = self.stage.embed_or_input(self.ends, buffers.read(carry["stash"], slot), mb,
                                      chunk, seg.piece("embed", "F"))
        if not self.keep_activations:
            y, stats = self.stage.layers(self.chunks.weights(chunk), x, mb, chunk,
                                         with_stats=True, wait=carry.get(IN_FLIGHT))
            return y, self._add_stats(carry, chunk, stats, valid)
        # an idle F's slot holds nothing kept (lowering's idle_f_slots_free): written as is
        written = True if self.rounds.idle_f_slots_free else valid
        if self.by_layer:
            (y, stats), saved = self.chunks.forward_by_layer(
                carry["saved"][0], x, mb, chunk, slot, written, carry.get(IN_FLIGHT))
            carry = {**carry, "saved": (saved, buffers.write(carry["saved"][1], slot, y, written))}
        else:
            (y, stats), backward, inputs, _ = self.chunks.vjp(x, mb, chunk, seg.chunks[0])
            kept = (self.chunks.probe[0].keep(backward), y)
            carry = {**carry, "saved": buffers.write_tree(carry["saved"], slot, kept, written,
                                                          carry.get(WRITES_AFTER, ()))}
        carry = self._add_stats(carry, chunk, stats, valid)
        if self.taped:
            # (an idle F's tape slot is free, lowering's idle_f_tslots_free: written as is)
            carry["tapes"] = buffers.write_tree(
                carry["tapes"], row["f_tslot"], inputs,
                True if self.rounds.idle_f_tslots_free else valid, carry.get(WRITES_AFTER, ()))
        return y, carry

    def backward(self, carry, row, valid, seg):
        """B: the input gradient (sent to the previous stage) and the gradients of the ends
        and of the chunk (split: all but the dense() weights, whose W slot gets the taps)."""
        chunk = buffers.chunk_of(row, "b", self.v)
        received = buffers.read(carry["gbuf"], row["b_grad_slot"])
        slot = row["b_slot"]
        if not self.keep_activations:
            # the stage's forward is recomputed only once its output gradient is there and
            # the earlier B slots' weight gradients are summed: where XLA unrolls rounds
            # it would recompute it beside the previous B's weight gradients, which keep
            # their inputs, two B slots' activations at once (the H100 compile of GPT-1.3B
            # at (2,2,2)); kept activations are better left to XLA's schedule
            # (the received gradient on its own first: the dependence on the tensor-
            # sharded sums is a scalar all-reduce, which XLA starts at the top of the
            # round, and a gradient it waited for arrived there, its transfer beside
            # nothing: the H100 compile, stash=inputs)
            slot = after(after(slot, received, like=received), carry["grads"],
                         like=received)
        x_in = buffers.read(carry["stash"], slot)
        is_last = self.stage.vstage(chunk) == self.stage.last
        # the loss's seed: the last stage's own; a spread head's part is every rank's
        g_loss = mark_varying(jnp.where(is_last | (self.head is not None), self.loss_scale,
                                        0.0).astype(jnp.float32), (*TOKENS, PIPE))
        # the last stage's B that runs again where no rank runs the head (scans.ends_of):
        # its output gradient is the head's, which its first run kept (b_stores)
        again = row["b_again"] > 0 if seg.piece("head", "B") == "off" else False
        g_out = jnp.where(is_last & jnp.logical_not(again), 0.0, received)
        counted = self.counted(row, valid, seg)  # (a B that runs again: valid, not counted)
        if self.keep_activations:
            loss, g_ends, g_head, g_layers, g_x, taps, g = self._backward_kept(
                carry, row, x_in, g_out, g_loss, seg, counted)
        else:
            loss, g_ends, g_head, g_layers, g_x, taps, g = self._backward_recomputed(
                x_in, row, g_out, g_loss, seg, carry.get(IN_FLIGHT))
            g_ends = [buffers.masked(g_ends, counted)]
        if any(map(any, self.rounds.b_stores[seg.start:seg.stop])):  # (g: the output's)
            carry = {**carry, "gbuf": buffers.write(carry["gbuf"], row["b_grad_slot"], g,
                                                    (row["b_stores"] > 0) & valid)}
        grads = carry["grads"]
        for part in g_ends:  # (each added to the sums on its own: _backward_kept)
            grads = {**grads, **{k: jax.tree.map(_add_slot, grads[k], g)
                                 for k, g in part.items()}}
        grads = {**grads, "layers": g_layers if self.by_layer else self._add_layers(
            grads["layers"], chunk, g_layers, counted, seg.chunks[1])}
        if self.head is None:
            loss = buffers.masked(loss, counted)
        elif g_head is not None:  # the last rank's part: head_on masked it, not this slot
            if seg.taps[2]:
                loss, g_head = buffers.masked((loss, g_head), row["head_again"] == 0)
            carry = {**carry, "head_grads": self.head.add(carry["head_grads"], g_head)}
        carry = {**carry, "grads": grads, "loss": carry["loss"] + loss}
        if self.split:
            carry = self._keep_for_weight(carry, row, taps, valid, seg)
        return g_x.astype(x_in.dtype), carry

    def _add_layers(self, sums, chunk, g_layers, valid, at=None):
        """The sums with a B slot's layer gradients added: `layer_sums` (g_layers a list of
        each layer's or their stack, zeros where the slot is not valid: _backward_kept
        masked the cotangent; split or with experts masked here) added layer by layer, so
        that XLA adds each in the epilogue of the GEMM that makes it (as the kept backward
        a layer at a time); held chunks (`swaps`): masked and added to held chunk `at`
        layer by layer (Chunks.add_held); else masked and added to the [v, 1, Lc, ...]
        stack."""
        if self.swaps:
            g_layers = g_layers if isinstance(g_layers, list) else models.per_layer(g_layers)
            for i, g in enumerate(g_layers):
                sums = self.chunks.add_held(sums, chunk, at, i, buffers.masked(g, valid))
            return sums
        if not self.layer_sums:
            return buffers.add_chunk(sums, chunk, buffers.masked(g_layers, valid))
        if self.model.moe or self.split:  # the statistics' seed is not masked, and a
            g_layers = buffers.masked(g_layers, valid)  # split B's cotangent is not
        if not isinstance(g_layers, list):  # (a recomputed stage's: stacked)
            g_layers = models.per_layer(g_layers)
        return [buffers.add_layer(s, g) for s, g in zip(sums, g_layers)]

    def _head_loss(self, ends, weights, y, row, chunk, piece):
        """A B slot's loss: the last stage's own (Stage.head, from `ends`) or this rank's
        part of a spread head (from its broadcast `weights`)."""
        if self.head is None or piece == "off":
            return self.stage.head(ends, y, row["b_mb"], chunk, piece)
        return self.head.loss(weights, y, row["head_mb"], row["head_on"])

    def _backward_kept(self, carry, row, x_in, g_out, g_loss, seg, valid):
        """B from what F kept: the head's vjp, the kept chunk backward, the embedding's. The
        ends' gradients returned (a list of trees to add to the sums in turn) are zero
        where the slot is not valid; `by_layer`: the
        layers' gradients returned are the sums with this slot's added."""
        mb, chunk = row["b_mb"], buffers.chunk_of(row, "b", self.v)
        saved, y = carry["saved"]
        y = buffers.read(y, row["b_slot"])
        piece = seg.piece("head", "B")
        if piece == "off":
            # no rank runs the head in this round: its vjp's table-sized zeros were masked and
            # added to the embedding's gradient in every such B slot
            loss, g_head, g_weights, g = self._head_loss(None, None, y, row, chunk, piece), \
                None, None, g_out
        else:
            loss, head_vjp = jax.vjp(lambda e, w, y: self._head_loss(e, w, y, row, chunk,
                                                                     piece),
                                     self.ends, self.head and self.head.weights, y)
            g_head, g_weights, g_y = head_vjp(g_loss)
            g = g_out + g_y.astype(g_out.dtype)
        if self.by_layer:
            g_layers, g_x = self.chunks.backward_by_layer(
                saved, row["b_slot"], g, chunk, carry["grads"]["layers"], valid,
                self._stats_seed(), carry.get(IN_FLIGHT))
            g_taps = None
        else:
            given, tree = self.chunks.vjp_weights(chunk, seg.chunks[1])
            zeros, zeros_tree = self.chunks.zeros(x_in) if self.split else (None, None)
            if self.layer_sums and not self.split:  # an idle slot's cotangent masked,
                g = buffers.masked(g, valid)  # not what it makes (split: W's taps are made)
            with fused.backward_apart():  # (F ran in another slot: no barrier)
                g_given, g_x, *g_taps = self.chunks.probe[0].run(
                    (g, self._stats_seed()), buffers.read_tree(saved, row["b_slot"]), given,
                    None, zeros)
            g_layers = jax.tree.unflatten(tree, g_given)
            g_layers = g_layers[1] if self.split else g_layers  # split: the rest
            g_layers = g_layers if self.layer_sums or self.swaps else \
                models.stacked(g_layers)
        _, embed_vjp = jax.vjp(lambda e, x: self.stage.embed_or_input(
            e, x, mb, chunk, seg.piece("embed", "B")), self.ends, x_in)
        # the embedding's table gradient from a masked input: a scatter-add into zeros that
        # XLA folds into the add to the sums (_add_slot), where a table-sized select after it
        # kept the zero-filled table (two f32 [V/t, h] a B slot in the H100 compile)
        g_embed = embed_vjp(buffers.masked(g_x, valid))[0]
        # the head's and the embedding's gradients added to the sums one after the other:
        # added to each other first, the scatter-add into zeros was not folded (a table-
        # sized fill, scatter and add a B slot where both run; the git log has the figures)
        g_ends = [g_embed] if g_head is None else [buffers.masked(g_head, valid), g_embed]
        return (loss, g_ends, g_weights, g_layers, embed_vjp(g_x)[1],
                self.chunks.taps(g_taps[0], zeros_tree) if self.split else None, g)

    def _backward_recomputed(self, x_in, row, g_out, g_loss, seg, waits=None):
        """parallel.stash=inputs: the B slot takes the vjp of the whole stage at its input
        (split: in everything but the dense() weights, whose W slot gets the taps); the
        recomputation's middle layer waits for `waits` (IN_FLIGHT)."""
        mb, chunk = row["b_mb"], buffers.chunk_of(row, "b", self.v)
        weights = self.chunks.weights(chunk)
        dense, _ = models.split_dense(weights)

        def stage(ends, head, layers, x_in, added=None, probe=None):
            x = self.stage.embed_or_input(ends, x_in, mb, chunk, seg.piece("embed", "B"))
            w = models.merge_dense(dense, layers) if self.split else layers
            out = self.stage.layers(w, x, mb, chunk, added, with_stats=True, wait=waits)
            (y, stats), inputs = out if self.split else (out, None)
            y = y if probe is None else y + probe.astype(y.dtype)  # (its gradient: y's)
            loss = self._head_loss(ends, head, y, row, chunk, seg.piece("head", "B"))
            return (loss, y, stats), inputs

        cotangents = (g_loss, g_out, self._stats_seed())
        head = self.head and self.head.weights
        if not self.split:
            (loss, _, _), backward, _ = jax.vjp(stage, self.ends, head, weights, x_in,
                                                has_aux=True)
            g_ends, g_head, g_layers, g_x = backward(cotangents)
            return loss, g_ends, g_head, g_layers, g_x, None, None
        added = models.perturbations(weights, x_in, self.model, self.layout,
                                     self.stage.prepare)
        rest = models.split_dense(weights)[1]
        (loss, _, _), backward, inputs = jax.vjp(stage, self.ends, head, rest, x_in, added,
                                                 jnp.zeros_like(g_out), has_aux=True)
        g_ends, g_head, g_layers, g_x, g_taps, g = backward(cotangents)
        return loss, g_ends, g_head, g_layers, g_x, (inputs, g_taps), g
