"""The per-slot work of a training schedule on this pipe rank: F, B and W.

Owns what each slot computes and keeps. parallel.stash chooses what a stash slot keeps
between a stage's F and B slot:
- activations (default): the F slot takes `jax.vjp` of its layer chunk and keeps its
  backward's residuals as arrays (`kept.Kept`; the chunk's own weights, which the backward
  reads too, are passed in again instead of kept). With unrolled layers (a GPU's) and
  sequence parallelism or one tensor rank (`kept_by_layer`) it takes one vjp a layer and
  stores each layer's residuals before the next layer runs; the B slot reads them a
  layer at a time as its gradient reaches the layer, adds each layer's weight gradients
  to the sums as they are made, and runs the recomputation without a barrier
  (model.fused.backward_apart, model.layer_function's apart): the forward is another
  slot's;
- inputs: only the stage input [b, s, h] is kept and the B slot takes `jax.vjp` of the whole
  stage on it, recomputing the forward (per-stage activation recomputation).
Zero-bubble kinds split the backward: B computes the input gradient and the gradients of
everything but the dense() weights, keeping each dense() matmul's output gradient (the
model's taps) in a W slot; W computes those weights' gradients from them and the matmuls'
inputs alone (`model.dense_weight_grads`): no second forward. With stash=activations the
F slot writes those inputs into a tape slot that W reads (lowering.py), so they are stored
once from F to W; with stash=inputs they are the B slot's recomputation and go into the W
slot beside the taps.

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
from jaxptd.pipeline import buffers
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.head import SpreadHead
from jaxptd.pipeline.kept import Kept
from jaxptd.pipeline.lowering import Rounds
from jaxptd.pipeline.stage import Stage
from jaxptd.model import fused, moe
from jaxptd.parallel.varying import after, mark_varying, tied, zeros_as


def _cast(tree, dtype):
    """Master weights -> the compute dtype, done before a vjp so that a kept backward reads
    the very values it is given again (not a cast copy of them)."""
    return jax.tree.map(lambda w: w.astype(dtype), tree)


# the carry's entry for the message in flight beside a slot (put there by the executor for
# the slot's call): the kept backward a layer at a time makes its middle layer wait for it
# (F: that layer's stores; B: its reads), so that the transfer's done lands mid-slot and
# XLA's latency-hiding scheduler starts it among the slot's GEMMs. Left free, it started
# each transfer just before its done, beside small fusions: 0 of the 4 steady sends of the
# H100 compile of GPT-1.3B at (2,2,2), 1F1B m8, SP, minimal_mlp, ZeRO-1 had a GEMM in flight
# (2 with minimal), 4 of 4 with this, at the same static time.
IN_FLIGHT = "in_flight"


def _add_slot(total, g):
    """total + g for an ends leaf [1, ...] (this rank's slot), added as [...]: XLA folds
    the add of a scatter-add into zeros (the embedding's gradient) into a scatter-add into
    the sum, but not through the [1, ...] reshape."""
    return (total[0] + g[0])[None]


def _stacked_stats(stats: list):
    """Each layer's mixture-of-experts statistics stacked [Lc, ...] (None: dense)."""
    return None if stats[0] is None else models.stacked(stats)


def kept_by_layer(context: Context, split: bool) -> bool:
    """Whether the kept backward is taken, stored and read a layer at a time (Training's
    `_layers_kept` and `_layers_back`): kept activations of unrolled layers, no zero-bubble
    split, and the layers' kept values varying over the mesh axes their input does
    (sequence parallelism, or one tensor rank), so that F's stores can be tied to the next
    layer. Elsewhere XLA forwarded F's values to B's reads past the stores: the H100
    compile of (2,2,2) 1F1B without sequence parallelism went from 0.452 to 0.369 (MFU
    ceiling) and 23.9 to 24.9 GiB; with it, at 8 microbatches, from 0.597 to 0.606 and 14.5
    to 12.2 GiB with model.remat=minimal, 0.575 to 0.580 and 21.9 to 18.0 GiB without. With
    model.remat=full (its layers keep only their inputs) the ceiling is the same (0.569)
    and the middle layer's stores can hold the message in flight (buffers._row_major)."""
    model, layout = context.model, context.layout
    return context.stash == "activations" and not split and \
        not models.scans_layers(model, layout.platform) and \
        (layout.split_sequence or layout.tensor == 1)


class Training:
    """The slots of a training schedule on this pipe rank: forward, backward and weight,
    each (carry, row, valid, seg) -> (message, carry). The carry holds the stage-input
    stash, the received output gradients (gbuf), what F keeps for B (saved: the backward's
    residuals and the stage output), for W (tapes: the dense inputs) and what B keeps for W
    (wsaved: the dense output gradients; with stash=inputs the dense inputs too), the
    gradient sums and the loss (a spread head: its weights' gradient sums, head_grads)."""

    def __init__(self, context: Context, rounds: Rounds, params, batch, key, loss_scale,
                 deterministic: bool):
        self.p, self.v, self.tensor = context.pipe, context.chunks, context.message_split
        self.rounds = rounds
        self.stage = Stage(context, batch, key, deterministic)
        self.params, self.ends, self.loss_scale = params, models.ends(params), loss_scale
        self.model, self.layout = context.model, context.layout
        # the dense() weights in the compute dtype, cast once for every round (each F and B
        # slot cast its chunk's float32 masters again: 1.8 GB a round at (2,2,2) on H100)
        dense, rest = models.split_dense(params["layers"])
        self.layers = models.merge_dense(_cast(dense, jnp.dtype(self.model.dtype)), rest)
        self.keep_activations = context.stash == "activations"
        self.split = rounds.split_backward
        self.taped = self.split and self.keep_activations  # F writes the dense inputs
        self.by_layer = kept_by_layer(context, self.split)
        # stash=inputs, unrolled layers: a slot's middle layer waits for the message in
        # flight (IN_FLIGHT), as the kept backward a layer at a time does, in the rounds
        # executor._steady_recomputed says
        self.recomputes = not self.keep_activations and not self.split and \
            not models.scans_layers(self.model, self.layout.platform)
        self.late_weights = self.by_layer and self.model.remat == "minimal_mlp"
        self.layer_sums = self.by_layer and self.v == 1  # (_zero_grads)
        self.probe = self._probe() if self.keep_activations or self.split else None
        self.loss_norm = context.loss_norm
        self.stats_template = self._stats_template()
        self.head = SpreadHead(self.stage, self.ends) if context.spread_head else None

    def chunk_weights(self, chunk):
        """Chunk c's layers [Lc, ...], dense() weights already in the compute dtype."""
        return buffers.chunk(self.layers, chunk)

    def chunk_layers(self, chunk) -> list:
        """Chunk c's layers as a list of each layer's tree, as `chunk_weights`. With one
        chunk each layer is sliced from the float32 masters and cast on its own: slices of
        the cast [Lc, ...] stack were copies of it, kept for the whole step (0.5 GiB at
        (2,2,2) in the H100 compile of GPT-1.3B)."""
        if self.v > 1:
            return models.per_layer(self.chunk_weights(chunk))
        dense, rest = models.split_dense(buffers.chunk(self.params["layers"], 0))
        dtype = jnp.dtype(self.model.dtype)
        return [models.merge_dense(_cast(d, dtype), r)
                for d, r in zip(models.per_layer(dense), models.per_layer(rest))]

    def late_layer(self, chunk, i: int, deps):
        """Layer i of chunk c from `chunk_weights` (cast once a step), read only once every
        leaf of `deps` is computed (buffers.read_after: F's layer input, B's gradient
        reaching the layer): the kept backward a layer at a time with model.remat=
        minimal_mlp (`late_weights`). In the H100 compile of GPT-1.3B at (2,2,2), 1F1B m8,
        SP, ZeRO-1: 10.51 -> 10.27 GiB for a ceiling of 0.609 -> 0.601 (from chunk_layers,
        each slot's casts were made at its start and kept through it, transposed copies
        too); with remat none (17.96 -> 17.88 GiB, 0.588 -> 0.581) or minimal (12.10 ->
        12.11 GiB, 0.630 -> 0.621) it costs time and saves nothing."""
        return jax.tree.map(lambda w: buffers.read_after(w, i, deps), self.chunk_weights(chunk))

    def vjp_weights(self, chunk):
        """(the leaves of the chunk's weights as its backward reads them, their treedef).
        The tree is the chunk's weights, split: (dense() weights, the rest); with unrolled
        layers a list of per-layer trees (`chunk_layers`), sliced here, outside the vjp:
        the backward then reads these very values, which the vjp keeps as its argument
        (sliced inside, each layer's weights were kept in the stash as copies of their own,
        seen in the compiled H100 program)."""
        unrolled = not models.scans_layers(self.model, self.layout.platform)
        if unrolled and not self.split:
            return jax.tree.flatten(self.chunk_layers(chunk))
        weights = self.chunk_weights(chunk)
        parts = models.split_dense(weights) if self.split else weights
        return jax.tree.flatten(tuple(map(models.per_layer, parts)) if unrolled else parts)

    def layer_vjp(self, x, mb, chunk):
        """jax.vjp of the chunk's layers at x -> ((y, statistics), backward, dense inputs,
        the weights' leaves). The vjp's first argument is the tuple of those leaves
        (`kept.Kept` finds them among the residuals there). Split: in (weights, x,
        perturbations' leaves: `_zeros`), dense inputs taped (the dense() weights'
        cotangent is unused: XLA drops it); else in (weights, x), no dense inputs."""
        given, tree = self.vjp_weights(chunk)
        if not self.split:
            y, backward = jax.vjp(lambda w, x: self.stage.layers(
                jax.tree.unflatten(tree, w), x, mb, chunk, with_stats=True), tuple(given), x)
            return y, backward, None, given
        zeros, zeros_tree = self._zeros(x)

        def layers(w, x, zeros):
            dense, rest = jax.tree.unflatten(tree, w)
            merged = [models.merge_dense(d, r) for d, r in zip(dense, rest)] \
                if isinstance(rest, list) else models.merge_dense(dense, rest)
            return self.stage.layers(merged, x, mb, chunk, jax.tree.unflatten(
                zeros_tree, zeros), with_stats=True)
        y, backward, inputs = jax.vjp(layers, tuple(given), x, zeros, has_aux=True)
        return y, backward, inputs, given

    def _zeros(self, x):
        """(the leaves of the chunk's dense() perturbations, zeros, as a tuple; their tree):
        unrolled layers take them as a list of each layer's tree, so that a zero a layer's
        jax.checkpoint keeps (as its input) is one of the vjp's arguments, which `kept.Kept`
        passes in again, not a slice of the [Lc, ...] stack, which it stored (4 GiB of
        zeros in the H100 compile of (2,2,2) zb-h1 m8 SP with model.remat=minimal). Made
        again by every slot that needs them: a broadcast XLA folds into their adds (made
        once for the step, they would be arrays the round loop carries)."""
        added = models.perturbations(self.chunk_weights(self.stage.rank * 0), x, self.model,
                                     self.layout, self.stage.prepare)
        if not models.scans_layers(self.model, self.layout.platform):
            added = models.per_layer(added)
        leaves, tree = jax.tree.flatten(added)
        return tuple(leaves), tree

    @staticmethod
    def _taps(leaves, tree):
        """The dense() outputs' gradients (the cotangents of `_zeros`' leaves) as the
        [Lc, ...] tree a W slot keeps."""
        taps = jax.tree.unflatten(tree, leaves)
        return models.stacked(taps) if isinstance(taps, list) else taps

    def _layers_kept(self, saved, x, mb, chunk, slot, written, waits=None):
        """F's layers a vjp each (`by_layer`), each layer's residuals written into stash slot
        `slot` of its buffers (`saved`) before the next layer starts -> ((y, statistics),
        the buffers). Left free, XLA stored them all only just before the B slot that reads
        them, keeping the F slot's values meanwhile. The middle layer's stores wait for
        `waits` (IN_FLIGHT); with model.remat=none its attention output projection too
        (models.waiting_attention_out): the stores alone, the transfer had only small
        kernels in flight there (H100 compile of GPT-1.3B, (2,2,2) 1F1B m8 SP: steady
        sends 2 -> 4 of 4 with a GEMM in flight, 18.04 -> 17.97 GiB, 255.7 -> 255.9 ms);
        with minimal or minimal_mlp the weights' wait put the transfer among the stores of
        the layer below instead (4 -> 2 of 4)."""
        saved, stats, mid = list(saved), [], len(saved) // 2
        layers = None if self.late_weights else self.chunk_layers(chunk)
        for i in range(len(saved)):
            weights = layers[i] if layers else self.late_layer(chunk, i, x)
            if waits is not None and i == mid and self.model.remat == "none":
                weights = models.waiting_attention_out(weights, (x, waits))
            (x, s), backward, _ = self._one_layer_vjp(weights, x, mb, chunk, i)
            saved[i] = buffers.write_tree(saved[i], slot, self.probe[0][i].keep(backward),
                                          written, waits if i == mid else ())
            saved[i], x = tied(saved[i], x)
            stats.append(s)
        return (x, _stacked_stats(stats)), saved

    def _one_layer_vjp(self, weights, x, mb, chunk, i):
        """jax.vjp of layer i of the chunk at x, in (its weights' leaves, x), as
        `layer_vjp`'s of the chunk's -> ((y, statistics), backward, the leaves)."""
        given, tree = jax.tree.flatten(weights)
        y, backward = jax.vjp(lambda w, x: self.stage.layer(
            jax.tree.unflatten(tree, w), x, mb, chunk, i), tuple(given), x)
        return y, backward, given

    def _probe(self):
        """Traces one chunk to fix what F keeps for B and B for W (XLA drops its compute)."""
        index = self.stage.rank * 0  # traced, like the slots' microbatch and chunk
        x = self.stage.buffer(1)[0]
        if self.by_layer:
            kept = []
            for i, weights in enumerate(self.chunk_layers(index)):
                (x, _), backward, given = self._one_layer_vjp(weights, x, index, index, i)
                kept.append(Kept(backward, given))
            return kept, x, None
        (y, _), backward, inputs, given = self.layer_vjp(x, index, index)
        zeros, zeros_tree = self._zeros(x) if self.split else (None, None)
        kept = Kept(backward, given, None, zeros) if self.keep_activations else None
        return kept, y, (inputs, self._taps(zeros, zeros_tree)) if self.split else None

    def _stats_template(self):
        """Zeros like a chunk's mixture-of-experts statistics [Lc, ...] (None: a dense
        model), from a trace of its forward."""
        if not self.model.moe:
            return None
        index = self.stage.rank * 0
        return zeros_as(jax.eval_shape(lambda: self.stage.layers(
            self.chunk_weights(index), self.stage.buffer(1)[0], index, index,
            with_stats=True)[1]))

    def _stats_seed(self):
        """The cotangent of a chunk's statistics: the balance terms' weights in the
        objective, times the loss scale and the loss's normalisation (as the loss's)."""
        return moe.objective_cotangent(self.stats_template, self.model,
                                       self.loss_scale * self.loss_norm)

    def _add_stats(self, carry, chunk, stats, valid):
        """The statistics of an F slot's chunk added to the rank's sums [v, 1, Lc, ...]."""
        if stats is None:
            return carry
        return {**carry, "stats": buffers.add_chunk(carry["stats"], chunk,
                                                    buffers.masked(stats, valid))}

    def initial_carry(self):
        rounds, stage = self.rounds, self.stage
        kept, y, wkept = self.probe or (None, None, None)
        saved = ()
        if self.keep_activations:
            templates = [k.templates for k in kept] if self.by_layer else kept.templates
            saved = buffers.slots((templates, y), rounds.num_stash_slots)
        inputs, taps = wkept or (None, None)
        carry = {"stash": stage.buffer(rounds.num_stash_slots),
                 "gbuf": stage.buffer(rounds.num_grad_slots), "saved": saved,
                 "tapes": buffers.slots(inputs, rounds.num_tape_slots) if self.taped else (),
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
        """Zeros for the gradient sums, like the params; `layer_sums` (the kept backward a
        layer at a time, one chunk): the layers' as a list of each layer's tree, which B
        adds to in place. Summed into the [v, 1, Lc, ...] stack, each layer's add was a
        dynamic-update-slice of it that XLA fused with other layers' slices and rounds' into
        copies (5.4 ms a step of the H100 compile of GPT-1.3B at (2,2,2), 1F1B m8). With
        chunks B's chunk is the table's (traced): the stack."""
        grads = jax.tree.map(jnp.zeros_like, self.params)
        if self.layer_sums:
            grads["layers"] = jax.tree.map(jnp.zeros_like, models.per_layer(
                buffers.chunk(self.params["layers"], 0)))
        return grads

    def layer_grads(self, carry):
        """The carry's layer gradient sums as the params' [v, 1, Lc, ...] stack."""
        layers = carry["grads"]["layers"]
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
            y, stats = self.stage.layers(self.chunk_weights(chunk), x, mb, chunk,
                                         with_stats=True, wait=carry.get(IN_FLIGHT))
            return y, self._add_stats(carry, chunk, stats, valid)
        # an idle F's slot holds nothing kept (lowering's idle_f_slots_free): written as is
        written = True if self.rounds.idle_f_slots_free else valid
        if self.by_layer:
            (y, stats), saved = self._layers_kept(carry["saved"][0], x, mb, chunk, slot, written,
                                                  carry.get(IN_FLIGHT))
            carry = {**carry, "saved": (saved, buffers.write(carry["saved"][1], slot, y, written))}
        else:
            (y, stats), backward, inputs, _ = self.layer_vjp(x, mb, chunk)
            kept = (self.probe[0].keep(backward), y)
            carry = {**carry, "saved": buffers.write_tree(carry["saved"], slot, kept, written)}
        carry = self._add_stats(carry, chunk, stats, valid)
        if self.taped:
            carry["tapes"] = buffers.write_tree(carry["tapes"], row["f_tslot"], inputs, valid)
        return y, carry

    def backward(self, carry, row, valid, seg):
        """B: the input gradient (sent to the previous stage) and the gradients of the ends
        and of the chunk (split: all but the dense() weights, whose W slot gets the taps)."""
        mb, chunk = row["b_mb"], buffers.chunk_of(row, "b", self.v)
        received = buffers.read(carry["gbuf"], row["b_grad_slot"])
        slot = row["b_slot"]
        if not self.keep_activations:
            # the stage's forward is recomputed only once its output gradient is there and
            # the earlier B slots' weight gradients are summed: where XLA unrolls rounds
            # it would recompute it beside the previous B's weight gradients, which keep
            # their inputs, two B slots' activations at once (+2.6 GiB, the H100 compile
            # of GPT-1.3B at (2,2,2)); kept activations are better left to XLA's schedule
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
        g_out = jnp.where(is_last, 0.0, received)
        if self.keep_activations:
            loss, g_ends, g_head, g_layers, g_x, taps = self._backward_kept(
                carry, row, x_in, g_out, g_loss, seg, valid)
        else:
            loss, g_ends, g_head, g_layers, g_x, taps = self._backward_recomputed(
                x_in, row, g_out, g_loss, seg, carry.get(IN_FLIGHT))
            g_ends = buffers.masked(g_ends, valid)
        grads = carry["grads"]
        grads = {**{k: jax.tree.map(_add_slot, grads[k], g) for k, g in g_ends.items()},
                 "layers": g_layers if self.by_layer else buffers.add_chunk(
                     grads["layers"], chunk, buffers.masked(g_layers, valid))}
        if self.head is None:
            loss = buffers.masked(loss, valid)
        else:  # the last rank's part of the work: head_on masked it, not this rank's slot
            carry = {**carry, "head_grads": self.head.add(carry["head_grads"], g_head)}
        carry = {**carry, "grads": grads, "loss": carry["loss"] + loss}
        if self.split:
            carry["wsaved"] = buffers.write_tree(carry["wsaved"], row["b_wslot"], taps, valid)
        return g_x.astype(x_in.dtype), carry

    def _head_loss(self, ends, weights, y, row, chunk, piece):
        """A B slot's loss: the last stage's own (Stage.head, from `ends`) or this rank's
        part of a spread head (from its broadcast `weights`)."""
        if self.head is None or piece == "off":
            return self.stage.head(ends, y, row["b_mb"], chunk, piece)
        return self.head.loss(weights, y, row["head_mb"], row["head_on"])

    def _backward_kept(self, carry, row, x_in, g_out, g_loss, seg, valid):
        """B from what F kept: the head's vjp, the kept chunk backward, the embedding's. The
        ends' gradients returned are zero where the slot is not valid; `by_layer`: the
        layers' gradients returned are the sums with this slot's added."""
        mb, chunk = row["b_mb"], buffers.chunk_of(row, "b", self.v)
        saved, y = carry["saved"]
        y = buffers.read(y, row["b_slot"])
        piece = seg.piece("head", "B")
        loss, head_vjp = jax.vjp(lambda e, w, y: self._head_loss(e, w, y, row, chunk, piece),
                                 self.ends, self.head and self.head.weights, y)
        g_head, g_weights, g_y = head_vjp(g_loss)
        g = g_out + g_y.astype(g_out.dtype)
        if self.by_layer:
            g_layers, g_x = self._layers_back(saved, row["b_slot"], g, chunk,
                                              carry["grads"]["layers"], valid,
                                              carry.get(IN_FLIGHT))
            g_taps = None
        else:
            given, tree = self.vjp_weights(chunk)
            zeros, zeros_tree = self._zeros(x_in) if self.split else (None, None)
            g_given, g_x, *g_taps = self.probe[0].run(
                (g, self._stats_seed()), buffers.read_tree(saved, row["b_slot"]), given,
                None, zeros)
            g_layers = jax.tree.unflatten(tree, g_given)
            g_layers = models.stacked(g_layers[1] if self.split else g_layers)  # split: rest
        _, embed_vjp = jax.vjp(lambda e, x: self.stage.embed_or_input(
            e, x, mb, chunk, seg.piece("embed", "B")), self.ends, x_in)
        # the embedding's table gradient from a masked input: a scatter-add into zeros that
        # XLA folds into the add to the sums (_add_slot), where a table-sized select after it
        # kept the zero-filled table (two f32 [V/t, h] a B slot in the H100 compile)
        g_embed = embed_vjp(buffers.masked(g_x, valid))[0]
        g_ends = jax.tree.map(jnp.add, buffers.masked(g_head, valid), g_embed)
        return (loss, g_ends, g_weights, g_layers, embed_vjp(g_x)[1],
                self._taps(g_taps[0], zeros_tree) if self.split else None)

    def _layers_back(self, saved, slot, g, chunk, sums, valid, waits=None):
        """The kept backward a layer at a time, the last first (`by_layer`) -> (the layers'
        gradient sums `sums` (`layer_sums`: a list of each layer's) with this slot's added,
        the chunk input's gradient). Layer i's residuals are read from stash slot `slot` once the
        gradient reaching it is there (buffers.read_after), so that XLA reads them (and
        copies them, where a kernel needs a buffer of its own) one layer at a time, not all
        at the start of the slot; the first of them also once the F slot has stored all it
        keeps (`saved`: left free, XLA forwarded F's values to these reads, keeping them
        through the B slot). Each layer's weight gradients are added to the sums as they are
        made, and the layer below reads its residuals only once they are: left free, XLA
        deferred them behind the input gradients' chain, keeping their inputs
        (models.weight_gradients_first's finding). The middle layer's reads wait for `waits`
        too (IN_FLIGHT)."""
        seed = self._stats_seed()
        sums = list(sums) if self.layer_sums else sums
        deps = (g, saved)
        layers = None if self.late_weights else self.chunk_layers(chunk)
        for i in reversed(range(len(saved))):
            if waits is not None and i == len(saved) // 2:
                deps = (*deps, waits)
            stored = [buffers.read_after(b, slot, deps) for b in saved[i]]
            given, tree = jax.tree.flatten(layers[i] if layers else
                                           self.late_layer(chunk, i, deps))
            seed_i = None if seed is None else jax.tree.map(lambda s: s[i], seed)
            with fused.backward_apart():  # its recomputation needs no barrier
                g_given, g = self.probe[0][i].run((g, seed_i), stored, given)
            g_layer = buffers.masked(jax.tree.unflatten(tree, g_given), valid)
            if self.layer_sums:
                sums[i] = jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums[i], g_layer)
            else:
                sums = buffers.add_chunk(sums, chunk, g_layer, layer=i)
            deps = (g, g_given)
        return sums, g

    def _backward_recomputed(self, x_in, row, g_out, g_loss, seg, waits=None):
        """parallel.stash=inputs: the B slot takes the vjp of the whole stage at its input
        (split: in everything but the dense() weights, whose W slot gets the taps); the
        recomputation's middle layer waits for `waits` (IN_FLIGHT)."""
        mb, chunk = row["b_mb"], buffers.chunk_of(row, "b", self.v)
        weights = self.chunk_weights(chunk)
        dense, _ = models.split_dense(weights)

        def stage(ends, head, layers, x_in, added=None):
            x = self.stage.embed_or_input(ends, x_in, mb, chunk, seg.piece("embed", "B"))
            w = models.merge_dense(dense, layers) if self.split else layers
            out = self.stage.layers(w, x, mb, chunk, added, with_stats=True, wait=waits)
            (y, stats), inputs = out if self.split else (out, None)
            loss = self._head_loss(ends, head, y, row, chunk, seg.piece("head", "B"))
            return (loss, y, stats), inputs

        cotangents = (g_loss, g_out, self._stats_seed())
        head = self.head and self.head.weights
        if not self.split:
            (loss, _, _), backward, _ = jax.vjp(stage, self.ends, head, weights, x_in,
                                                has_aux=True)
            g_ends, g_head, g_layers, g_x = backward(cotangents)
            return loss, g_ends, g_head, g_layers, g_x, None
        added = models.perturbations(weights, x_in, self.model, self.layout,
                                     self.stage.prepare)
        rest = models.split_dense(weights)[1]
        (loss, _, _), backward, inputs = jax.vjp(stage, self.ends, head, rest, x_in, added,
                                                 has_aux=True)
        g_ends, g_head, g_layers, g_x, g_taps = backward(cotangents)
        return loss, g_ends, g_head, g_layers, g_x, (inputs, g_taps)

    def weight(self, carry, row, valid, seg):
        """W: the dense() weights' gradients from what the microbatch's B kept. With
        unrolled layers a layer at a time (`_layer_weights`)."""
        if self.taped:
            inputs, islot = carry["tapes"], row["w_tslot"]
            g_taps, gslot = carry["wsaved"], row["w_slot"]
        else:
            (inputs, g_taps), islot = carry["wsaved"], row["w_slot"]
            gslot = islot
        chunk = buffers.chunk_of(row, "w", self.v)
        dense, _ = models.split_dense(buffers.chunk(self.params["layers"], chunk))
        if models.scans_layers(self.model, self.layout.platform):
            g_dense = models.dense_weight_grads(
                dense, buffers.read_tree(inputs, islot), buffers.read_tree(g_taps, gslot),
                self.layout, self.stage.prepare)
            sums = buffers.add_chunk(carry["grads"]["layers"], chunk,
                                     buffers.masked(g_dense, valid))
        else:
            sums = self._layer_weights(carry["grads"]["layers"], chunk, dense, (inputs, islot),
                                       (g_taps, gslot), valid)
        return None, {**carry, "grads": {**carry["grads"], "layers": sums}}

    def _layer_weights(self, sums, chunk, dense, inputs, g_taps, valid):
        """W a layer at a time: layer i's dense inputs and output gradients ((buffers, slot)
        each) read out of their slots, with sequence parallelism its inputs gathered, and
        its gradients added to the sums [v, 1, Lc, ...]. The stacked W
        (`models.dense_weight_grads`) copied a slot's values for all the chunk's layers out
        at once and gathered them at once: the H100 compile of (2,2,2) zb-h1 m8 SP with
        model.remat=minimal, 25.36 -> 24.31 GiB, 284.0 -> 282.3 ms. (Reading layer i only
        once layer i - 2's gradients were made, 24.0 GiB, cost 333.3 ms: XLA fused those
        reads with other work into kernels that were far slower.)"""
        for i in range(jax.tree.leaves(dense)[0].shape[0]):
            x, g = (jax.tree.map(lambda b: buffers.read(b, slot)[i], tree)
                    for tree, slot in (inputs, g_taps))
            grads = models.layer_dense_weight_grads(jax.tree.map(lambda w: w[i], dense), x, g,
                                                    self.layout, self.stage.prepare)
            sums = buffers.add_chunk(sums, chunk, buffers.masked(grads, valid), layer=i)
        return sums
