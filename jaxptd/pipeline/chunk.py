"""A pipe rank's layer chunks as the training slots compute them: their weights and the
vjps an F slot takes of them, and the kept backward a layer at a time.

Owns `Chunks`: the chunks' dense() weights cast to the compute dtype once a step, a chunk's
weights as a stack or a list of layers (`weights`, `per_layer`, `late_layer`), the vjp of
a chunk (`vjp`: in its weights and input; zero-bubble kinds also in the dense() outputs'
perturbations, whose cotangents are the taps a W slot reads) and the probe that fixes what
F keeps for B and B for W (`kept.Kept`). With `by_layer` (training.kept_by_layer) F takes
one vjp a layer and stores each layer's residuals before the next layer runs
(`forward_by_layer`), and B reads them back a layer at a time as its gradient reaches the
layer (`backward_by_layer`). Which slot runs what, the stash slots and the gradient sums of
the ends are training.py's.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jaxptd import model as models
from jaxptd.model import fused, products
from jaxptd.pipeline import buffers
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.kept import Kept
from jaxptd.pipeline.stage import Stage
from jaxptd.parallel.varying import tied


def _cast(tree, dtype):
    """Master weights -> the compute dtype, done before a vjp so that a kept backward reads
    the very values it is given again (not a cast copy of them)."""
    return jax.tree.map(lambda w: w.astype(dtype), tree)


def _stacked_stats(stats: list):
    """Each layer's mixture-of-experts statistics stacked [Lc, ...] (None: dense)."""
    return None if stats[0] is None else models.stacked(stats)


class Chunks:
    """This rank's layer chunks for one step's training slots (params: its float32
    masters, layers [v, 1, Lc, ...]); split: the zero-bubble kinds' split backward; by_layer:
    the kept backward a layer at a time (training.kept_by_layer)."""

    def __init__(self, context: Context, stage: Stage, params, split: bool, by_layer: bool,
                 swaps: tuple | None = None):
        self.stage, self.params, self.v = stage, params, context.chunks
        self.model, self.layout = context.model, context.layout
        # the dense() weights in the compute dtype, cast once for every round (each F and B
        # slot cast its chunk's float32 masters again, every round, in the H100 compile)
        dense, rest = models.split_dense(params["layers"])
        self.layers = models.merge_dense(_cast(dense, jnp.dtype(self.model.dtype)), rest)
        self.keep_activations = context.stash == "activations"
        self.split, self.by_layer = split, by_layer
        self.late_weights = by_layer and self.model.remat == "minimal_mlp"
        self._layer_list = self._cast_layers() if self.v == 1 else None
        # the layers' gradient sums as a list of each layer's tree (training's _zero_grads):
        # one chunk, its layers unrolled, kept a layer at a time, kept whole or split (the
        # split B's and W's adds to a stack were dynamic-update-slices of their own every
        # slot)
        self.layer_sums = self.v == 1 and (by_layer or (
            (split or self.keep_activations)
            and not models.scans_layers(self.model, self.layout.platform)))
        # held chunks (static_chunks.swaps given): each chunk as this rank holds it (its
        # two swapped where swaps says), a list of each layer's cast tree, read in place
        # by the slots that name it statically; its gradient sums likewise (`add_held`)
        self.swap = None if swaps is None else jnp.asarray(swaps, jnp.int32)[stage.rank]
        self.held = None if swaps is None else self._held_layers()
        self.probe = self._probe() if self.keep_activations or split else None

    def _held_layers(self) -> list:
        """[held chunk k: [layer i: its cast tree]], chunk k ^ swap of the masters."""
        logical = [self._cast_layers(c) for c in range(self.v)]
        return [[jax.tree.map(lambda a, b: jnp.where(self.swap > 0, b, a), mine, other)
                 for mine, other in zip(logical[k], logical[1 - k])] for k in range(self.v)]

    def held_of(self, chunk):
        """The held index of logical chunk `chunk` (traced) on this rank."""
        return chunk ^ self.swap

    def add_held(self, sums, chunk, at, i: int, grads):
        """The held sums ([held chunk: [layer: tree]]) with layer i's gradients `grads` of
        logical chunk `chunk` added: into held chunk `at` (static), or with `at` None
        into each held chunk, masked where it is not the chunk's."""
        sums = [list(s) for s in sums]
        for k in range(self.v) if at is None else (at,):
            here = grads if at is not None else buffers.masked(
                grads, self.held_of(chunk) == k)
            sums[k][i] = buffers.add_layer(sums[k][i], here)
        return sums

    def weights(self, chunk):
        """Chunk c's layers [Lc, ...], dense() weights already in the compute dtype."""
        if self.held is not None:
            return models.stacked(self.per_layer(chunk))
        return buffers.chunk(self.layers, chunk)

    def per_layer(self, chunk, at=None) -> list:
        """Chunk c's layers as a list of each layer's tree, as `weights`. With one
        chunk, each layer's own arrays, sliced from the float32 masters and cast once a
        step, before the rounds (`_layer_list`): slices of the cast [Lc, ...] stack were
        copies of it, kept for the whole step, and sliced and cast in the slots, every
        round cast every layer again, in kernels that wrote several copies of each weight
        (figures: BENCHMARKS.md and the git log). Held chunks: held chunk `at` (static),
        or with `at` None the one the logical chunk is held at, selected."""
        if self.held is not None:
            if at is not None:
                return self.held[at]
            first = self.held_of(chunk) == 0
            return [jax.tree.map(lambda a, b: jnp.where(first, a, b), *pair)
                    for pair in zip(*self.held)]
        if self.v > 1:
            return models.per_layer(self.weights(chunk))
        return self._layer_list

    def _cast_layers(self, chunk: int = 0) -> list:
        """A chunk's layers, each sliced from the float32 masters and cast on its own
        (`per_layer`)."""
        dense, rest = models.split_dense(buffers.chunk(self.params["layers"], chunk))
        dtype = jnp.dtype(self.model.dtype)
        return [models.merge_dense(_cast(d, dtype), r)
                for d, r in zip(models.per_layer(dense), models.per_layer(rest))]

    def late_layer(self, chunk, i: int, deps):
        """Layer i of chunk c from `weights` (cast once a step), read only once every
        leaf of `deps` is computed (buffers.read_after: F's layer input, B's gradient
        reaching the layer): the kept backward a layer at a time with model.remat=
        minimal_mlp (`late_weights`). From per_layer, each slot's casts were made at its
        start and kept through it, transposed copies too: in the H100 compile of GPT-1.3B
        at (2,2,2), 1F1B, SP, ZeRO-1 this saves memory for a slightly lower MFU ceiling;
        with remat none or minimal it costs time and saves next to nothing, so not there
        (figures: BENCHMARKS.md and the git log)."""
        return buffers.read_after(self.weights(chunk), i, deps)

    def vjp_weights(self, chunk, at=None):
        """(the leaves of the chunk's weights as its backward reads them, their treedef).
        The tree is the chunk's weights, split: (dense() weights, the rest); with unrolled
        layers a list of per-layer trees (`per_layer`), sliced here, outside the vjp:
        the backward then reads these very values, which the vjp keeps as its argument
        (sliced inside, each layer's weights were kept in the stash as copies of their own,
        seen in the compiled H100 program)."""
        unrolled = not models.scans_layers(self.model, self.layout.platform)
        if unrolled and not self.split:
            return jax.tree.flatten(self.per_layer(chunk, at))
        if unrolled:  # ([each layer's dense() weights], [each layer's other leaves])
            return jax.tree.flatten(tuple(map(list, zip(*map(models.split_dense,
                                                             self.per_layer(chunk, at))))))
        weights = self.weights(chunk)
        return jax.tree.flatten(models.split_dense(weights) if self.split else weights)

    def vjp(self, x, mb, chunk, at=None):
        """jax.vjp of the chunk's layers at x -> ((y, statistics), backward, dense inputs,
        the weights' leaves). The vjp's first argument is the tuple of those leaves
        (`kept.Kept` finds them among the residuals there). Split: in (weights, x,
        perturbations' leaves: `zeros`), dense inputs taped (the dense() weights'
        cotangent is unused: XLA drops it); else in (weights, x), no dense inputs."""
        given, tree = self.vjp_weights(chunk, at)
        if not self.split:
            y, backward = jax.vjp(lambda w, x: self.stage.layers(
                jax.tree.unflatten(tree, w), x, mb, chunk, with_stats=True, apart=True),
                tuple(given), x)
            return y, backward, None, given
        zeros, zeros_tree = self.zeros(x)

        def layers(w, x, zeros):
            dense, rest = jax.tree.unflatten(tree, w)
            merged = [models.merge_dense(d, r) for d, r in zip(dense, rest)] \
                if isinstance(rest, list) else models.merge_dense(dense, rest)
            return self.stage.layers(merged, x, mb, chunk, jax.tree.unflatten(
                zeros_tree, zeros), with_stats=True)
        y, backward, inputs = jax.vjp(layers, tuple(given), x, zeros, has_aux=True)
        return y, backward, inputs, given

    def zeros(self, x):
        """(the leaves of the chunk's dense() perturbations, zeros, as a tuple; their tree):
        unrolled layers take them as a list of each layer's tree, so that a zero a layer's
        jax.checkpoint keeps (as its input) is one of the vjp's arguments, which `kept.Kept`
        passes in again, not a slice of the [Lc, ...] stack, which it stored (gigabytes of
        zeros in the H100 compile of (2,2,2) zb-h1 SP with model.remat=minimal). Made
        again by every slot that needs them: a broadcast XLA folds into their adds (made
        once for the step, they would be arrays the round loop carries)."""
        added = models.perturbations(self.weights(self.stage.rank * 0), x, self.model,
                                     self.layout, self.stage.prepare)
        if not models.scans_layers(self.model, self.layout.platform):
            added = models.per_layer(added)
        leaves, tree = jax.tree.flatten(added)
        return tuple(leaves), tree

    @staticmethod
    def taps(leaves, tree):
        """The dense() outputs' gradients (the cotangents of `zeros`' leaves) as the
        [Lc, ...] tree a W slot keeps."""
        taps = jax.tree.unflatten(tree, leaves)
        return models.stacked(taps) if isinstance(taps, list) else taps

    def forward_by_layer(self, saved, x, mb, chunk, slot, written, waits=None):
        """F's layers a vjp each (`by_layer`), each layer's residuals written into stash slot
        `slot` of its buffers (`saved`) before the next layer starts -> ((y, statistics),
        the buffers). Left free, XLA stored them all only just before the B slot that reads
        them, keeping the F slot's values meanwhile. The middle layer's stores wait for
        `waits` (training.IN_FLIGHT); with model.remat=none its attention output projection too
        (models.waiting_attention_out): the stores alone, the transfer had only small
        kernels in flight there (the H100 compile of GPT-1.3B, (2,2,2) 1F1B SP: with the
        wait every steady send has a GEMM in flight, at about the same time and memory);
        with minimal or minimal_mlp the weights' wait put the transfer among the stores of
        the layer below instead, and fewer sends had a GEMM in flight, so only with none
        (figures: BENCHMARKS.md and the git log)."""
        saved, stats, mid = list(saved), [], len(saved) // 2
        layers = None if self.late_weights else self.per_layer(chunk)
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
        `vjp`'s of the chunk's -> ((y, statistics), backward, the leaves)."""
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
            for i, weights in enumerate(self.per_layer(index)):
                (x, _), backward, given = self._one_layer_vjp(weights, x, index, index, i)
                kept.append(Kept(backward, given))
            return kept, x, None
        (y, _), backward, inputs, given = self.vjp(x, index, index)
        zeros, zeros_tree = self.zeros(x) if self.split else (None, None)
        kept = Kept(backward, given, None, zeros) if self.keep_activations else None
        return kept, y, (inputs, self.taps(zeros, zeros_tree)) if self.split else None

    def backward_by_layer(self, saved, slot, g, chunk, sums, valid, seed, waits=None):
        """The kept backward a layer at a time, the last first (`by_layer`) -> (the layers'
        gradient sums `sums` (`layer_sums`: a list of each layer's) with this slot's added,
        the chunk input's gradient); seed: the cotangent of the chunk's statistics (training's
        _stats_seed: [Lc, ...] or None). Layer i's residuals are read from stash slot `slot`
        once the gradient reaching it is there (buffers.read_after), so that XLA reads them (and
        copies them, where a kernel needs a buffer of its own) one layer at a time, not all
        at the start of the slot; the first of them also once the F slot has stored all it
        keeps (`saved`: left free, XLA forwarded F's values to these reads, keeping them
        through the B slot). Each layer's weight gradients are added to the sums as they are
        made, and the layer below reads its residuals only once they are: left free, XLA
        deferred them behind the input gradients' chain, keeping their inputs
        (models.weight_gradients_first's finding). The middle layer's reads wait for `waits`
        too (training.IN_FLIGHT). Where `valid` is not set the cotangent is masked to zeros
        (the backward is linear in it; every residual a slot can read is finite), not the
        gradients it makes (with a mixture of experts' seed, those too); and with
        `layer_sums` the layer below waits for the sums, not the gradients: either way a
        gradient's one reader is its add to the sums, which XLA then fuses into the GEMM
        that makes it (tensor.matmul's float32 weight gradients; a select between them, or
        a second reader, kept the add a kernel of its own that read and wrote the sums
        again)."""
        sums = list(sums) if self.layer_sums else sums
        # an idle slot's gradients are zeros: its cotangent masked, not what it makes (the
        # statistics' seed, typed as the statistics are, is not: with one, they are too)
        g = buffers.masked(g, valid)
        deps = (g, saved)
        layers = None if self.late_weights else self.per_layer(chunk)
        for i in reversed(range(len(saved))):
            if waits is not None and i == len(saved) // 2:
                deps = (*deps, waits)
            stored = buffers.read_after(list(saved[i]), slot, deps)
            given, tree = jax.tree.flatten(layers[i] if layers else
                                           self.late_layer(chunk, i, deps))
            seed_i = None if seed is None else jax.tree.map(lambda s: s[i], seed)
            with fused.backward_apart(), \
                    products.weight_dtype_grads() if self.v > 1 else contextlib.nullcontext():
                # (its recomputation needs no barrier)
                g_given, g = self.probe[0][i].run((g, seed_i), stored, given)
            g_layer = jax.tree.unflatten(tree, g_given)
            if seed is not None:
                g_layer = buffers.masked(g_layer, valid)
            if self.layer_sums:
                sums[i] = jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums[i], g_layer)
            else:
                sums = buffers.add_chunk(sums, chunk, g_layer, layer=i)
            deps = (g, sums[i] if self.layer_sums else g_given)
        return sums, g
