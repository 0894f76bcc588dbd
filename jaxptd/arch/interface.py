"""The architecture interface as types: what a model family declares (`Family`, JAX-free:
config validation, the planner and the Hugging Face bridge read it before JAX may start,
the facts of its model they need included: a gated MLP, encoder or decoder, experts) and
the model it loads (`Architecture`: the functions over a parameter tree,
jaxptd/model/<family>.py's record, whose import starts JAX).

A parameter tree is {'layers': [L, ...] stacked layer leaves (with model.moe_every = k
> 1, [L/k, ...] units of k layers: model/stack.py's Unit), plus the "ends" (every other
top-level key: embedding, final norm, output layer)}. A batch row is what the data gives
(token rows [s + 1]) turned into the architecture's row by `make_batch`; every stage gets
the microbatch's rows. The loss convention: the step divides the sum of `head_loss` over
the global batch by (global batch x seq_len), so a decoder returns the sum of its token
losses and BERT seq_len x each row's loss. `Layout` (model/tensor.py) says whether the
functions see global parameters or one tensor rank's shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from jaxptd.hf.names import HFMap

if TYPE_CHECKING:  # (config/rules.py imports the registry)
    from jaxptd.config.schema import ModelConfig


def token_width(cfg: ModelConfig) -> int:
    """A decoder's batch row: s + 1 tokens (inputs the first s, targets the last s)."""
    return cfg.seq_len + 1


def token_rows(tokens, seed: int, step: int, first_row: int, cfg: ModelConfig):
    """A decoder's rows are the data's token rows."""
    return tokens


def no_reserved_ids(cfg: ModelConfig) -> int:
    return 0


def no_mask(batch, cfg: ModelConfig, layout):
    """Attention masks nothing beyond causality."""
    return None


def no_rules(m: ModelConfig) -> Iterator[str]:
    """A family with the common rules only."""
    return iter(())


# a decoder's option: packed rows (model/sequence.py)
PACKED_ROWS = {"document_end": "model.document_end={value}: packed rows are for the "
               "decoders (gpt, llama); set -1"}


def unlimited(cfg: ModelConfig) -> None:
    """A decoder without learned positions reads any length."""
    return None


@dataclass(frozen=True)
class Decoder:
    """What generation needs of a decoder (jaxptd/generate.py)."""
    logits: Callable  # (ends, x [b, s, h], cfg, layout) -> [b, s, V/t] float32
    decode: Callable  # (params, tokens [b, q], cache, start, cfg, layout) -> (logits, cache)
    init_cache: Callable  # (cfg, layout, batch, length) -> this rank's zero keys, values
    max_length: Callable = unlimited  # (cfg) -> the longest sequence it reads, or None


@dataclass(frozen=True)
class Architecture:
    """A family's model: pure functions over a parameter tree (module docstring)."""
    init_params: Callable  # (cfg, vocab, key) -> global float32 params at padded `vocab`
    logical_axes: Callable  # (cfg, vocab, tensor) -> their logical names (PartitionSpecs)
    embed: Callable  # (ends, batch [b, W], key, cfg, layout, deterministic) -> x [b, s, h]
    # (cfg, layout) -> one layer, a Flax module called (x, deterministic, mask, cache)
    block: Callable
    head_loss: Callable  # (ends, x, batch, cfg, layout) -> the batch's loss sum
    forward_flops: Callable  # (cfg, vocab) -> matmul FLOPs per token {layer, core, qkv, head}
    decoder: Decoder | None = None  # None: an encoder (Family.encoder), nothing to generate
    batch_width: Callable = token_width  # (cfg) -> columns of a batch row
    # (tokens [n, s + 1], seed, step, first_row, cfg) -> rows [n, batch_width] int32, a
    # pure function of its arguments (numpy, on the host)
    make_batch: Callable = token_rows
    reserved_ids: Callable = no_reserved_ids  # (cfg) -> ids at the top of vocab_size kept
    # (batch, cfg, layout) -> what every layer's attention gets beyond x: None, a padding
    # mask [b, 1, 1, s] (True = masked) or model/sequence.py's Rows (context parallelism,
    # packed rows)
    attention_mask: Callable = no_mask


@dataclass(frozen=True)
class Family:
    """A model family as config validation, the planner and the Hugging Face bridge see
    it."""
    name: str  # model.arch
    load: Callable[[], Architecture]  # its model (imports jaxptd/model/<name>.py: JAX)
    hf: HFMap
    # what the JAX-free side needs of the model (the planner's memory and time, the rules):
    gated_mlp: bool = False  # two first MLP matmuls (SwiGLU's gate and up)
    encoder: bool = False  # attends both ways over padded rows (BERT), else a causal decoder
    experts: bool = False  # may be a mixture of experts (model.moe_experts > 0)
    # its own rules on the model section: one-line messages naming key, value and rule
    config_errors: Callable[[ModelConfig], Iterator[str]] = no_rules
    # model keys only this family reads: {key: the message when another family's config
    # sets it off its default ({value}: the value)}
    options: dict[str, str] = field(default_factory=dict)

