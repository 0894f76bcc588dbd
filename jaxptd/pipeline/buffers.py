"""The executor's slot buffers and stage-to-stage sends.

Owns reading and writing a slot of a [slots, ...] buffer (masked where a slot is idle),
slicing a chunk's weights out of a rank's [v, 1, Lc, ...] stack and adding its gradients
back, and the `lax.ppermute` traffic over 'pipe': PTD-P §4.1's scatter/gather (each tensor
rank sends its 1/t slice of a [b, s, h] message, the receiver all-gathers it over
'tensor') and the storing of what arrived.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from jaxptd.model import fp8
from jaxptd.parallel.mesh import PIPE, TENSOR
from jaxptd.parallel.varying import after, gather_invariant, mark_varying, varying_axes


def read(buffer, slot):
    """buffer[slot] (slot traced)."""
    return lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)


def write(buffer, slot, value, valid):
    """buffer[slot] = value where valid (True: unconditionally); the buffer stays
    row-major (`row_major`)."""
    if valid is not True:
        value = jnp.where(valid, value, read(buffer, slot))
    return row_major(lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype),
                                                     slot, 0))


def row_major(buffer):
    """buffer in row-major layout. Left to XLA's layout assignment, a slot buffer of the
    rounds' carry could be laid out with its slots inside another dimension, and the
    values written to it and read from it then laid out to match: in the H100 compile of
    GPT-1.3B at (2,2,2), 1F1B, SP, remat=full, kept a layer at a time, the layers' stored
    inputs [3, b, s/t, h] came out hidden dimension first, and with them the whole
    residual stream (many times the transpose kernels a step, and a slower step); 1F1B
    without SP had a good part of its carried arrays so, and the B slot's copies out of
    the stash were transposes. Pinned, every schedule measured (1F1B, interleaved,
    zb-h1) took less time a step (figures: BENCHMARKS.md and the git log)."""
    return with_layout_constraint(buffer, Layout(tuple(range(buffer.ndim))))


def read_after(buffers, slot, deps):
    """Each leaf of `buffers` at [slot], read only once every leaf of `deps` is computed
    that varies over no mesh axis the read's value does not (varying.after: a dependence
    on a leaf varying over more axes would need a reduction over them; such a leaf is
    left out, and so is an empty one)."""
    index = _waiting(slot, deps)
    return jax.tree.map(lambda b: read(b, index(b)), buffers)


def _waiting(slot, deps):
    """buffer -> slot, made to depend on the leaves of `deps` that `read_after` keeps for
    that buffer (the index then varies over no axis the buffer and slot do not: the
    buffer keeps its type). One dependence a set of axes, shared by the buffers that vary
    alike: one a buffer made the program grow with buffers x leaves (a layer's stash
    read after the whole F slot's values: most of a pipelined MoE step's lowered text)."""
    leaves = [d for d in jax.tree.leaves(deps) if d.size]
    made = {}

    def index(buffer):
        axes = varying_axes(buffer) | varying_axes(slot)
        if axes not in made:
            ready = [d for d in leaves if varying_axes(d) <= axes]
            made[axes] = after(slot, ready, like=buffer) if ready else slot
        return made[axes]
    return index


def read_tree(buffers, slot):
    return jax.tree.map(lambda b: read(b, slot), buffers)


def write_tree(buffers, slot, values, valid, deps=()):
    """write() of each leaf; given `deps`, each written only once they are computed (as
    read_after reads)."""
    index = _waiting(slot, deps)
    return jax.tree.map(lambda b, x: write(b, index(b), x, valid), buffers, values)


def slots(template, count: int, unwritten: bool = False):
    """[count, ...] zeros like every leaf of `template`, varying over the axes the leaf
    varies over and over pipe: a slot is written at an index that varies over pipe (the
    rank's table), which makes even an invariant leaf (an empty cuDNN attention residual,
    shape [0]) varying, and a buffer written in one branch of a conditional only must
    not change type. unwritten: left as allocated (`lax.empty`: zeros on CPU, on a GPU
    nothing written), for buffers whose every slot is written before it is read. Zeroed,
    the first write of each slot buffer in the warm-up rounds (a constant slot there)
    became a pad of the whole buffer: every slot written once more a step."""
    def make(t):
        shape = (count, *t.shape)
        x = lax.empty(shape, t.dtype) if unwritten else \
            jnp.broadcast_to(jnp.zeros_like(t), shape)
        return mark_varying(x, (*sorted(varying_axes(t)), PIPE))
    return jax.tree.map(make, template)


def masked(tree, valid):
    """tree where valid, zeros elsewhere (valid True: tree itself)."""
    return tree if valid is True else jax.tree.map(lambda x: jnp.where(valid, x, 0), tree)


def chunk(layers, c):
    """Chunk c's layers from a local [v, 1, Lc, ...] stack -> [Lc, ...]."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, c, 0, keepdims=False)[0], layers)


def chunk_of(row, slot: str, chunks: int):
    """The chunk a slot works on: the table's, or with one chunk a static 0 (a dynamic
    index made XLA copy the chunk's weights out of the stack in every slot)."""
    return row[f"{slot}_chunk"] if chunks > 1 else 0


def add_chunk(grads_layers, c, chunk_grads, layer: int | None = None):
    """grads[c, 0] += chunk_grads for the leaves chunk_grads has (a subtree of the layers,
    each [Lc, ...]); with `layer`, grads[c, 0, layer] += one layer's gradients. Written in
    place."""
    start = (c, 0) if layer is None else (c, 0, layer)
    flat = traverse_util.flatten_dict(grads_layers)

    def add(total, g, path):
        g = g.reshape((1,) * len(start) + g.shape)
        at = (*start, *(0,) * (total.ndim - len(start)))
        old = lax.dynamic_slice(total, at, g.shape)
        return lax.dynamic_update_slice(total, _combined(old, g, path), at)
    for path, g in traverse_util.flatten_dict(chunk_grads).items():
        flat[path] = add(flat[path], g, path)
    return traverse_util.unflatten_dict(flat)


def add_layer(sums, grads):
    """One layer's gradient sums (a layer's tree) with `grads` (a subtree of it) added."""
    flat = traverse_util.flatten_dict(sums)
    for path, g in traverse_util.flatten_dict(grads).items():
        flat[path] = _combined(flat[path], g, path)
    return traverse_util.unflatten_dict(flat)


def _combined(total, g, path):
    """total + g in total's dtype (an amax history's entries: their maximum)."""
    g = g.astype(total.dtype)
    return jnp.maximum(total, g) if fp8.is_history(path) else total + g


def _scatter(x, tensor: int):
    """[b, s, h] (same on every tensor rank) -> this rank's [b, s, h/t] slice."""
    if tensor == 1:
        return x
    width = x.shape[-1] // tensor
    return lax.dynamic_slice_in_dim(x, lax.axis_index(TENSOR) * width, width, axis=-1)


def _gather(x, tensor: int):
    """[b, s, h/t] slices -> [b, s, h], the same (and typed so) on every tensor rank."""
    return x if tensor == 1 else gather_invariant(x, TENSOR, x.ndim - 1, tensor)


def _pairs(p: int, v: int, step: int) -> list:
    """ppermute (source, destination) pairs r -> r + step over 'pipe': activations (step
    1) or gradients (step -1); the wrap-around link is used only by interleaving."""
    return [(r, (r + step) % p) for r in range(p) if v > 1 or 0 <= r + step < p]


def send(x, p: int, v: int, step: int, tensor: int, v_shape: bool = False):
    """Starts sending x [b, s, h] along the chain (each tensor rank its 1/t slice; with
    sequence parallelism, tensor = 1 here: x is already this rank's [b, s/t, h]) -> what
    arrives. V-shaped (schedules.virtual_stage), a rank's message goes up or down the
    ranks by its chunk, or stays (the turn on rank p - 1): x goes both ways, and what
    arrives is a pair for lowering's two channels, (along, against) the chain's direction
    `step` (from rank r - step, from rank r + step; recv_f_* and recv_f2_*, recv_b_* and
    recv_b2_*), with rank p - 1's own x in place of what no rank above sends it."""
    mine = _scatter(x, tensor)
    if not v_shape:
        return lax.ppermute(mine, PIPE, _pairs(p, v, step))
    below = lax.ppermute(mine, PIPE, _pairs(p, 1, 1))  # from rank r - 1
    above = jnp.where(lax.axis_index(PIPE) == p - 1, mine,
                      lax.ppermute(mine, PIPE, _pairs(p, 1, -1)))  # from r + 1, the turn
    return (below, above) if step == 1 else (above, below)


def arrive(buffer, message, slot, tensor: int):
    """Stores a message that arrived (gathered over tensor) in buffer[slot], unmasked: an
    idle arrival's slot is the buffer's spare (lowering's Rounds.spare)."""
    return write(buffer, slot, _gather(message, tensor), True)
