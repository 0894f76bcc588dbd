"""The zero-bubble kinds' W slot on a pipe rank, and what a split B keeps for it.

Owns `WeightSlot`, which training.Training takes its `weight` slot from: a split B's taps
(each dense() output's gradient; with parallel.stash=inputs also the dense inputs) kept for
its W, stored in a W slot where the W runs in a later round and handed over in the round
(the carry's HANDED entry) where it runs in the B's own round (lowering's w_now; the
greedy packing puts a B's W there wherever it can) or where the B runs again in the W's
round (slot_pool.reruns: masked rounds, a rank whose B slot is free there), and the W itself: the dense() weights'
gradients from the taps and the dense inputs (F's tapes), no second forward.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxptd import model as models
from jaxptd.pipeline import buffers

# the carry's entry, between a round's B and W slots, for what the B kept for a W (the
# W slot's kept values, taps) where the round's W is that B's (lowering's w_now, the
# segment's taps): handed over in the round, not stored in a W slot and read out again
HANDED = "handed"


class WeightSlot:
    """training.Training's W slot and its split B's keeping for it (module docstring); the
    Training gives self.taped, self.chunks, self.params, self.v, self.model, self.layout,
    self.stage and self.layer_sums."""

    def _keep_for_weight(self, carry, row, kept, valid, seg):
        """What a split B keeps for its W (`kept`: the taps, with stash=inputs also the
        dense inputs): stored in its W slot where the W is a later round's, handed over in
        the carry (HANDED) where some W of the segment is its B's round's (w_now: also a B
        that runs again for its W)."""
        keeps, source, _ = seg.taps
        if keeps:
            carry = {**carry, "wsaved": buffers.write_tree(
                carry["wsaved"], row["b_wslot"], kept, (row["b_keeps"] > 0) & valid)}
        return carry if source == "slot" else {**carry, HANDED: kept}

    @staticmethod
    def counted(row, valid, seg):
        """Where a B slot's gradients and loss count: where it is valid, but for a B that
        runs again for its W (lowering's b_again, slot_pool.reruns): its first run's did."""
        return (row["b_again"] == 0) & valid if seg.taps[2] else valid

    def handover(self):
        """Zeros like the HANDED entry (what the executor puts in the carry before a B slot
        that may hand over: an idle conditional B leaves it so)."""
        _, _, wkept = self.chunks.probe
        return buffers.read_tree(buffers.slots(wkept[1] if self.taped else wkept, 1), 0)

    def weight(self, carry, row, valid, seg):
        """W: the dense() weights' gradients from what the microbatch's B kept. With
        unrolled layers a layer at a time (`_layer_weights`)."""
        kept = self._kept_for_weight(carry, row, seg)
        if self.taped:
            inputs, g_taps = buffers.read_tree(carry["tapes"], row["w_tslot"]), kept
        else:
            inputs, g_taps = kept
        chunk = buffers.chunk_of(row, "w", self.v)
        dense, rest = models.split_dense(buffers.chunk(self.params["layers"], chunk))
        if models.scans_layers(self.model, self.layout.platform):
            g_dense = models.dense_weight_grads(dense, inputs, g_taps, self.layout,
                                                self.stage.prepare, rest)
            sums = buffers.add_chunk(carry["grads"]["layers"], chunk,
                                     buffers.masked(g_dense, valid))
        else:
            sums = self._layer_weights(carry["grads"]["layers"], chunk, (dense, rest),
                                       inputs, g_taps, valid, seg.chunks[2])
        return None, {**carry, "grads": {**carry["grads"], "layers": sums}}

    def _kept_for_weight(self, carry, row, seg):
        """What the W's B kept for it (`_keep_for_weight`): read out of its W slot, or
        handed over in the round (w_now), as the segment's taps say."""
        source = seg.taps[1]
        if source == "now":
            return carry[HANDED]
        stored = buffers.read_tree(carry["wsaved"], row["w_slot"])
        if source == "slot":
            return stored
        return jax.tree.map(lambda now, x: jnp.where(row["w_now"] > 0, now, x),
                            carry[HANDED], stored)

    def _layer_weights(self, sums, chunk, weights, inputs, g_taps, valid, at=None):
        """W a layer at a time: layer i's dense inputs and output gradients (of the chunk's
        [Lc, ...] trees), with sequence parallelism its inputs gathered, and
        its gradients added to the sums; weights: the chunk's (dense() weights, the other
        leaves: model.fp8=delayed's histories). With `layer_sums` (one chunk) the sums are
        each layer's own and the gradients come out of their GEMMs in float32
        (Layout.apart), the output gradients masked where the slot is idle rather than the
        gradients made, so that the add to the sums is the GEMM's epilogue (as the kept
        backward a layer at a time's); else they are added to the [v, 1, Lc, ...] stack,
        masked. The stacked W
        (`models.dense_weight_grads`) copied a slot's values for all the chunk's layers out
        at once and gathered them at once: at (2,2,2) zb-h1 with SP and
        model.remat=minimal a layer at a time takes less memory and a little less time.
        (Reading layer i only once layer i - 2's gradients were made took a little less
        memory still but far more time: XLA fused those reads with other work into kernels
        that were far slower. Figures: BENCHMARKS.md and the git log.) Held chunks
        (Training.swaps) as `layer_sums`, into held chunk `at` (Chunks.add_held)."""
        held = self.swaps is not None
        # sums of a layer's own (held or layer_sums): the GEMMs add into them, masked by
        # their output gradients; else the stack's, masked as they are added
        own = held or self.layer_sums
        layout = dataclasses.replace(self.layout, apart=True) if own else self.layout
        sums = list(sums) if self.layer_sums else sums
        for i in range(jax.tree.leaves(weights[0])[0].shape[0]):
            x, g = (jax.tree.map(lambda b: b[i], tree) for tree in (inputs, g_taps))
            dense, rest = jax.tree.map(lambda w: w[i], weights)  # (dense(), the others)
            grads = models.layer_dense_weight_grads(
                dense, x, buffers.masked(g, valid) if own else g, layout, self.stage.prepare,
                rest)
            if held:
                sums = self.chunks.add_held(sums, chunk, at, i, grads)
            elif own:
                sums[i] = buffers.add_layer(sums[i], grads)
            else:
                sums = buffers.add_chunk(sums, chunk, buffers.masked(grads, valid), layer=i)
        return sums
