"""The mixture-of-experts MLP (`MoE`): a router, `moe_experts` routed experts of which each
token takes `moe_top_k`, optional shared experts, and the statistics every step logs.

Owns routing, the balance terms, dispatch and combine, and expert parallelism's exchange.

Routing (float32): logits = x W_router [T, E]; scores softmax (Mixtral, Qwen) or sigmoid
(DeepSeek-V3); the top k experts by score (plus DeepSeek-V3's balance bias `router_bias`
when model.moe_bias_rate > 0: it picks, it never weighs); their scores are the weights,
renormalised to sum to 1 with model.moe_norm_topk. y = sum_k w_k E_k(x) + shared(x)
(times sigmoid(x w) with model.moe_shared_gate, Qwen2-MoE's).

Balance terms, each a sum over this rank's tokens in the loss's units (the step divides
every loss sum by global batch x seq_len), so that they are layout-free:
- aux (Switch/GShard): each sequence is a group, aux = E sum_i f_i P_i with f_i the share of
  the sequence's top-k choices that went to expert i (f_i = 1/E when balanced, so aux = 1)
  and P_i its mean score (sigmoid scores normalised per token first). Per token that is
  E sum_i f_i p_ti / s, f counted over the whole sequence (its context ranks summed), so a
  rank sums its own tokens' terms. Sequence groups make it the same at every data,
  microbatch and context layout (a per-microbatch group would not be).
- z (ST-MoE): logsumexp(logits)^2 per token.
The objective adds moe_aux_loss x aux + moe_z_loss x z of every layer (`objective`).

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
rows arrive is known only at run time: on a GPU `lax.ragged_all_to_all` moves just the rows sent, into a
receive buffer sized for the worst case (all e A rows of the group to one rank); XLA's CPU
has no ragged all-to-all, so there each destination's rows travel in a block padded to A
(e times the bytes, the same rows arriving). With a capacity every block is E/e x C slots,
a plain all-to-all. Expert tensor parallelism: each expert's hidden width is split over the
tensor ranks like the dense MLP's (column-parallel in, row-parallel out, the same f and g),
so the router, the routing and the exchange are the same on every tensor rank.

Statistics (sown in the collection STATS, one dict a layer): aux and z (the
sums above), load [E] (rows routed to each expert, before any drop) and dropped (rows
dropped). Under sequence parallelism they are computed on the gathered tokens, the same on
every tensor rank; `_same_on_tensor` makes their type say so (and so their gradient right).
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model import fused
from jaxptd.model.layers import residual_std
from jaxptd.model.tensor import Layout, enter_tensor, exit_tensor, normal, zeros
from jaxptd.parallel.varying import mark_varying, varying_axes

STATS = "moe_stats"  # the Flax collection a MoE layer sows its statistics into


def _weights(cfg: ModelConfig) -> dict:
    """Each statistic's weight in the objective (the counts: none)."""
    return {"aux": cfg.moe_aux_loss, "z": cfg.moe_z_loss, "load": 0.0, "dropped": 0.0}


def objective(stats, cfg: ModelConfig):
    """The balance terms' part of the objective (loss-sum units): moe_aux_loss x aux +
    moe_z_loss x z summed over the layers in `stats` (None: 0)."""
    if stats is None:
        return 0.0
    weights = _weights(cfg)
    return sum(weights[name] * jnp.sum(v) for name, v in stats.items())


def objective_cotangent(stats, cfg: ModelConfig, seed):
    """seed x d objective / d stats, shaped and typed (varying axes) like `stats` (None:
    None): what a pipeline stage's backward takes for the statistics it output."""
    if stats is None:
        return None
    weights = _weights(cfg)
    return {name: jnp.zeros_like(v) + weights[name] * seed for name, v in stats.items()}


def active_mlp_flops(cfg: ModelConfig, per_width: int) -> int:
    """Forward matmul FLOPs a token spends in a mixture of experts' MLP, from its active
    parameters: the router 2 h E, its top k experts per_width h fe each (per_width: 6 for
    SwiGLU's three matrices, 4 for GeLU's two), the shared experts per_width h fs and
    their gate 2 h."""
    h = cfg.hidden_size
    return (2 * h * cfg.moe_experts + cfg.moe_top_k * per_width * h * cfg.expert_ffn
            + per_width * h * cfg.moe_shared_ffn + 2 * h * cfg.moe_shared_gate)


def mlp_flops(cfg: ModelConfig, per_width: int) -> float:
    """Forward matmul FLOPs a token spends in a layer's MLP, the mean over the layers: the
    dense MLP's per_width h f, or with a mixture of experts `active_mlp_flops` in one layer
    of every model.moe_every and the dense MLP's in the others."""
    dense = per_width * cfg.hidden_size * cfg.ffn
    if not cfg.moe:
        return dense
    return (active_mlp_flops(cfg, per_width) + (cfg.unit - 1) * dense) / cfg.unit


def update_bias(params, load, apply, cfg: ModelConfig):
    """DeepSeek-V3's auxiliary-loss-free balance, after a step: each layer's router_bias
    moves by moe_bias_rate towards its experts' mean load (up for an expert under it, down
    over it). load: the step's rows per expert [..., E], laid out as the layers; apply:
    False leaves the biases (a step skipped by the loss scale)."""
    path = ("layers", *cfg.layer_path(cfg.unit - 1), "mlp", "router_bias")
    flat = traverse_util.flatten_dict(params)
    move = cfg.moe_bias_rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)
    flat[path] = flat[path] + jnp.where(apply, move, 0.0)
    return traverse_util.unflatten_dict(flat)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one layer: x [b, s, h] ([b, s/t, h] with sequence
    parallelism) -> [b, s, h] likewise; sows its statistics (module docstring).

    `shared`: the family's dense MLP (a factory of (cfg, layout)), run as the shared
    experts with ffn = moe_shared_ffn; `gated`: SwiGLU experts (llama) or GeLU experts with
    biases (gpt)."""

    cfg: ModelConfig
    layout: Layout
    shared: type
    gated: bool

    @nn.compact
    def __call__(self, x):
        cfg, layout = self.cfg, self.layout
        n, k, h = cfg.moe_experts, cfg.moe_top_k, cfg.hidden_size
        w_router = self.param("w_router", normal(cfg.init_std, ("embed", "router")), (h, n),
                              jnp.float32)
        bias = None
        if cfg.moe_bias_rate:
            bias = self.param("router_bias", zeros(("router",)), (n,), jnp.float32)
        experts = self._expert_weights()

        x_in = enter_tensor(x, layout)  # [b, s, h]: f (sequence parallelism: all tokens)
        b, s = x_in.shape[:2]
        logits = jnp.einsum("bsh,he->bse", x_in.astype(jnp.float32), w_router)
        scores = jax.nn.softmax(logits) if cfg.moe_router == "softmax" \
            else jax.nn.sigmoid(logits)
        pick = scores if bias is None else scores + bias
        _, choice = lax.top_k(lax.stop_gradient(pick), k)  # [b, s, k] expert ids
        weights = jnp.take_along_axis(scores, choice, axis=-1)  # [b, s, k]
        if cfg.moe_norm_topk:
            weights = weights / jnp.sum(weights, -1, keepdims=True)

        tokens = x_in.reshape(b * s, h)
        run = _Dispatch(cfg, layout, experts, self.gated)
        if cfg.moe_capacity:
            out, dropped = run.with_capacity(tokens, choice.reshape(b * s, k))
        else:
            out, dropped = run.dropless(tokens, choice.reshape(b * s, k))
        # out [T, k, h]: each choice's expert output, partial sums over tensor ranks
        y = jnp.einsum("tkh,tk->th", out, weights.reshape(b * s, k).astype(out.dtype))
        y = exit_tensor(y.reshape(b, s, h), layout)  # g
        if cfg.moe_shared_ffn:
            y = y + self._shared(x)
        self.sow(STATS, "stats", self._stats(logits, scores, choice, dropped),
                 init_fn=lambda: None, reduce_fn=lambda _, new: new)
        return y

    def _expert_weights(self) -> dict:
        """This rank's experts: [E/e, ...] each, hidden width split over tensor ranks."""
        cfg, layout = self.cfg, self.layout
        n, h, f = cfg.moe_experts // layout.expert, cfg.hidden_size, \
            cfg.expert_ffn // layout.tensor
        out_std = residual_std(cfg)

        def param(name, std, names, shape):
            return self.param(name, normal(std, ("experts", *names)), (n, *shape), jnp.float32)
        if self.gated:
            return {"gate": param("w_experts_gate", cfg.init_std, ("embed", "mlp"), (h, f)),
                    "up": param("w_experts_up", cfg.init_std, ("embed", "mlp"), (h, f)),
                    "down": param("w_experts_down", out_std, ("mlp", "embed"), (f, h))}
        return {"fc1": param("w_experts_fc1", cfg.init_std, ("embed", "mlp"), (h, f)),
                "b_fc1": self.param("b_experts_fc1", zeros(("experts", "mlp")), (n, f),
                                    jnp.float32),
                "fc2": param("w_experts_fc2", out_std, ("mlp", "embed"), (f, h)),
                "b_fc2": self.param("b_experts_fc2", zeros(("experts", "embed")), (n, h),
                                    jnp.float32)}

    def _shared(self, x):
        """The shared experts: the family's dense MLP at width moe_shared_ffn, gated by
        sigmoid(x w) with moe_shared_gate (on this rank's tokens x)."""
        cfg = self.cfg
        wide = dataclasses.replace(cfg, ffn_size=cfg.moe_shared_ffn)
        y = self.shared(wide, self.layout, name="shared")(x)
        if not cfg.moe_shared_gate:
            return y
        w = self.param("w_shared_gate", normal(cfg.init_std, ("embed", "router")),
                       (cfg.hidden_size, 1), jnp.float32)
        gate = jax.nn.sigmoid(jnp.einsum("bsh,ho->bso", x.astype(jnp.float32), w))
        return (gate * y.astype(jnp.float32)).astype(y.dtype)

    def _stats(self, logits, scores, choice, dropped) -> dict:
        """This rank's statistics of the layer (module docstring): aux and z float32
        scalars (differentiable), load [E] and dropped float32 counts."""
        cfg, layout = self.cfg, self.layout
        n, k = cfg.moe_experts, cfg.moe_top_k
        b = choice.shape[0]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], choice.shape)
        per_row = jnp.zeros((b, n), jnp.float32).at[rows, choice].add(1.0)  # [b, E]
        if layout.context > 1 and layout.context_axis is not None:
            per_row = lax.psum(per_row, layout.context_axis)  # the whole sequence's
        share = per_row / (cfg.seq_len * k)  # f [b, E]
        p = scores if cfg.moe_router == "softmax" else \
            scores / jnp.sum(scores, -1, keepdims=True)
        aux = n * jnp.sum(share[:, None, :] * p) / cfg.seq_len
        z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        load = jnp.zeros((n,), jnp.float32).at[choice.reshape(-1)].add(1.0)
        return {name: self._same_on_tensor(v) for name, v in
                {"aux": aux, "z": z, "load": load, "dropped": dropped}.items()}

    def _same_on_tensor(self, value):
        """A value computed alike on every tensor rank from gathered tokens (sequence
        parallelism: typed as varying over tensor) as one invariant value: the mean over
        the ranks, whose transpose gives each rank 1/t of the gradient, summed back by
        the gathers' and replicated weights' transposes."""
        axis = self.layout.tensor_axis
        if axis is None or axis not in varying_axes(value):
            return value
        return lax.psum(value, axis) / self.layout.tensor


class _Dispatch:
    """Rows to experts and back, dropless or with a capacity (module docstring). Works on
    one rank's tokens [T, h] and choices [T, k]; returns ([T, k, h] expert outputs, partial
    sums over tensor ranks; the number of rows dropped)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, experts: dict, gated: bool):
        self.cfg, self.layout, self.experts, self.gated = cfg, layout, experts, gated
        self.n, self.e = cfg.moe_experts, layout.expert
        self.local = self.n // self.e  # experts on this rank
        self.exchanges = self.e > 1 and layout.expert_axis is not None

    # ----------------------------------------------------------------- the experts' math

    def _mlp(self, rows, matmul, bias_of):
        """The experts' MLP on rows: matmul(rows, w) multiplies each row by its expert's w;
        bias_of(b) gives each row its expert's bias (GeLU experts)."""
        w = {name: v.astype(rows.dtype) for name, v in self.experts.items()}
        if self.gated:
            hidden = fused.swiglu(matmul(rows, w["gate"]), matmul(rows, w["up"]))
            return matmul(hidden, w["down"])
        u = matmul(rows, w["fc1"]).astype(jnp.float32) + bias_of(self.experts["b_fc1"])
        hidden = jax.nn.gelu(u, approximate=self.cfg.gelu == "tanh").astype(rows.dtype)
        # the second bias once over the tensor ranks, whose partial sums g adds up
        first = 1.0 if self.layout.tensor_axis is None else \
            (lax.axis_index(self.layout.tensor_axis) == 0).astype(jnp.float32)
        out = matmul(hidden, w["fc2"]).astype(jnp.float32) + first * bias_of(
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
        return self._mlp(rows, lambda x, w: grouped_matmul(x, w, sizes, gpu=gpu), bias_of)

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
        out = self._mlp(slots, lambda x, w: jnp.einsum("ech,ehf->ecf", x, w),
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
    of a gather is a scatter-add, and XLA:GPU sorts a scatter's indices first (the
    deviceless Mixtral compile: u32 [rows, h] buffers of 1 GiB)."""
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
