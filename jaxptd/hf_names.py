"""What maps between a transformers checkpoint and jaxptd, as data (no I/O; jaxptd/hf.py
and hf_files.py read and write the files).

Owns, for each supported transformers class (GPT2LMHeadModel, LlamaForCausalLM,
BertForPreTraining and BertForMaskedLM, their MegatronBert forms):

- the config translation both ways (`ARCHITECTURES`: config.json -> jaxptd's model
  section, with a one-line `HFError` for what jaxptd cannot represent, and what else
  import needs to know of the class; `export_config`: the way back). transformers' BERT
  is post-LayerNorm with the exact GeLU, its MegatronBert pre-LayerNorm (jaxptd's BERT):
  both map exactly, through model.norm_position and model.gelu; a BERT's [PAD] [CLS]
  [SEP] [MASK] ids become model.special_ids unless they are the top 4 of the vocabulary;
- the tensor names (`names(m)`): a list of (HF name, jaxptd path, to jaxptd, to HF). An
  ends leaf has one HF name; a layer leaf (its path starts with 'layers') a tuple of
  num_layers names, one per layer, stacked on a leading [L] axis. A path ending in an int
  is one part of a leaf that transformers keeps as several tensors (k_proj and v_proj ->
  Llama's w_kv; BERT's query, key, value -> w_qkv), stacked on the leaf's axis
  `PARTS[name]` (of one layer's value);
- what a checkpoint may hold beside them (`extras(m)`): a tied copy (the name it must
  equal) or a buffer that is not a weight (None);
- `canonical`: the spellings transformers itself accepts on load, brought to one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from jaxptd.config import ModelConfig


class HFError(ValueError):
    """A user-caused problem with a Hugging Face directory or a checkpoint; one line."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise HFError(message)


# --------------------------------------------------------------------------- configs

GELUS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> model.gelu


def _gelu(hf: dict, key: str, default: str) -> str:
    act = hf.get(key, default)
    require(act in GELUS, f"{key}={act!r}: jaxptd's GeLU is gelu (exact) or gelu_new "
            "(tanh)")
    return GELUS[act]


def _gpt2_config(hf: dict) -> dict:
    gelu = _gelu(hf, "activation_function", "gelu_new")
    require(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights",
                                                                     True),
            "attention scaling other than 1/sqrt(head_dim) is not supported")
    return {"arch": "gpt", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "seq_len": hf["n_positions"],
            "vocab_size": hf["vocab_size"], "ffn_size": hf.get("n_inner") or 0,
            "layernorm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "dropout": hf.get("resid_pdrop", 0.1), "init_std": hf.get("initializer_range", 0.02),
            "gelu": gelu}


def _llama_config(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    require(rope.get("rope_type", rope.get("type", "default")) == "default",
            f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    require(hf.get("hidden_act", "silu") == "silu", "hidden_act must be silu")
    require(not hf.get("attention_bias") and not hf.get("mlp_bias"),
            "attention or MLP biases are not supported")
    heads = hf["num_attention_heads"]
    require(hf.get("head_dim") in (None, hf["hidden_size"] // heads),
            f"head_dim={hf.get('head_dim')} must be hidden_size / num_attention_heads")
    return {"arch": "llama", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "seq_len": min(hf.get("max_position_embeddings", 2048), 2048),
            "vocab_size": hf["vocab_size"], "ffn_size": hf["intermediate_size"],
            "layernorm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "dropout": hf.get("attention_dropout", 0.0),
            "init_std": hf.get("initializer_range", 0.02)}


BERT_TOKENS = {"pad_token_id": "[PAD]", "cls_token_id": "[CLS]", "sep_token_id": "[SEP]",
               "mask_token_id": "[MASK]"}  # model.special_ids' order


def _bert_config(hf: dict, norm_position: str) -> dict:
    """BertFor* (post-LayerNorm) or MegatronBertFor* (pre-LayerNorm). The special ids
    config.json lacks come from the tokenizer files (hf_files.read_hf)."""
    require(hf.get("type_vocab_size", 2) == 2, f"type_vocab_size={hf.get('type_vocab_size')}:"
            " jaxptd's BERT has 2 token types (sentences A and B)")
    require(hf.get("position_embedding_type", "absolute") == "absolute",
            f"position_embedding_type={hf.get('position_embedding_type')!r}: jaxptd's BERT "
            "has absolute (learned) positions")
    require(not hf.get("is_decoder") and not hf.get("add_cross_attention"),
            "a BERT decoder (is_decoder, add_cross_attention) is not supported")
    ids = [hf.get(key) for key in BERT_TOKENS]
    unknown = [token for token, i in zip(BERT_TOKENS.values(), ids) if i is None]
    require(not unknown, f"no id for {' '.join(unknown)} in config.json or a tokenizer file "
            "(tokenizer.json, vocab.txt): put the model's tokenizer files beside config.json")
    vocab = hf["vocab_size"]
    return {"arch": "bert", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": hf["num_attention_heads"],
            "seq_len": hf["max_position_embeddings"], "vocab_size": vocab,
            "ffn_size": hf["intermediate_size"], "layernorm_eps": hf.get("layer_norm_eps", 1e-12),
            "dropout": hf.get("hidden_dropout_prob", 0.1),
            "init_std": hf.get("initializer_range", 0.02), "gelu": _gelu(hf, "hidden_act", "gelu"),
            "norm_position": norm_position,
            "special_ids": "" if ids == list(range(vocab - 4, vocab)) else ",".join(map(str, ids))}


def _bert_export(m: ModelConfig) -> dict:
    pre = m.norm_position == "pre"
    return {"architectures": ["MegatronBertForPreTraining" if pre else "BertForPreTraining"],
            "model_type": "megatron-bert" if pre else "bert",
            "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_heads, "intermediate_size": m.ffn,
            "max_position_embeddings": m.seq_len, "vocab_size": m.vocab_size,
            "type_vocab_size": 2, "layer_norm_eps": m.layernorm_eps,
            "hidden_act": "gelu_new" if m.gelu == "tanh" else "gelu",
            "hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": m.dropout,
            "initializer_range": m.init_std, "position_embedding_type": "absolute",
            **dict(zip(BERT_TOKENS, m.bert_specials)), "tie_word_embeddings": True,
            "torch_dtype": "float32"}


def export_config(m: ModelConfig) -> dict:
    """config.json for transformers from a jaxptd model config."""
    if m.arch == "bert":
        return _bert_export(m)
    if m.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": m.num_layers, "n_embd": m.hidden_size, "n_head": m.num_heads,
                "n_positions": m.seq_len, "vocab_size": m.vocab_size, "n_inner": m.ffn,
                "layer_norm_epsilon": m.layernorm_eps,
                "activation_function": "gelu_new" if m.gelu == "tanh" else "gelu",
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "initializer_range": m.init_std, "tie_word_embeddings": True,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if m.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
                "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
                "head_dim": m.head_dim, "intermediate_size": m.ffn,
                "max_position_embeddings": m.seq_len, "vocab_size": m.vocab_size,
                "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta,
                "hidden_act": "silu", "attention_dropout": m.dropout,
                "initializer_range": m.init_std, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    raise AssertionError(f"model.arch={m.arch!r}")  # config.py allows no other


@dataclass(frozen=True)
class HFClass:
    """What import needs to know of a transformers class."""
    config: Callable[[dict], dict]  # config.json -> jaxptd's model section
    tokens: dict = field(default_factory=dict)  # config key -> the token its id names
    absent: tuple = ()  # weights the class lacks: drawn as a fresh jaxptd model's


_NOT_IN_MASKED_LM = ("bert.pooler.dense.weight", "bert.pooler.dense.bias",
                     "cls.seq_relationship.weight", "cls.seq_relationship.bias")
ARCHITECTURES = {
    "GPT2LMHeadModel": HFClass(_gpt2_config), "LlamaForCausalLM": HFClass(_llama_config),
    **{f"{prefix}For{head}": HFClass(partial(_bert_config, norm_position=norm), BERT_TOKENS,
                                      () if head == "PreTraining" else _NOT_IN_MASKED_LM)
       for prefix, norm in (("Bert", "post"), ("MegatronBert", "pre"))
       for head in ("PreTraining", "MaskedLM")},
}


# --------------------------------------------------------------------------- names

SAME = (lambda x: x, lambda x: x)
PARTS = {"w_kv": 1, "w_qkv": 1, "b_qkv": 0}  # leaf -> the axis (of one layer's value)
# its parts are stacked on
VOCAB_AXES = {("embed", "wte"): 0, ("head", "w_head"): 1,  # padded to the tensor multiple
              ("heads", "b_vocab"): 0}


def _each_layer(pattern: str, m: ModelConfig) -> tuple[str, ...]:
    return tuple(pattern.format(i=i) for i in range(m.num_layers))


def _reshaped(shape, back):
    return lambda x: x.reshape(shape), lambda x: x.reshape(back)


def _linear(shape, inputs: int = 1):
    """A torch Linear weight [out, in] <-> jaxptd's [*in, *out], whose leading `inputs`
    dims are torch's "in"."""
    rows, cols = int(np.prod(shape[:inputs])), int(np.prod(shape[inputs:]))
    return lambda x: x.T.reshape(shape), lambda x: x.reshape(rows, cols).T


def _gpt2_names(m: ModelConfig) -> list:
    """GPT2LMHeadModel. Conv1D weights are stored [in, out]."""
    n, d, h = m.num_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: _each_layer("transformer.h.{i}." + pattern, m)  # noqa: E731
    return [
        ("transformer.wte.weight", ("embed", "wte"), *SAME),
        ("transformer.wpe.weight", ("embed", "wpe"), *SAME),
        ("transformer.ln_f.weight", ("final_norm", "scale"), *SAME),
        ("transformer.ln_f.bias", ("final_norm", "bias"), *SAME),
        (layer("ln_1.weight"), ("layers", "ln1", "scale"), *SAME),
        (layer("ln_1.bias"), ("layers", "ln1", "bias"), *SAME),
        (layer("attn.c_attn.weight"), ("layers", "attn", "w_qkv"),
         *_reshaped((h, 3, n, d), (h, 3 * h))),
        (layer("attn.c_attn.bias"), ("layers", "attn", "b_qkv"), *_reshaped((3, n, d), (3 * h,))),
        (layer("attn.c_proj.weight"), ("layers", "attn", "w_out"), *_reshaped((n, d, h), (h, h))),
        (layer("attn.c_proj.bias"), ("layers", "attn", "b_out"), *SAME),
        (layer("ln_2.weight"), ("layers", "ln2", "scale"), *SAME),
        (layer("ln_2.bias"), ("layers", "ln2", "bias"), *SAME),
        (layer("mlp.c_fc.weight"), ("layers", "mlp", "w_fc1"), *SAME),
        (layer("mlp.c_fc.bias"), ("layers", "mlp", "b_fc1"), *SAME),
        (layer("mlp.c_proj.weight"), ("layers", "mlp", "w_fc2"), *SAME),
        (layer("mlp.c_proj.bias"), ("layers", "mlp", "b_fc2"), *SAME),
    ]


def _llama_names(m: ModelConfig) -> list:
    """LlamaForCausalLM: k_proj and v_proj are the two parts of w_kv."""
    n, k, d, h = m.num_heads, m.kv_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: _each_layer("model.layers.{i}." + pattern, m)  # noqa: E731
    return [
        ("model.embed_tokens.weight", ("embed", "wte"), *SAME),
        ("model.norm.weight", ("final_norm", "scale"), *SAME),
        ("lm_head.weight", ("head", "w_head"), lambda x: x.T, lambda x: x.T),
        (layer("input_layernorm.weight"), ("layers", "ln1", "scale"), *SAME),
        (layer("post_attention_layernorm.weight"), ("layers", "ln2", "scale"), *SAME),
        (layer("self_attn.q_proj.weight"), ("layers", "attn", "w_q"), *_linear((h, n, d))),
        (layer("self_attn.k_proj.weight"), ("layers", "attn", "w_kv", 0), *_linear((h, k, d))),
        (layer("self_attn.v_proj.weight"), ("layers", "attn", "w_kv", 1), *_linear((h, k, d))),
        (layer("self_attn.o_proj.weight"), ("layers", "attn", "w_o"), *_linear((n, d, h), 2)),
        (layer("mlp.gate_proj.weight"), ("layers", "mlp", "w_gate"), *_linear((h, m.ffn))),
        (layer("mlp.up_proj.weight"), ("layers", "mlp", "w_up"), *_linear((h, m.ffn))),
        (layer("mlp.down_proj.weight"), ("layers", "mlp", "w_down"), *_linear((m.ffn, h))),
    ]


def _bert_norms(m: ModelConfig) -> tuple:
    """HF name prefixes of (ln1 per layer, ln2 per layer, the final norm). Post-LN
    (layers.Block): ln1 of layer i is BERT's embedding LayerNorm (i = 0) or layer i - 1's
    output LayerNorm, the final norm the last layer's."""
    layer = lambda pattern: _each_layer("bert.encoder.layer.{i}." + pattern, m)  # noqa: E731
    if m.norm_position == "pre":
        return layer("attention.ln"), layer("ln"), "bert.encoder.ln"
    outputs = layer("output.LayerNorm")
    return ("bert.embeddings.LayerNorm",) + outputs[:-1], \
        layer("attention.output.LayerNorm"), outputs[-1]


def _bert_names(m: ModelConfig) -> list:
    """BertForPreTraining (post-LN) or MegatronBertForPreTraining (pre-LN): torch Linear
    weights [out, in]; query, key and value are the three parts of w_qkv and b_qkv; the
    decoder is tied to the word embeddings (its bias is b_vocab)."""
    n, d, h = m.num_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: _each_layer("bert.encoder.layer.{i}." + pattern, m)  # noqa: E731
    ln1, ln2, final = _bert_norms(m)
    entries = [
        ("bert.embeddings.word_embeddings.weight", ("embed", "wte"), *SAME),
        ("bert.embeddings.position_embeddings.weight", ("embed", "wpe"), *SAME),
        ("bert.embeddings.token_type_embeddings.weight", ("heads", "wtt"), *SAME),
        (final + ".weight", ("final_norm", "scale"), *SAME),
        (final + ".bias", ("final_norm", "bias"), *SAME),
    ]
    for prefixes, norm in ((ln1, "ln1"), (ln2, "ln2")):
        entries += [(tuple(p + ".weight" for p in prefixes), ("layers", norm, "scale"), *SAME),
                    (tuple(p + ".bias" for p in prefixes), ("layers", norm, "bias"), *SAME)]
    for part, name in enumerate(("query", "key", "value")):
        entries += [(layer(f"attention.self.{name}.weight"), ("layers", "attn", "w_qkv", part),
                     *_linear((h, n, d))),
                    (layer(f"attention.self.{name}.bias"), ("layers", "attn", "b_qkv", part),
                     *_reshaped((n, d), (h,)))]
    return entries + [
        (layer("attention.output.dense.weight"), ("layers", "attn", "w_out"),
         *_linear((n, d, h), 2)),
        (layer("attention.output.dense.bias"), ("layers", "attn", "b_out"), *SAME),
        (layer("intermediate.dense.weight"), ("layers", "mlp", "w_fc1"), *_linear((h, m.ffn))),
        (layer("intermediate.dense.bias"), ("layers", "mlp", "b_fc1"), *SAME),
        (layer("output.dense.weight"), ("layers", "mlp", "w_fc2"), *_linear((m.ffn, h))),
        (layer("output.dense.bias"), ("layers", "mlp", "b_fc2"), *SAME),
        ("bert.pooler.dense.weight", ("heads", "w_pool"), *_linear((h, h))),
        ("bert.pooler.dense.bias", ("heads", "b_pool"), *SAME),
        ("cls.predictions.transform.dense.weight", ("heads", "w_mlm"), *_linear((h, h))),
        ("cls.predictions.transform.dense.bias", ("heads", "b_mlm"), *SAME),
        ("cls.predictions.transform.LayerNorm.weight", ("heads", "mlm_norm", "scale"), *SAME),
        ("cls.predictions.transform.LayerNorm.bias", ("heads", "mlm_norm", "bias"), *SAME),
        ("cls.predictions.bias", ("heads", "b_vocab"), *SAME),
        ("cls.seq_relationship.weight", ("heads", "w_sop"), *_linear((h, 2))),
        ("cls.seq_relationship.bias", ("heads", "b_sop"), *SAME),
    ]


def names(m: ModelConfig) -> list:
    """(HF name or per-layer names, jaxptd path, to jaxptd, to HF) for every tensor."""
    return {"gpt": _gpt2_names, "llama": _llama_names, "bert": _bert_names}[m.arch](m)


def extras(m: ModelConfig) -> dict:
    """HF names a checkpoint may hold beside `names(m)`: {name: the name it must equal (a
    tied copy), or None (a buffer, not a weight: GPT-2's causal masks, Llama's rotary
    frequencies in older checkpoints)}."""
    if m.arch == "gpt":
        return {"lm_head.weight": "transformer.wte.weight",
                **dict.fromkeys(_each_layer("transformer.h.{i}.attn.bias", m)),
                **dict.fromkeys(_each_layer("transformer.h.{i}.attn.masked_bias", m))}
    if m.arch == "bert":
        return {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias",
                "bert.embeddings.position_ids": None, "bert.embeddings.token_type_ids": None}
    return dict.fromkeys(_each_layer("model.layers.{i}.self_attn.rotary_emb.inv_freq", m))


def canonical(m: ModelConfig, tensors: dict) -> dict:
    """The checkpoint's tensors under the names `names(m)` uses: GPT2Model-style names
    without 'transformer.'; a Llama with tied embeddings has no lm_head.weight; older
    BERTs (bert-base's) call LayerNorm's weight and bias gamma and beta."""
    if m.arch == "gpt":
        tensors = {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": v
                   for n, v in tensors.items()}
    if m.arch == "llama" and "lm_head.weight" not in tensors \
            and "model.embed_tokens.weight" in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    if m.arch == "bert":
        tensors = {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight",
                          re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", n)): v
                   for n, v in tensors.items()}
    return tensors
