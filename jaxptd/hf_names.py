"""What maps between a transformers checkpoint and jaxptd, as data (no I/O; jaxptd/hf.py
reads and writes the files).

Owns, for each supported transformers class:

- the config translation both ways (`ARCHITECTURES`: config.json -> jaxptd's model
  section, with a one-line `HFError` for what jaxptd cannot represent; `export_config`:
  the way back);
- the tensor names (`names(m)`): a list of (HF name, jaxptd path, to jaxptd, to HF). An
  ends leaf has one HF name; a layer leaf (its path starts with 'layers') a tuple of
  num_layers names, one per layer, stacked on a leading [L] axis. A path ending in an int
  is one part of a leaf that transformers keeps as several tensors (k_proj and v_proj ->
  Llama's w_kv), stacked on the leaf's axis `PARTS[name]` (of one layer's value);
- what a checkpoint may hold beside them (`extras(m)`): a tied copy (the name it must
  equal) or a buffer that is not a weight (None);
- `canonical`: the spellings transformers itself accepts on load, brought to one.
"""
from __future__ import annotations

import numpy as np

from jaxptd.config import ModelConfig


class HFError(ValueError):
    """A user-caused problem with a Hugging Face directory or a checkpoint; one line."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise HFError(message)


# --------------------------------------------------------------------------- configs

def _gpt2_config(hf: dict) -> dict:
    require(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function={hf.get('activation_function')!r}: jaxptd's GPT uses "
            "the tanh GeLU (gelu_new)")
    require(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights",
                                                                     True),
            "attention scaling other than 1/sqrt(head_dim) is not supported")
    return {"arch": "gpt", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "seq_len": hf["n_positions"],
            "vocab_size": hf["vocab_size"], "ffn_size": hf.get("n_inner") or 0,
            "layernorm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "dropout": hf.get("resid_pdrop", 0.1), "init_std": hf.get("initializer_range", 0.02)}


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


def export_config(m: ModelConfig) -> dict:
    """config.json for transformers from a jaxptd model config."""
    if m.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": m.num_layers, "n_embd": m.hidden_size, "n_head": m.num_heads,
                "n_positions": m.seq_len, "vocab_size": m.vocab_size, "n_inner": m.ffn,
                "layer_norm_epsilon": m.layernorm_eps, "activation_function": "gelu_new",
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
    raise HFError(f"model.arch={m.arch!r}: export supports gpt (GPT2LMHeadModel) and llama "
                  "(LlamaForCausalLM)")


# HF class -> its config.json's translation
ARCHITECTURES = {"GPT2LMHeadModel": _gpt2_config, "LlamaForCausalLM": _llama_config}


# --------------------------------------------------------------------------- names

SAME = (lambda x: x, lambda x: x)
PARTS = {"w_kv": 1}  # leaf -> the axis (of one layer's value) its parts are stacked on
VOCAB_AXES = {("embed", "wte"): 0, ("head", "w_head"): 1}  # padded to the tensor multiple


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


def names(m: ModelConfig) -> list:
    """(HF name or per-layer names, jaxptd path, to jaxptd, to HF) for every tensor."""
    return {"gpt": _gpt2_names, "llama": _llama_names}[m.arch](m)


def extras(m: ModelConfig) -> dict:
    """HF names a checkpoint may hold beside `names(m)`: {name: the name it must equal (a
    tied copy), or None (a buffer, not a weight: GPT-2's causal masks, Llama's rotary
    frequencies in older checkpoints)}."""
    if m.arch == "gpt":
        return {"lm_head.weight": "transformer.wte.weight",
                **dict.fromkeys(_each_layer("transformer.h.{i}.attn.bias", m)),
                **dict.fromkeys(_each_layer("transformer.h.{i}.attn.masked_bias", m))}
    return dict.fromkeys(_each_layer("model.layers.{i}.self_attn.rotary_emb.inv_freq", m))


def canonical(m: ModelConfig, tensors: dict) -> dict:
    """The checkpoint's tensors under the names `names(m)` uses: GPT2Model-style names
    without 'transformer.'; a Llama with tied embeddings has no lm_head.weight."""
    if m.arch == "gpt":
        tensors = {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": v
                   for n, v in tensors.items()}
    if m.arch == "llama" and "lm_head.weight" not in tensors \
            and "model.embed_tokens.weight" in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    return tensors
