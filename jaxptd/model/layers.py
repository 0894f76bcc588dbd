"""Flax modules of the GPT decoder, written from one tensor-parallel rank's point of view,
and the pieces every architecture's layers share.

Owns the layer math and Megatron's intra-layer partitioning (Megatron-LM 2019, §3, Fig. 3).
Parameter shapes are *local*: a module built with `layout.tensor = t` holds 1/t of the
heads, of the MLP columns and of the vocabulary. Global parameters are created with t = 1;
inside the training step's manual shard_map each rank applies the same modules with t = mesh
size on its shards. Collectives run over `layout.tensor_axis` (None: one device, none):

- f, `enter_tensor`, before a column-parallel linear: identity forward, all-reduce backward,
  implicit in JAX's varying-axes typing (an activation that is the same on every tensor rank
  meeting a rank-local weight is broadcast, and the transpose of that is the all-reduce);
- g, `exit_tensor`, after the row-parallel attention output and second MLP layer: the
  explicit all-reduce, exactly two per layer in the forward pass.
With sequence parallelism (`layout.sequence_parallel`; Korthikanti et al. 2022) the
activations outside attention and the MLP are split over the sequence on the tensor axis,
[b, s/t, h]: f becomes an all-gather of the sequence (a reduce-scatter in the backward, as
the transpose of a tiled all-gather) and g a reduce-scatter (an all-gather backward); the
LayerNorms, dropouts and residual adds work on 1/t of the tokens, with dropout masks that
differ per tensor rank.

Every matmul with a weight goes through `dense`, which names it by its weight and keeps its
einsum as data (`DENSE`): with the zero-bubble split of the backward (pipeline executor),
`dense` records its input (collection 'dense_inputs') and takes a zero perturbation on its
output (collection 'perturbations', whose gradient is the output gradient), so a weight
gradient can be computed later from those two alone, without another forward.

Every parameter carries logical axis names (see jaxptd/sharding.py for the rules).
Master weights are float32; each op casts them to the compute dtype at use. LayerNorm,
softmax and the loss run in float32.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    """How the model functions see the parameters: global (tensor=1, no collectives) for the
    single-device reference and initialisation, or one tensor rank's shards inside the
    manual shard_map (tensor=t, collectives over `tensor_axis`)."""
    vocab: int  # padded vocabulary (global)
    tensor: int = 1  # parameter shapes are global / tensor
    tensor_axis: str | None = None  # collectives over this axis; None: a single device
    sequence_parallel: bool = False  # activations outside attention/MLP are [b, s/t, h]
    offload_activations: bool = False  # each layer's checkpointed input in host memory

    @property
    def split_sequence(self) -> bool:
        """True when activations between the tensor-parallel blocks are [b, s/t, h]."""
        return self.sequence_parallel and self.tensor_axis is not None


def normal(std: float, names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def zeros(names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


def psum(x, axis: str | None):
    return x if axis is None else lax.psum(x, axis)


# name -> einsum of (input, weight) for every weight-bearing matmul of the layers.
DENSE = {
    "w_qkv": "bsh,hcnd->cbsnd",  # column-parallel (by heads)
    "w_out": "bqnd,ndh->bqh",  # row-parallel: a partial sum over this rank's heads
    "w_fc1": "bsh,hf->bsf",  # column-parallel
    "w_fc2": "bsf,fh->bsh",  # row-parallel: a partial sum over this rank's 4h/t
}
DENSE_INPUTS = "dense_inputs"  # collection of `dense` inputs (when mutable)
PERTURBATIONS = "perturbations"  # collection of zeros added to `dense` outputs (when given)


def dense(module: nn.Module, name: str, x, w):
    """x times the weight `name` (its einsum is DENSE[name]) in x's dtype; the weight is cast.

    Records x and perturbs the output when the caller asks (see the module docstring);
    otherwise exactly the einsum.
    """
    module.sow(DENSE_INPUTS, name, x, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    y = jnp.einsum(DENSE[name], x, w.astype(x.dtype))
    return module.perturb(name, y, collection=PERTURBATIONS)


def enter_tensor(x, layout: "Layout"):
    """f: the activation entering a column-parallel linear: identity, or with sequence
    parallelism the all-gather [b, s/t, h] -> [b, s, h] (see the module docstring)."""
    if not layout.split_sequence:
        return x
    return lax.all_gather(x, layout.tensor_axis, axis=1, tiled=True)


def exit_tensor(x, layout: "Layout"):
    """g: a row-parallel linear's partial sums [b, s, h] -> their sum over tensor ranks
    [b, s, h], or with sequence parallelism its reduce-scatter [b, s/t, h]."""
    if not layout.split_sequence:
        return psum(x, layout.tensor_axis)
    return lax.psum_scatter(x, layout.tensor_axis, scatter_dimension=1, tiled=True)


def sequence_slice(x, layout: "Layout"):
    """This tensor rank's part of a sequence-long [s, ...] value (all of it without SP)."""
    if not layout.split_sequence:
        return x
    part = x.shape[0] // layout.tensor
    return lax.dynamic_slice_in_dim(x, lax.axis_index(layout.tensor_axis) * part, part)


def gelu(x):
    """tanh-approximation GeLU, as GPT-2 and Megatron use."""
    return jax.nn.gelu(x, approximate=True)


def softmax_reference(scores, scale: float):
    """Causal softmax of scale * scores over the last axis, float32. scores: [b, n, sq, sk]."""
    sq, sk = scores.shape[-2:]
    allowed = jnp.tril(jnp.ones((sq, sk), dtype=bool), k=sk - sq)
    logits = jnp.where(allowed, scores.astype(jnp.float32) * scale, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def layer_norm(cfg: ModelConfig, name: str | None = None) -> nn.LayerNorm:
    """Pre-LayerNorm with replicated float32 scale and bias; callers pass float32 input."""
    return nn.LayerNorm(
        epsilon=cfg.layernorm_eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=zeros(("norm",)),
    )


def normed(cfg: ModelConfig, name: str, x):
    """LayerNorm of x in float32, returned in the compute dtype."""
    return layer_norm(cfg, name)(x.astype(jnp.float32)).astype(cfg.dtype)


class Attention(nn.Module):
    """Causal self-attention: QKV column-parallel by heads, output projection row-parallel."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x, deterministic: bool):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        heads = cfg.num_heads // layout.tensor
        head_dim = cfg.hidden_size // cfg.num_heads
        w_qkv = self.param("w_qkv", normal(cfg.init_std, ("embed", "qkv", "heads", "kv")),
                           (cfg.hidden_size, 3, heads, head_dim))
        b_qkv = self.param("b_qkv", zeros(("qkv", "heads", "kv")), (3, heads, head_dim))
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        w_out = self.param("w_out", normal(out_std, ("heads", "kv", "embed")),
                           (heads, head_dim, cfg.hidden_size))
        b_out = self.param("b_out", zeros(("embed",)), (cfg.hidden_size,))

        qkv = dense(self, "w_qkv", enter_tensor(x, layout), w_qkv) + b_qkv.astype(dt)[:, None, None]
        q, k, v = qkv  # each [b, s, heads/t, d]
        scale = 1.0 / math.sqrt(head_dim)
        if cfg.attention == "cudnn" and jax.default_backend() == "gpu":
            # cuDNN flash attention: no [s, s] scores in memory (config refuses dropout).
            context = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                   implementation="cudnn")
        else:
            key = None
            if cfg.dropout and not deterministic:
                # Each tensor rank holds different heads: its dropout mask must differ.
                rank = 0 if layout.tensor_axis is None else lax.axis_index(layout.tensor_axis)
                key = jax.random.fold_in(self.make_rng("dropout"), rank)
            core = functools.partial(attention_core, cfg=cfg, scale=scale)
            if cfg.remat == "selective":  # keep q, k, v; recompute the [s, s] part
                core = jax.checkpoint(core)
            context = core(q, k, v, key)
        out = dense(self, "w_out", context, w_out)  # partial sum over this rank's heads
        return exit_tensor(out, layout) + b_out.astype(dt)  # g: all-reduce #1


def attention_core(q, k, v, key, *, cfg: ModelConfig, scale: float):
    """softmax(scale q k^T) v with the causal mask and, when `key` is given, dropout on the
    probabilities. q, k, v: [b, s, heads/t, d] -> context [b, s, heads/t, d].

    Megatron's selective recomputation (Korthikanti et al. 2022) recomputes exactly this:
    its [b, heads/t, s, s] tensors are most of a layer's activations at long sequences and
    only 4 b s^2 h of its FLOPs.
    """
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k)  # [b, heads/t, s, s]
    if cfg.kernels == "pallas":
        from pallas_kernels import fused_softmax

        probs = fused_softmax(scores, scale=scale, causal=True)
    else:
        probs = softmax_reference(scores, scale)
    probs = probs.astype(cfg.dtype)
    if key is not None:
        probs = _dropout(probs, cfg.dropout, key)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)  # [b, s, heads/t, d]


class MLP(nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel)."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        ffn = 4 * cfg.hidden_size // layout.tensor
        w_fc1 = self.param("w_fc1", normal(cfg.init_std, ("embed", "mlp")), (cfg.hidden_size, ffn))
        b_fc1 = self.param("b_fc1", zeros(("mlp",)), (ffn,))
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        w_fc2 = self.param("w_fc2", normal(out_std, ("mlp", "embed")), (ffn, cfg.hidden_size))
        b_fc2 = self.param("b_fc2", zeros(("embed",)), (cfg.hidden_size,))

        hidden = dense(self, "w_fc1", enter_tensor(x, layout), w_fc1)  # [b, s, 4h/t]
        if cfg.kernels == "pallas":
            from pallas_kernels import bias_gelu

            hidden = bias_gelu(hidden, b_fc1.astype(dt))
        else:
            hidden = gelu(hidden + b_fc1.astype(dt))
        out = dense(self, "w_fc2", hidden, w_fc2)  # partial sum over this rank's 4h/t
        return exit_tensor(out, layout) + b_fc2.astype(dt)  # g: all-reduce #2


class Block(nn.Module):
    """Pre-LN transformer layer: x + drop(attn(ln1 x)); x + drop(mlp(ln2 x))."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        sub = dict(cfg=self.cfg, layout=self.layout)
        h = Attention(**sub, name="attn")(normed(self.cfg, "ln1", x), deterministic)
        x = x + self._dropout(h, deterministic)
        h = MLP(**sub, name="mlp")(normed(self.cfg, "ln2", x))
        return x + self._dropout(h, deterministic)

    def _dropout(self, x, deterministic):
        # After the all-reduce the activation is the same on every tensor rank: one mask;
        # with sequence parallelism each rank holds other tokens: a mask per rank.
        if not self.cfg.dropout or deterministic:
            return x
        key = self.make_rng("dropout")
        if self.layout.split_sequence:
            key = jax.random.fold_in(key, lax.axis_index(self.layout.tensor_axis))
        return _dropout(x, self.cfg.dropout, key)


def _dropout(x, rate: float, key):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class Embed(nn.Module):
    """Vocab-parallel token embedding plus learned positions; its table is the tied head."""

    cfg: ModelConfig
    layout: Layout

    @property
    def vocab(self) -> int:
        """Local rows: padded vocabulary / tensor."""
        return self.layout.vocab // self.layout.tensor

    def setup(self):
        cfg = self.cfg
        self.wte = self.param("wte", normal(cfg.init_std, ("vocab", "embed")),
                              (self.vocab, cfg.hidden_size))
        self.wpe = self.param("wpe", normal(cfg.init_std, ("positions", "embed")),
                              (cfg.seq_len, cfg.hidden_size))

    def vocab_start(self):
        """First vocabulary id held by this tensor rank."""
        axis = self.layout.tensor_axis
        return 0 if axis is None else lax.axis_index(axis) * self.vocab

    def __call__(self, tokens):  # tokens: [b, s] int32 -> [b, s, h] ([b, s/t, h] with SP)
        # Megatron's lookup: ids outside this rank's rows give zeros; the all-reduce (with
        # SP the reduce-scatter) sums the one rank that holds each id.
        local = tokens - self.vocab_start()
        inside = (local >= 0) & (local < self.vocab)
        rows = jnp.take(self.wte, jnp.clip(local, 0, self.vocab - 1), axis=0)
        x = exit_tensor(jnp.where(inside[..., None], rows, 0.0), self.layout)
        positions = sequence_slice(self.wpe[: tokens.shape[1]], self.layout)
        return (x + positions).astype(self.cfg.dtype)

    def logits(self, x):  # x: [b, s, h] -> [b, s, vocab/t] float32, never gathered
        return jnp.einsum("bsh,vh->bsv", x, self.wte.astype(self.cfg.dtype)).astype(jnp.float32)
