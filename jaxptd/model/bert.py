"""BERT (Megatron-LM 2019, §5): a bidirectional encoder with a padding mask, the masked-LM
loss and sentence-order prediction (SOP), and the rearranged (pre-)LayerNorm of that paper's
Figure 7, which BERT needs to scale: every layer is layers.Block (LayerNorm at each
sublayer's input), with a final LayerNorm before the heads. model.norm_position=post gives
the original BERT's post-LayerNorm instead (layers.Block says how, with the same
parameters), and model.gelu=erf its exact GeLU: with both, transformers' BertForPreTraining
(jaxptd/hf/bridge.py imports and exports it; the pre-LN model is its MegatronBertForPreTraining).
`ARCH`: its functions as the architecture interface (jaxptd/arch/interface.py); its
config rules and Hugging Face names are jaxptd/arch/bert.py's.

Batch rows (`make_batch`, numpy on the host, a pure function of (seed, step, row)): from
each data row's first s - 3 tokens, [CLS] A [SEP] B [SEP] [PAD]...: a short sample (10%:
a content length drawn in [2, s - 3], the rest padding), cut at a random point into A and
B, whose order is swapped half the time (the SOP label). Then 15% of the content tokens
(at least one) are predicted: 80% of them become [MASK], 10% a random token, 10% stay. A
row holds [ids (s), token types (s), MLM labels (s; -1: not predicted), SOP label (1)].
The four special ids ([PAD], [CLS], [SEP], [MASK]) are the top of model.vocab_size, kept
from the data and never predicted, unless model.special_ids places them in the vocabulary
(an imported BERT's tokenizer: bert-base's 0, 101, 102, 103); a random replacement is
never a special id.

Loss: each row contributes seq_len x (its mean masked-LM loss + its SOP loss), so the
step's division by (global batch x seq_len) gives the mean over rows of the two, as
Megatron adds lm_loss and sop_loss.

Parameter tree: embed/{wte [V, h], wpe [s, h]}, layers (GPT's layer), final_norm,
heads/{wtt [2, h] (token types), w_mlm [h, h], b_mlm, mlm_norm, b_vocab [V] (the tied
output layer's bias, vocab-parallel), w_pool [h, h], b_pool, w_sop [h, 2], b_sop}.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxptd.arch.interface import Architecture
from jaxptd.config import ModelConfig
from jaxptd.model import fused, sequence, stack
from jaxptd.model.layers import Block, layer_norm
from jaxptd.model.sequence import Rows
from jaxptd.model.tensor import Layout, dense, enter_tensor, normal, token_block, zeros
from jaxptd.model.vocab import Embed, embedding_dropout, vocab_parallel_xent
from jaxptd.parallel.varying import gather_invariant

SPECIALS = 4  # [PAD], [CLS], [SEP], [MASK] at vocab_size - 4 ..
MASK_RATE, SHORT_RATE = 0.15, 0.1


def reserved_ids(cfg: ModelConfig) -> int:
    """The top 4 ids, unless model.special_ids places the specials in the vocabulary."""
    return 0 if cfg.special_ids else SPECIALS


def batch_width(cfg: ModelConfig) -> int:
    return 3 * cfg.seq_len + 1


def _specials(cfg: ModelConfig):
    return cfg.bert_specials  # pad, cls, sep, mask


def _ordinary(drawn, cfg: ModelConfig):
    """Draws in [0, vocab_size - 4) -> the ids that are not special, in order (with the
    specials at the top, the draws themselves)."""
    shifted = np.sort(_specials(cfg)) - np.arange(SPECIALS)  # the k-th special, less k
    return drawn + np.searchsorted(shifted, drawn, side="right")


def make_batch(tokens, seed: int, step: int, first_row: int, cfg: ModelConfig):
    """Token rows [n, s + 1] -> BERT rows [n, 3 s + 1] int32 (module docstring)."""
    return np.stack([_row(row, np.random.default_rng([seed, step, first_row + i, 0xBE27]),
                          cfg) for i, row in enumerate(tokens)])


def _row(tokens, rng, cfg: ModelConfig):
    s = cfg.seq_len
    pad, cls, sep, mask = _specials(cfg)
    n = int(rng.integers(2, s - 2)) if rng.random() < SHORT_RATE else s - 3
    cut = int(rng.integers(1, n))
    a, b = tokens[:cut], tokens[cut:n]
    swapped = rng.random() < 0.5
    if swapped:
        a, b = b, a
    ids = np.full(s, pad, np.int32)
    ids[: n + 3] = np.concatenate([[cls], a, [sep], b, [sep]])
    types = np.zeros(s, np.int32)
    types[len(a) + 2: n + 3] = 1
    content = np.concatenate([np.arange(1, len(a) + 1), np.arange(len(a) + 2, n + 2)])
    chosen = rng.choice(content, max(1, round(MASK_RATE * n)), replace=False)
    labels = np.full(s, -1, np.int32)
    labels[chosen] = ids[chosen]
    action = rng.random(len(chosen))
    ids[chosen[action < 0.8]] = mask
    swap = chosen[(action >= 0.8) & (action < 0.9)]
    ids[swap] = _ordinary(rng.integers(0, cfg.vocab_size - SPECIALS, len(swap)), cfg)
    return np.concatenate([ids, types, labels, [int(swapped)]]).astype(np.int32)


def _columns(batch, cfg: ModelConfig):
    """A row's pieces: ids, types, labels [b, s], sop [b]."""
    s = cfg.seq_len
    return batch[:, :s], batch[:, s:2 * s], batch[:, 2 * s:3 * s], batch[:, 3 * s]


class Heads(nn.Module):
    """The token-type embedding and both heads (replicated but for the vocabulary bias)."""

    cfg: ModelConfig
    layout: Layout

    def setup(self):
        cfg, h = self.cfg, self.cfg.hidden_size
        self.wtt = self.param("wtt", normal(cfg.init_std, ("types", "embed")), (2, h))
        self.w_mlm = self.param("w_mlm", normal(cfg.init_std, ("embed", "embed_out")), (h, h))
        self.b_mlm = self.param("b_mlm", zeros(("embed_out",)), (h,))
        self.mlm_norm = layer_norm(cfg, layout=self.layout)
        self.b_vocab = self.param("b_vocab", zeros(("vocab",)),
                                  (self.layout.vocab // self.layout.tensor,))
        self.w_pool = self.param("w_pool", normal(cfg.init_std, ("embed", "embed_out")), (h, h))
        self.b_pool = self.param("b_pool", zeros(("embed_out",)), (h,))
        self.w_sop = self.param("w_sop", normal(cfg.init_std, ("embed", "types")), (h, 2))
        self.b_sop = self.param("b_sop", zeros(("types",)), (2,))

    def __call__(self, x):  # init only: touches every parameter
        return self.types(jnp.zeros(x.shape[:2], jnp.int32)), self.mlm(x), self.sop(x)

    def types(self, types):  # [b, s] -> [b, s, h]
        return jnp.take(self.wtt, types, axis=0).astype(self.cfg.dtype)

    def mlm(self, x):  # [b, s, h] -> the transform before the tied output layer [b, s, h]
        y = fused.bias_gelu(dense(self, "w_mlm", x, self.w_mlm), self.b_mlm,
                            exact=self.cfg.gelu == "erf")
        return self.mlm_norm(y)

    def sop(self, x):  # [b, s, h] -> SOP logits [b, 2] float32 from the [CLS] position
        pooled = jnp.tanh(dense(self, "w_pool", x[:, 0], self.w_pool) + self.b_pool.astype(x.dtype))
        return (dense(self, "w_sop", pooled, self.w_sop) + self.b_sop).astype(jnp.float32)


def block(cfg: ModelConfig, layout: Layout) -> Block:
    return Block(cfg, layout, causal=False)


def _embed(cfg: ModelConfig, layout: Layout) -> Embed:
    return Embed(cfg, layout, cfg.seq_len)


def _boxed_init(cfg: ModelConfig, vocab: int, key):
    return stack.boxed_init(cfg, vocab, key, block,
                            {"embed": (_embed, True), "heads": (Heads, False)},
                            {"final_norm": layer_norm(cfg)})


def init_params(cfg: ModelConfig, vocab: int, key):
    return nn.unbox(_boxed_init(cfg, vocab, key))


def logical_axes(cfg: ModelConfig, vocab: int, tensor: int = 1):
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(cfg, vocab, jax.random.key(0))))


def embed(ends, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool):
    """BERT rows [b, 3 s + 1] -> token + position + type embeddings [b, s, h], dropout."""
    ids, types, _, _ = _columns(batch, cfg)
    rows = attention_mask(batch, cfg, layout)  # context parallelism: this rank's tokens
    positions = sequence.local_positions(rows, layout) if isinstance(rows, Rows) else None
    x = _embed(cfg, layout).apply({"params": ends["embed"]}, sequence.split(ids, layout), 0,
                                  positions)
    types = Heads(cfg, layout).apply({"params": ends["heads"]}, sequence.split(types, layout),
                                     method=Heads.types)
    x = x + token_block(types, layout)  # [b, s/t, h] with sequence parallelism
    return embedding_dropout(sequence.vary(x, layout), key, cfg, layout, deterministic)


def attention_mask(batch, cfg: ModelConfig, layout: Layout):
    """Keys at [PAD] positions are masked out of every attention: [b, 1, 1, s], True =
    masked, or with context parallelism the rows' sequence.Rows with that padding
    (jaxptd.model.apply_layers gives it to every layer)."""
    ids = _columns(batch, cfg)[0]
    padding = ids == _specials(cfg)[0]
    rows = sequence.rows_of(ids, cfg, layout, padding)
    return padding[:, None, None, :] if rows is None else rows


def output_logits(ends, x, cfg: ModelConfig, layout: Layout):
    """The final LayerNorm and both heads: x [b, s, h] from the last layer ([b, s/t, h]
    with sequence parallelism) -> (masked-LM logits [b, s, V/t], SOP logits [b, 2]),
    float32."""
    heads = Heads(cfg, layout)
    x = layer_norm(cfg, layout=layout).apply({"params": ends["final_norm"]}, x)
    # SP: the whole sequence, gathered for the vocab-parallel MLM head (a reduce-scatter
    # backward) and, typed the same on every rank, for the replicated SOP head
    pooled = x if not layout.split_sequence else gather_invariant(
        x.reshape(-1, x.shape[-1]), layout.tensor_axis, 0, layout.tensor).reshape(
            x.shape[0], -1, x.shape[-1])  # the token blocks in row order: [b, s, h]
    x = enter_tensor(x, layout)
    y = heads.apply({"params": ends["heads"]}, x, method=Heads.mlm)
    logits = _embed(cfg, layout).apply({"params": ends["embed"]}, y, method=Embed.logits)
    logits = logits + ends["heads"]["b_vocab"]  # [b, s, V/t]
    return logits, heads.apply({"params": ends["heads"]}, pooled, method=Heads.sop)


def head_loss(ends, x, batch, cfg: ModelConfig, layout: Layout):
    """seq_len x (mean masked-LM loss + SOP loss), summed over the rows (module docstring)."""
    _, _, labels, sop = _columns(batch, cfg)
    labels = sequence.split(labels, layout)  # context parallelism: this rank's tokens
    logits, sop_logits = output_logits(ends, x, cfg, layout)
    # the specials at the top of the vocabulary are never predicted
    token_loss = vocab_parallel_xent(logits, jnp.maximum(labels, 0), cfg, layout,
                                     classes=cfg.vocab_size - reserved_ids(cfg))
    predicted = labels >= 0
    count = jnp.sum(predicted, -1)
    sop_loss = jax.nn.logsumexp(sop_logits, -1) - jnp.take_along_axis(
        sop_logits, sop[:, None], -1)[:, 0]
    if layout.context > 1 and layout.context_axis is not None:
        # each context rank sums its tokens' losses over the row's count; the [CLS] token,
        # pooled for SOP, is rank 0's first (the step sums the ranks' losses)
        count = lax.psum(count, layout.context_axis)
        sop_loss = jnp.where(lax.axis_index(layout.context_axis) == 0, sop_loss, 0.0)
    mlm = jnp.sum(jnp.where(predicted, token_loss, 0.0), -1) / jnp.maximum(count, 1)
    return cfg.seq_len * jnp.sum(mlm + sop_loss)


def forward_flops(cfg: ModelConfig, vocab: int) -> dict:
    """Per token: GPT's layer (and its core and q, k, v projection); the head's transform
    2 h^2 and tied logits 2 h V, and per sequence the pooler 2 h^2 and SOP 4 h."""
    h, s = cfg.hidden_size, cfg.seq_len
    return {"layer": 8 * h * h + 4 * h * cfg.ffn + 4 * s * h, "core": 4 * s * h,
            "qkv": 6 * h * h,
            "head": 2 * h * vocab + 2 * h * h + (2 * h * h + 4 * h) / s}


ARCH = Architecture(init_params=init_params, logical_axes=logical_axes, embed=embed,
                    block=block, head_loss=head_loss, forward_flops=forward_flops,
                    batch_width=batch_width, make_batch=make_batch,
                    reserved_ids=reserved_ids, attention_mask=attention_mask)
