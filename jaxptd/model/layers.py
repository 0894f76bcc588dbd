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
activations outside attention and the MLP are split over the tokens on the tensor axis,
[b, s/t, h]: f becomes an all-gather of the tokens (a reduce-scatter in the backward, as
the transpose of a tiled all-gather) and g a reduce-scatter (an all-gather backward); the
LayerNorms, dropouts and residual adds work on 1/t of the tokens, with dropout masks that
differ per tensor rank. A rank's part is a block of the microbatch's b s tokens in row
order (rank k: tokens k b s / t onwards), shaped [b, s/t, h]: Megatron splits its
[s, b, h] activations on the leading axis for the same reason, a gather or scatter of a
contiguous block (a split of the sequence axis of [b, s, h] made XLA transpose around
every collective: 8 GB a step at (2,1,4) on H100). The ops between them are token-wise;
only the positions a rank's tokens have depend on the split (`token_positions`).

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
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd.config import ModelConfig
from jaxptd.model import fused


@dataclass(frozen=True)
class Layout:
    """How the model functions see the parameters: global (tensor=1, no collectives) for the
    single-device reference and initialisation, or one tensor rank's shards inside the
    manual shard_map (tensor=t, collectives over `tensor_axis`)."""
    vocab: int  # padded vocabulary (global); the real one to draw parameters (stack.boxed_init)
    tensor: int = 1  # parameter shapes are global / tensor
    tensor_axis: str | None = None  # collectives over this axis; None: a single device
    sequence_parallel: bool = False  # activations outside attention/MLP are [b, s/t, h]
    offload_activations: bool = False  # each layer's checkpointed input in host memory
    platform: str = "cpu"  # the target's (jaxptd/target.py): "gpu" takes cuDNN and Triton
    # FSDP: ((dense name, dimension), ...) of the layer weights held as shards over
    # `fsdp_axis`, split on that dimension, which `dense` gathers in `fsdp_dtype`
    fsdp: tuple[tuple[str, int], ...] = ()
    fsdp_axis: str | None = None
    fsdp_dtype: str = "float32"

    @property
    def split_sequence(self) -> bool:
        """True when activations between the tensor-parallel blocks are [b, s/t, h]."""
        return self.sequence_parallel and self.tensor_axis is not None

    def fsdp_dim(self, name: str) -> int | None:
        """The dimension on which the dense() weight `name` is an FSDP shard (None: whole)."""
        return dict(self.fsdp).get(name)


def normal(std: float, names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def zeros(names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


def psum(x, axis: str | None):
    return x if axis is None else lax.psum(x, axis)


# name -> einsum of (input, weight) for every weight-bearing matmul of the layers.
DENSE = {
    # q, k and v side by side: the GEMM's own output layout [b s, 3 n d] (a leading c made
    # XLA transpose it, and transpose the gradient back: two copies a layer)
    "w_qkv": "bsh,hcnd->bscnd",  # column-parallel (by heads)
    "w_out": "bqnd,ndh->bqh",  # row-parallel: a partial sum over this rank's heads
    "w_fc1": "bsh,hf->bsf",  # column-parallel
    "w_fc2": "bsf,fh->bsh",  # row-parallel: a partial sum over this rank's ffn/t
    # Llama (llama.py)
    "w_q": "bsh,hnd->bsnd",  # column-parallel (by heads)
    "w_kv": "bsh,hcnd->bscnd",  # column-parallel by key/value heads (or replicated)
    "w_o": "bqnd,ndh->bqh",  # row-parallel
    "w_gate": "bsh,hf->bsf",  # column-parallel
    "w_up": "bsh,hf->bsf",  # column-parallel
    "w_down": "bsf,fh->bsh",  # row-parallel
    "w_head": "bsh,hv->bsv",  # untied output layer, column-parallel (by vocabulary)
    # BERT's heads (bert.py), replicated
    "w_mlm": "bsh,hk->bsk",
    "w_pool": "bh,hk->bk",
    "w_sop": "bh,hc->bc",
}
# Row-parallel matmuls: their output is a partial sum that the all-reduce after them (g)
# completes; model.remat=minimal keeps the residual stream after it, not the partial sum.
ROW_PARALLEL = ("w_out", "w_fc2", "w_o", "w_down")
DENSE_INPUTS = "dense_inputs"  # collection of `dense` inputs (when mutable)
# checkpoint names of what model.remat=minimal keeps: every other dense() output, and the
# residual stream between a layer's attention and MLP blocks
DENSE_OUTPUT, RESIDUAL = "dense_output", "residual"
PERTURBATIONS = "perturbations"  # collection of zeros added to `dense` outputs (when given)


def dense(module: nn.Module, name: str, x, w):
    """x times the weight `name` (its einsum is DENSE[name]) in x's dtype; the weight is cast
    (an FSDP shard is gathered for this matmul alone: `matmul`).

    Records x and perturbs the output when the caller asks (see the module docstring);
    otherwise exactly the einsum.
    """
    module.sow(DENSE_INPUTS, name, x, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    y = matmul(name, module.layout)(x, w)
    if name not in ROW_PARALLEL:
        y = checkpoint_name(y, DENSE_OUTPUT)
    return module.perturb(name, y, collection=PERTURBATIONS)


def weight(module: nn.Module, name: str, init, shape: tuple[int, ...]):
    """The dense() weight `name` of a layer, float32 [shape] (one tensor rank's). Under FSDP
    (layout.fsdp names it) the layer holds its shard, which `dense` gathers where it
    multiplies: read as it is, past Flax's check that a parameter has `shape`."""
    if module.layout.fsdp_dim(name) is None or module.is_initializing():
        return module.param(name, init, shape, jnp.float32)
    return module.get_variable("params", name)


def matmul(name: str, layout: Layout):
    """(x, w) -> x times the weight `name` as dense() multiplies it: einsum DENSE[name] with
    w cast to x's dtype, and an FSDP shard (layout.fsdp) gathered for it (_fsdp_matmul)."""
    dim = layout.fsdp_dim(name)
    if dim is None:
        return lambda x, w: jnp.einsum(DENSE[name], x, w.astype(x.dtype))
    return _fsdp_matmul(DENSE[name], dim, layout.fsdp_axis, layout.fsdp_dtype)


@functools.lru_cache(maxsize=None)
def _fsdp_matmul(spec: str, dim: int, axis: str, dtype: str):
    """einsum(spec, x, w) for w this rank's FSDP shard, split on `dim` over `axis`: the
    weight is all-gathered in `dtype`, cast to x's, for this one matmul, and gathered again
    for its backward, whose weight gradient the gather's transpose reduce-scatters into the
    shard (float32). One matmul's weight (seeds/003 wrapped each linear, 4 h^2 at most, in
    its own FSDP unit) is whole at a time, not a layer's 12 h^2: optimization barriers tie
    the forward's gather to x and the backward's to the output gradient, so XLA cannot
    gather ahead (no prefetch: the gather is not overlapped with the matmul before it)."""
    def gathered(w, like):
        whole = lax.all_gather(w.astype(dtype), axis, axis=dim, tiled=True)
        return jnp.einsum(spec, like, whole.astype(like.dtype))

    @jax.custom_vjp
    def fsdp_matmul(x, w):
        x, w = lax.optimization_barrier((x, w))
        return gathered(w, x)

    def forward(x, w):
        return fsdp_matmul(x, w), (x, w)  # the shard, not the gathered weight, is kept

    def backward(kept, g):
        x, w = kept
        g, w = lax.optimization_barrier((g, w))
        return jax.vjp(lambda x, w: gathered(w, x), x, w)[1](g)  # (its forward: unused)

    fsdp_matmul.defvjp(forward, backward)
    return fsdp_matmul


def enter_tensor(x, layout: "Layout"):
    """f: the activation entering a column-parallel linear: identity, or with sequence
    parallelism the all-gather of the token blocks [b, s/t, h] -> [b, s, h] (see the
    module docstring)."""
    if not layout.split_sequence:
        return x
    return _tokens(lax.all_gather(_flat(x), layout.tensor_axis, axis=0, tiled=True), x, 1)


def exit_tensor(x, layout: "Layout"):
    """g: a row-parallel linear's partial sums [b, s, h] -> their sum over tensor ranks
    [b, s, h], or with sequence parallelism its reduce-scatter into token blocks
    [b, s/t, h]."""
    if not layout.split_sequence:
        return psum(x, layout.tensor_axis)
    part = lax.psum_scatter(_flat(x), layout.tensor_axis, scatter_dimension=0, tiled=True)
    return _tokens(part, x, layout.tensor)


def token_block(x, layout: "Layout"):
    """This tensor rank's token block [b, s/t, ...] of a value [b, s, ...] that is the
    same on every rank (all of it without sequence parallelism)."""
    if not layout.split_sequence:
        return x
    part = x.shape[0] * x.shape[1] // layout.tensor
    block = lax.dynamic_slice_in_dim(_flat(x), lax.axis_index(layout.tensor_axis) * part,
                                     part, 0)
    return _tokens(block, x, layout.tensor)


def token_positions(batch: int, seq: int, layout: "Layout"):
    """The position in its row of every token this rank holds: [b, s/t] int32 (without
    sequence parallelism [b, s], each row 0..s-1)."""
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return token_block(positions, layout)


def _flat(x):
    """[b, n, ...] -> [b n, ...]: tokens in row order."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _tokens(flat, like, split: int):
    """[b n / split * ..., ...] back to [b, n / split * ..., ...] of `like`'s rows."""
    return flat.reshape(like.shape[0], like.shape[1] * flat.shape[0] // (
        like.shape[0] * like.shape[1]), *flat.shape[1:])


def softmax_reference(scores, scale: float, causal: bool = True, mask=None, dtype=None):
    """softmax(scale * scores) over the last axis in float32 (-> dtype, default float32),
    keys masked out where the bottom-right aligned causal mask or `mask` (True = masked,
    broadcastable) says; its backward keeps only its output (fused.softmax).
    scores: [b, n, sq, sk]."""
    sq, sk = scores.shape[-2:]
    keep = jnp.ones((), bool)
    if causal:
        keep = jnp.tril(jnp.ones((sq, sk), dtype=bool), k=sk - sq)
    if mask is not None:
        keep = keep & ~mask
    return fused.softmax(scores, scale, keep, dtype or jnp.float32)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis with replicated float32 scale and bias: math in float32
    on x as given, output in the compute dtype; its backward keeps x and the row
    statistics only (fused.layer_norm)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        scale = self.param("scale", ones, (x.shape[-1],), jnp.float32)
        bias = self.param("bias", zeros(("norm",)), (x.shape[-1],), jnp.float32)
        return fused.layer_norm(x, scale, bias, self.cfg.layernorm_eps, jnp.dtype(self.cfg.dtype))


class RMSNorm(nn.Module):
    """RMSNorm (Llama) with a replicated float32 scale, as LayerNorm (fused.rms_norm)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        scale = self.param("scale", ones, (x.shape[-1],), jnp.float32)
        return fused.rms_norm(x, scale, self.cfg.layernorm_eps, jnp.dtype(self.cfg.dtype))


def layer_norm(cfg: ModelConfig, name: str | None = None) -> LayerNorm:
    return LayerNorm(cfg, name=name)


def rms_norm(cfg: ModelConfig, name: str | None = None) -> RMSNorm:
    return RMSNorm(cfg, name=name)


def attend(module: nn.Module, q, k, v, deterministic: bool, *, causal: bool, mask=None,
           cache=None):
    """Attention of q [b, s, n/t, d] over k, v [b, s, nk/t, d] (nk <= n: grouped-query) ->
    (context [b, s, n/t, d], cache).

    Picks cuDNN flash attention when asked and possible, else `attention_core` with its
    dropout key and selective recomputation. mask: True = masked, broadcastable to
    [b, n/t, s, sk] (BERT's padding). cache: (k_cache, v_cache [b, S, nk/t, d], start) of
    decoding: k, v are written at positions start.. and the queries (at those positions)
    attend to every cached key up to their own; the updated (k_cache, v_cache) is returned
    (None without a cache).
    """
    cfg, layout = module.cfg, module.layout
    scale = 1.0 / math.sqrt(q.shape[-1])
    if cache is not None:
        k_cache, v_cache, start = cache
        k = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
        v = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
        cache = (k, v)
        positions = start + jnp.arange(q.shape[1])
        mask, causal = jnp.arange(k.shape[1])[None, :] > positions[:, None], False
    padding = mask is not None and mask.ndim == 4 and mask.shape[1:3] == (1, 1)
    if (cfg.attention == "cudnn" and layout.platform == "gpu" and cache is None
            and (mask is None or padding)):
        # cuDNN flash attention: no [s, s] scores in memory (config refuses dropout); it
        # takes grouped-query key/value heads as they are, and a key padding mask as each
        # row's key count (BERT's rows end with their padding: bert.make_batch)
        lengths = None if mask is None else jnp.sum(~mask[:, 0, 0, :], axis=-1, dtype=jnp.int32)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            key_value_seq_lengths=lengths,
                                            implementation="cudnn"), cache
    key = None
    if cfg.dropout and not deterministic:
        # Each tensor rank holds different heads: its dropout mask must differ.
        rank = 0 if layout.tensor_axis is None else lax.axis_index(layout.tensor_axis)
        key = jax.random.fold_in(module.make_rng("dropout"), rank)
    core = functools.partial(attention_core, cfg=cfg, layout=layout, scale=scale,
                             causal=causal)
    if cfg.remat == "selective":  # keep q, k, v; recompute the [s, s] part
        core = jax.checkpoint(core)
    return core(q, k, v, key, mask=mask), cache


class Attention(nn.Module):
    """Self-attention (causal, or bidirectional for BERT): QKV column-parallel by heads,
    output projection row-parallel."""

    cfg: ModelConfig
    layout: Layout
    causal: bool = True

    @nn.compact
    def __call__(self, x, deterministic: bool, mask=None, cache=None):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        heads = cfg.num_heads // layout.tensor
        w_qkv = weight(self, "w_qkv", normal(cfg.init_std, ("embed", "qkv", "heads", "kv")),
                       (cfg.hidden_size, 3, heads, cfg.head_dim))
        b_qkv = self.param("b_qkv", zeros(("qkv", "heads", "kv")), (3, heads, cfg.head_dim))
        w_out = weight(self, "w_out", normal(residual_std(cfg), ("heads", "kv", "embed")),
                       (heads, cfg.head_dim, cfg.hidden_size))
        b_out = self.param("b_out", zeros(("embed",)), (cfg.hidden_size,))

        qkv = dense(self, "w_qkv", enter_tensor(x, layout), w_qkv) + b_qkv.astype(dt)
        q, k, v = (qkv[:, :, i] for i in range(3))  # each [b, s, heads/t, d]
        context, cache = attend(self, q, k, v, deterministic, causal=self.causal, mask=mask,
                                cache=cache)
        out = dense(self, "w_out", context, w_out)  # partial sum over this rank's heads
        return exit_tensor(out, layout) + b_out.astype(dt), cache  # g: all-reduce #1


def residual_std(cfg: ModelConfig) -> float:
    """Megatron's init of the layers writing into the residual stream: std / sqrt(2 L)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def attention_core(q, k, v, key, *, cfg: ModelConfig, layout: Layout, scale: float,
                   causal: bool = True, mask=None):
    """softmax(scale q k^T) v with the causal mask and/or `mask` (True = masked, broadcastable
    to [b, heads/t, sq, sk]) and, when `key` is given, dropout on the probabilities.
    q: [b, sq, heads/t, d]; k, v: [b, sk, kv_heads/t, d], each key/value head shared by
    heads / kv_heads consecutive query heads (grouped-query attention) -> [b, sq, heads/t, d].

    Megatron's selective recomputation (Korthikanti et al. 2022) recomputes exactly this:
    its [b, heads/t, s, s] tensors are most of a layer's activations at long sequences and
    only 4 b s^2 h of its FLOPs.
    """
    b, sq, heads, d = q.shape
    kv_heads, sk = k.shape[2], k.shape[1]
    grouped = q.reshape(b, sq, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k)  # [b, kv, heads / kv, sq, sk]
    if cfg.kernels == "pallas":
        from pallas_kernels import fused_softmax

        probs = fused_softmax(scores.reshape(b, heads, sq, sk), scale=scale, causal=causal,
                              mask=mask, interpret=layout.platform != "gpu").reshape(
                                  scores.shape).astype(cfg.dtype)
    else:  # in the grouped shape: the softmax's output is the very array the matmul keeps
        grouped_mask = None if mask is None or mask.ndim < 4 else mask[:, :, None]
        probs = softmax_reference(scores, scale, causal,
                                  mask if grouped_mask is None else grouped_mask, cfg.dtype)
    if key is not None:
        probs = _dropout(probs, cfg.dropout, key)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, sq, heads, d)


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); ffn = 4h unless set."""

    cfg: ModelConfig
    layout: Layout

    @nn.compact
    def __call__(self, x):  # x: [b, s, h]
        cfg, dt, layout = self.cfg, self.cfg.dtype, self.layout
        ffn = cfg.ffn // layout.tensor
        w_fc1 = weight(self, "w_fc1", normal(cfg.init_std, ("embed", "mlp")),
                       (cfg.hidden_size, ffn))
        b_fc1 = self.param("b_fc1", zeros(("mlp",)), (ffn,))
        w_fc2 = weight(self, "w_fc2", normal(residual_std(cfg), ("mlp", "embed")),
                       (ffn, cfg.hidden_size))
        b_fc2 = self.param("b_fc2", zeros(("embed",)), (cfg.hidden_size,))

        hidden = dense(self, "w_fc1", enter_tensor(x, layout), w_fc1)  # [b, s, ffn/t]
        if cfg.kernels == "pallas" and cfg.gelu == "tanh":  # the kernel's GeLU is tanh's
            from pallas_kernels import bias_gelu

            hidden = bias_gelu(hidden, b_fc1.astype(dt), interpret=layout.platform != "gpu")
        else:
            hidden = fused.bias_gelu(hidden, b_fc1, exact=cfg.gelu == "erf")
        out = dense(self, "w_fc2", hidden, w_fc2)  # partial sum over this rank's ffn/t
        return exit_tensor(out, layout) + b_fc2.astype(dt)  # g: all-reduce #2


class Block(nn.Module):
    """Pre-norm transformer layer: x + drop(attn(norm1 x)); x + drop(mlp(norm2 x)).

    With model.norm_position=post (BERT) each residual starts from the normed value
    instead, y = norm1 x; y + drop(attn(y)), as Megatron's
    apply_residual_connection_post_layernorm: the original BERT's post-LayerNorm
    (LN(x + drop(attn(x)))) with each layer's output norm moved into the next layer's
    input (the first layer's norm is BERT's embedding LayerNorm, the final norm the last
    layer's output norm), so every layer keeps the same parameters and stages split alike.

    The pieces are attributes, so every architecture's layer is this one: GPT's (LayerNorm,
    Attention, MLP), Llama's (RMSNorm, grouped-query attention with rotary positions,
    SwiGLU), BERT's (GPT's, bidirectional with a padding mask). Called with a KV cache it
    returns (x, cache), else x.
    """

    cfg: ModelConfig
    layout: Layout
    attention: type = Attention
    mlp: type = MLP
    norm: Callable = layer_norm
    causal: bool = True

    @nn.compact
    def __call__(self, x, deterministic: bool = True, mask=None, cache=None):
        cfg, layout = self.cfg, self.layout
        post = cfg.norm_position == "post"
        y = self.norm(cfg, "ln1")(x)
        h, new_cache = self.attention(cfg, layout, self.causal, name="attn")(
            y, deterministic, mask, cache)
        x = checkpoint_name((y if post else x) + self._dropout(h, deterministic), RESIDUAL)
        y = self.norm(cfg, "ln2")(x)
        h = self.mlp(cfg, layout, name="mlp")(y)
        x = (y if post else x) + self._dropout(h, deterministic)
        return x if cache is None else (x, new_cache)

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
    """Vocab-parallel token embedding plus `positions` learned positions (0: none, as with
    rotary embeddings); its table is the tied head of GPT and BERT."""

    cfg: ModelConfig
    layout: Layout
    positions: int = 0

    def setup(self):
        cfg = self.cfg
        self.vocab = self.layout.vocab // self.layout.tensor  # local rows
        self.wte = self.param("wte", normal(cfg.init_std, ("vocab", "embed")),
                              (self.vocab, cfg.hidden_size))
        if self.positions:
            self.wpe = self.param("wpe", normal(cfg.init_std, ("positions", "embed")),
                                  (self.positions, cfg.hidden_size))

    def __call__(self, tokens, start=0):
        # tokens: [b, s] int32 at positions start.. -> [b, s, h] ([b, s/t, h] with SP).
        # Megatron's lookup: ids outside this rank's rows give zeros; the all-reduce (with
        # SP the reduce-scatter) sums the one rank that holds each id.
        local = tokens - vocab_start(self.layout)
        inside = (local >= 0) & (local < self.vocab)
        rows = jnp.take(self.wte, jnp.clip(local, 0, self.vocab - 1), axis=0)
        x = exit_tensor(jnp.where(inside[..., None], rows, 0.0), self.layout)
        if self.positions:
            where = start + token_positions(*tokens.shape, self.layout)  # [b, s(/t)]
            x = x + jnp.take(self.wpe, where, axis=0)
        return x.astype(self.cfg.dtype)

    def logits(self, x):  # x: [b, s, h] -> [b, s, vocab/t] float32, never gathered
        return jnp.einsum("bsh,vh->bsv", x, self.wte.astype(self.cfg.dtype)).astype(jnp.float32)


def embedding_dropout(x, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """Dropout on the embedding output (GPT-2's and Megatron's), one mask for all tensor
    ranks (the embedding is the same on each; with sequence parallelism each holds other
    tokens: a mask per rank). `key` is the first stage's layer key; the layers fold in
    their indices, this folds in one no stack reaches."""
    if not cfg.dropout or deterministic:
        return x
    key = jax.random.fold_in(key, EMBED_STREAM)
    if layout.split_sequence:
        key = jax.random.fold_in(key, lax.axis_index(layout.tensor_axis))
    return _dropout(x, cfg.dropout, key)


EMBED_STREAM = 2**31 - 1


def vocab_start(layout: Layout):
    """First vocabulary id of this tensor rank's [V/t] logits."""
    local = layout.vocab // layout.tensor
    return 0 if layout.tensor_axis is None else lax.axis_index(layout.tensor_axis) * local


def vocab_parallel_xent(logits, targets, cfg: ModelConfig, layout: Layout,
                        classes: int | None = None):
    """Cross-entropy of vocab-parallel logits [b, s, V/t] float32 at targets [b, s] -> [b, s].

    The logits stay on their tensor rank: only [b, s] maxima, sums of exponentials and
    target logits cross the tensor axis. Padded vocabulary rows, and any id from `classes`
    on (default: model.vocab_size), never take probability.
    """
    ids = vocab_start(layout) + jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < (classes or cfg.vocab_size), logits, -jnp.inf)
    # The max only stabilises the exponentials; its gradient cancels, so it is stopped.
    row_max = lax.stop_gradient(jnp.max(logits, axis=-1))  # [b, s]
    if layout.tensor_axis is not None:
        row_max = lax.pmax(row_max, layout.tensor_axis)
    sum_exp = psum(jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1), layout.tensor_axis)
    target_logit = psum(
        jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1), layout.tensor_axis)
    return jnp.log(sum_exp) + row_max - target_logit
