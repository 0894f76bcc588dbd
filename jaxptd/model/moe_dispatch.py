"""A mixture of experts' dispatch (jaxptd/model/moe.py's MoE routes, this moves): a rank's
routed rows to their experts, through them and back, dropless or with a capacity, and
expert parallelism's exchange between the ranks of the expert axis.

Dispatch. Each token's k choices are A = T k rows, sorted by expert. Dropless (default): the
experts run as grouped matrix products over their row groups (pallas_kernels/grouped.py:
JAX's Mosaic-GPU grouped GEMM kernels on a GPU, whose XLA lowers `lax.ragged_dot` to a
dense product over all experts; `lax.ragged_dot` elsewhere; no padding to a capacity).
With model.moe_capacity = cf each expert takes at most C = ceil(cf A / E) rows of the rank's
microbatch, first choices before second ones (GShard's priority), the rest dropped and
counted; the experts then run as one batched matmul over [E, C] slots.

Expert parallelism (layout.expert = e > 1): rank r holds experts r E/e .. (r + 1) E/e - 1.
The sorted rows are already grouped by destination rank; an all-to-all over the expert axis
sends each rank its experts' rows, the experts run, a second all-to-all brings the results
back (and the same two, transposed, in the backward); on a GPU in two halves of the
tokens, one half's exchange travelling beside the other half's kernels. Dropless, how many
rows arrive is known only at run time: on a GPU `lax.ragged_all_to_all` moves just the rows
sent, into a receive buffer sized for the worst case (all e A rows of the group to one
rank); XLA's CPU has no ragged all-to-all, so there each destination's rows travel in a
block padded to A (e times the bytes, the same rows arriving). With a capacity every block
is E/e x C slots, a plain all-to-all. Expert tensor parallelism: each expert's hidden
width is split over the tensor ranks like the dense MLP's (column-parallel in, row-parallel
out, the same f and g), so the router, the routing and the exchange are the same on every
tensor rank.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model import fp8, fused
from jaxptd.model.products import fp8_product
from jaxptd.model.tensor import Layout
from jaxptd.parallel.varying import mark_varying, varying_axes


class Dispatch:
    """Rows to experts and back, dropless or with a capacity (module docstring). Works on
    one rank's tokens [T, h] and choices [T, k]; returns ([T, k, h] expert outputs, partial
    sums over tensor ranks; the number of rows dropped)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, experts: dict, gated: bool,
                 histories: dict | None = None):
        self.cfg, self.layout, self.experts, self.gated = cfg, layout, experts, gated
        self.histories = histories or {}  # model.fp8=delayed: an expert weight's amaxes
        self.n, self.e = cfg.moe_experts, layout.expert
        self.local = self.n // self.e  # experts on this rank
        self.exchanges = self.e > 1 and layout.expert_axis is not None

    # ----------------------------------------------------------------- the experts' math

    def _mlp(self, rows, matmul, bias_of):
        """The experts' MLP on rows: matmul(rows, w, history) multiplies each row by its
        expert's w (history: the weight's amax history, or None); bias_of(b) gives each row
        its expert's bias (GeLU experts)."""
        w = {name: v.astype(rows.dtype) for name, v in self.experts.items()}
        h = self.histories.get
        if self.gated:
            hidden = fused.swiglu(matmul(rows, w["gate"], h("gate")),
                                  matmul(rows, w["up"], h("up")))
            return matmul(hidden, w["down"], h("down"))
        u = matmul(rows, w["fc1"], h("fc1")).astype(jnp.float32) + bias_of(
            self.experts["b_fc1"])
        hidden = jax.nn.gelu(u, approximate=self.cfg.gelu == "tanh").astype(rows.dtype)
        # the second bias once over the tensor ranks, whose partial sums g adds up
        first = 1.0 if self.layout.tensor_axis is None else \
            (lax.axis_index(self.layout.tensor_axis) == 0).astype(jnp.float32)
        out = matmul(hidden, w["fc2"], h("fc2")).astype(jnp.float32) + first * bias_of(
            self.experts["b_fc2"])
        return out.astype(rows.dtype)

    def _grouped(self, rows, sizes):
        """The experts on rows [R, h] sorted by local expert, sizes [E/e] rows each (rows
        past their sum: padding, zeros out) -> [R, h]: grouped GEMMs."""
        ids = jnp.repeat(jnp.arange(self.local), sizes, total_repeat_length=rows.shape[0])
        ids = jnp.where(jnp.arange(rows.shape[0]) < jnp.sum(sizes), ids, self.local)

        def bias_of(b):  # [E/e, f] -> [R, f], zeros for padding rows
            return jnp.take(b, ids, axis=0, mode="fill", fill_value=0)
        from pallas_kernels.grouped import grouped_matmul  # (Mosaic GPU: on use)

        gpu = self.layout.platform == "gpu"
        return self._mlp(rows, lambda x, w, _: grouped_matmul(x, w, sizes, gpu=gpu), bias_of)

    # ----------------------------------------------------------------------- dropless

    def dropless(self, tokens, choice):
        """Dropless; with expert parallelism on a GPU in two halves of the tokens, so that
        one half's exchange can travel while the other's experts compute (XLA's scheduler
        overlaps an async all-to-all with the independent half's kernels)."""
        t = choice.shape[0]
        if not (self.exchanges and self.layout.platform == "gpu" and t % 256 == 0):
            return self._dropless(tokens, choice)
        halves = [self._dropless(tokens[i:i + t // 2], choice[i:i + t // 2])
                  for i in (0, t // 2)]
        return jnp.concatenate([out for out, _ in halves]), jnp.float32(0)

    def _dropless(self, tokens, choice):
        t, k = choice.shape
        flat = choice.reshape(-1)  # assignment a = token a // k, its (a % k)-th choice
        order = jnp.argsort(flat, stable=True)
        back = jnp.argsort(order)  # its inverse
        sizes = jnp.bincount(flat, length=self.n)  # [E] rows each expert gets
        rows = permute(jnp.repeat(tokens, k, axis=0), order, back)  # [A, h] by expert
        if self.exchanges:
            out = self._exchanged(rows, sizes)
        else:
            out = self._grouped(rows, sizes)
        return permute(out, back, order).reshape(t, k, -1), jnp.float32(0)

    def _exchanged(self, rows, sizes):
        """Expert parallelism, dropless: rows [A, h] sorted by expert (so by destination
        rank) to their experts' ranks, through the experts, and back -> [A, h]."""
        axis, e, local = self.layout.expert_axis, self.e, self.local
        me = lax.axis_index(axis)
        every = lax.all_gather(sizes, axis)  # [e, E]: rows rank s sends to expert x
        sent = every.reshape(e, e, local).sum(-1)  # [e src, e dst]
        mine = lax.dynamic_slice_in_dim(every, me * local, local, axis=1)  # [e src, E/e]
        if self.layout.platform == "gpu":  # [e A, h]: by source, padding after them all
            arrived = _ragged_there(rows, sent, me, axis)
            counts, width = mine.reshape(1, e * local), e * rows.shape[0]
        else:  # [e A, h]: by source, padding after each source's rows
            arrived = _padded_there(rows, sent, me, axis)
            counts, width = mine, rows.shape[0]
        # each arrived row's local expert (a source's rows come sorted by expert)
        ids = jax.vmap(lambda c: jnp.repeat(jnp.tile(jnp.arange(local), c.shape[0] // local),
                                            c, total_repeat_length=width))(counts)
        ids = jnp.where(jnp.arange(width) < counts.sum(-1, keepdims=True), ids, local)
        order = jnp.argsort(ids.reshape(-1), stable=True)  # by expert, padding last
        back = jnp.argsort(order)
        done = permute(self._grouped(permute(arrived, order, back), mine.sum(0)), back, order)
        if self.layout.platform == "gpu":
            return _ragged_back(done, sent, me, axis, rows.shape[0])
        return _padded_back(done, sent, me, axis, rows.shape[0])

    # ----------------------------------------------------------------------- capacity

    def capacity(self, rows: int) -> int:
        """Slots per expert for a rank's `rows` routed rows (T k)."""
        return max(1, math.ceil(self.cfg.moe_capacity * rows / self.n))

    def with_capacity(self, tokens, choice):
        t, k = choice.shape
        a, n, cap = t * k, self.n, self.capacity(t * k)
        flat = choice.T.reshape(-1)  # priority order: every token's first choice, then ...
        order = jnp.argsort(flat, stable=True)
        expert = flat[order]
        sizes = jnp.bincount(flat, length=n)
        position = jnp.arange(a) - (jnp.cumsum(sizes) - sizes)[expert]  # within its expert
        kept = position < cap
        slot = jnp.where(kept, expert * cap + position, n * cap)  # n cap: the bin
        token = order % t
        slots = jnp.zeros((n * cap + 1, tokens.shape[-1]), tokens.dtype)
        slots = slots.at[slot].set(tokens[token])[:-1].reshape(n, cap, -1)  # [E, C, h]
        if self.exchanges:  # [e dst, E/e C] -> [e src, E/e, C] -> [E/e, e C]
            slots = lax.all_to_all(slots.reshape(self.e, -1, slots.shape[-1]),
                                   self.layout.expert_axis, 0, 0, tiled=True)
            slots = slots.reshape(self.e, self.local, cap, -1).transpose(1, 0, 2, 3)
            slots = slots.reshape(self.local, self.e * cap, -1)
        axes, layout = self.layout.fp8_axes(fp8.EXPERTS), self.layout  # axes None: 16-bit
        margin = layout.fp8_margin if layout.fp8 == "delayed" else None
        out = self._mlp(slots, fp8_product("ech,ehf->ecf", axes, margin) if axes is not None else
                        lambda x, w, _: jnp.einsum("ech,ehf->ecf", x, w),
                        lambda b: b[:, None, :])
        if self.exchanges:
            out = out.reshape(self.local, self.e, cap, -1).transpose(1, 0, 2, 3)
            out = lax.all_to_all(out.reshape(self.e, -1, out.shape[-1]),
                                 self.layout.expert_axis, 0, 0, tiled=True)
        out = out.reshape(n * cap, -1)
        out = jnp.concatenate([out, jnp.zeros_like(out[:1])])[slot]  # the bin's: zeros
        out = jnp.zeros_like(out).at[order].set(out)  # priority order [k T, h]
        out = out.reshape(k, t, -1).transpose(1, 0, 2)
        return out, jnp.float32(a) - jnp.sum(kept).astype(jnp.float32)


# ------------------------------------------------------------------ the exchanges

@jax.custom_vjp
def permute(x, index, inverse):
    """x's rows reordered, x[index], for `index` a permutation of them and `inverse` its
    inverse: a gather both ways (the backward is dy[inverse]), where autodiff's transpose
    of a gather is a scatter-add, and XLA:GPU sorts a scatter's indices first (u32
    [rows, h] buffers in the deviceless Mixtral compile)."""
    return x.at[index].get(mode="promise_in_bounds", unique_indices=True)


def _permute_fwd(x, index, inverse):
    return permute(x, index, inverse), (index, inverse)


def _permute_bwd(kept, dy):
    index, inverse = kept
    return dy.at[inverse].get(mode="promise_in_bounds", unique_indices=True), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def _padded_there(rows, sent, me, axis):
    """rows [A, h] by destination -> [e A, h]: source s's rows to this rank at s A..,
    padded (plain all-to-all of [e, A, h] blocks: XLA's CPU has no ragged one)."""
    e, a = sent.shape[0], rows.shape[0]
    send = sent[me]
    start = jnp.cumsum(send) - send
    i = jnp.arange(a)
    blocks = jnp.where((i < send[:, None])[..., None],
                       rows[jnp.minimum(start[:, None] + i, a - 1)], 0)  # [e, A, h]
    return lax.all_to_all(blocks, axis, 0, 0, tiled=True).reshape(e * a, -1)


def _padded_back(done, sent, me, axis, a):
    """The inverse of _padded_there: [e A, h] results by source -> [A, h] by destination."""
    e = sent.shape[0]
    blocks = lax.all_to_all(done.reshape(e, a, -1), axis, 0, 0, tiled=True)  # [e dst, A, h]
    send = sent[me]
    ends = jnp.cumsum(send)
    dst = jnp.searchsorted(ends, jnp.arange(a), side="right")  # each row's destination
    within = jnp.arange(a) - (ends - send)[jnp.minimum(dst, e - 1)]
    return blocks[jnp.minimum(dst, e - 1), jnp.clip(within, 0, a - 1)]


def _ragged_there(rows, sent, me, axis):
    """rows [A, h] by destination -> [e A, h]: the rows sent, by source, then padding
    (lax.ragged_all_to_all: only the rows sent travel)."""
    e, a = sent.shape[0], rows.shape[0]
    send = sent[me]
    offsets = jnp.cumsum(send) - send  # where each destination's rows start here
    lands = (jnp.cumsum(sent, 0) - sent)[me]  # where they land there: after lower sources
    buffer = _receive_buffer((e * a, rows.shape[-1]), rows, axis)
    return lax.ragged_all_to_all(rows, buffer, offsets, send, lands, sent[:, me],
                                 axis_name=axis)


def _ragged_back(done, sent, me, axis, a):
    """The inverse of _ragged_there: [e A, h] results by source -> [A, h] by destination."""
    recv = sent[:, me]
    offsets = jnp.cumsum(recv) - recv  # source s's rows here
    lands = (jnp.cumsum(sent, 1) - sent)[:, me]  # where they started at source s
    buffer = _receive_buffer((a, done.shape[-1]), done, axis)
    return lax.ragged_all_to_all(done, buffer, offsets, recv, lands, sent[me],
                                 axis_name=axis)


def _receive_buffer(shape, sent, axis):
    """Zeros for lax.ragged_all_to_all to receive into, typed as varying like the rows
    sent and over the exchange's axis (the result takes the buffer's type: an invariant
    one typed the received rows invariant, and a pipeline stash, whose residuals come
    back varying over pipe, then broke the grouped kernels' custom_vjp on the H100)."""
    return mark_varying(jnp.zeros(shape, sent.dtype),
                        tuple(sorted(varying_axes(sent) | {axis})))
