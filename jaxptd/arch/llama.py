"""The Llama family as config validation and the Hugging Face bridge see it: its own
options (grouped-query attention's key/value heads, the rotary frequencies' scaling), its
rules (rotary embeddings, no GeLU), LlamaForCausalLM's config (rope_type default or Llama
3.1's llama3) and tensor names. Its model is jaxptd/model/llama.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from jaxptd.arch.interface import PACKED_ROWS, Architecture, Family
from jaxptd.hf_names import SAME, HFClass, HFMap, each_layer, linear, require

if TYPE_CHECKING:
    from jaxptd.config import ModelConfig


def _load() -> Architecture:
    from jaxptd.model import llama  # Flax starts JAX: config validation must not (plan --verify)
    return llama.ARCH


# model.rope_scaling=llama3's parameters (Hugging Face's names beside them)
LLAMA3 = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
          "rope_high_freq_factor": "high_freq_factor",
          "rope_original_seq_len": "original_max_position_embeddings"}


def _config_errors(m: ModelConfig) -> Iterator[str]:
    if m.head_dim % 2:
        yield (f"model.hidden_size={m.hidden_size}: rotary embeddings need an even head "
               f"dimension, hidden_size / num_heads = {m.head_dim}")
    if m.gelu != "tanh":
        yield f"model.gelu={m.gelu}: llama has no GeLU (its MLP is SwiGLU)"
    if m.rope_high_freq_factor <= m.rope_low_freq_factor:
        yield (f"model.rope_high_freq_factor={m.rope_high_freq_factor}: must exceed "
               f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
    defaults = type(m)()
    for key in LLAMA3:
        if m.rope_scaling != "llama3" and getattr(m, key) != getattr(defaults, key):
            yield (f"model.{key}={getattr(m, key)}: only model.rope_scaling=llama3 reads "
                   "it")


def _from_hf(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    require(rope_type in ("default", "llama3"),
            f"rope scaling {rope_type!r} is not supported (default and llama3 are)")
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
            **(_llama3_from_hf(hf, rope) if rope_type == "llama3" else {}),
            "dropout": hf.get("attention_dropout", 0.0),
            "init_std": hf.get("initializer_range", 0.02)}


def _llama3_from_hf(hf: dict, rope: dict) -> dict:
    """rope_type llama3's parameters (rope_parameters, transformers 5's spelling, or
    rope_scaling, the Llama 3.1 checkpoints'); the original length defaults to
    max_position_embeddings, as transformers' does."""
    rope = {"original_max_position_embeddings": hf.get("max_position_embeddings", 2048),
            **rope}
    return {"rope_scaling": "llama3", **{key: rope[hf_key] for key, hf_key in LLAMA3.items()}}


def _to_hf(m: ModelConfig) -> dict:
    """config.json; llama3 scaling as rope_scaling (which transformers 4 and 5 both read)."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
          "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
          "head_dim": m.head_dim, "intermediate_size": m.ffn,
          "max_position_embeddings": m.seq_len, "vocab_size": m.vocab_size,
          "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta,
          "hidden_act": "silu", "attention_dropout": m.dropout,
          "initializer_range": m.init_std, "tie_word_embeddings": False,
          "attention_bias": False, "mlp_bias": False,
          "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if m.rope_scaling == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3",
                              **{hf_key: getattr(m, key) for key, hf_key in LLAMA3.items()}}
    return hf


def _names(m: ModelConfig) -> list:
    """LlamaForCausalLM: k_proj and v_proj are the two parts of w_kv."""
    n, k, d, h = m.num_heads, m.kv_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: each_layer("model.layers.{i}." + pattern, m)  # noqa: E731
    return [
        ("model.embed_tokens.weight", ("embed", "wte"), *SAME),
        ("model.norm.weight", ("final_norm", "scale"), *SAME),
        ("lm_head.weight", ("head", "w_head"), lambda x: x.T, lambda x: x.T),
        (layer("input_layernorm.weight"), ("layers", "ln1", "scale"), *SAME),
        (layer("post_attention_layernorm.weight"), ("layers", "ln2", "scale"), *SAME),
        (layer("self_attn.q_proj.weight"), ("layers", "attn", "w_q"), *linear((h, n, d))),
        (layer("self_attn.k_proj.weight"), ("layers", "attn", "w_kv", 0), *linear((h, k, d))),
        (layer("self_attn.v_proj.weight"), ("layers", "attn", "w_kv", 1), *linear((h, k, d))),
        (layer("self_attn.o_proj.weight"), ("layers", "attn", "w_o"), *linear((n, d, h), 2)),
        (layer("mlp.gate_proj.weight"), ("layers", "mlp", "w_gate"), *linear((h, m.ffn))),
        (layer("mlp.up_proj.weight"), ("layers", "mlp", "w_up"), *linear((h, m.ffn))),
        (layer("mlp.down_proj.weight"), ("layers", "mlp", "w_down"), *linear((m.ffn, h))),
    ]


def _extras(m: ModelConfig) -> dict:
    """The rotary frequencies older checkpoints keep (a buffer)."""
    return dict.fromkeys(each_layer("model.layers.{i}.self_attn.rotary_emb.inv_freq", m))


def _canonical(m: ModelConfig, tensors: dict) -> dict:
    """A Llama with tied embeddings has no lm_head.weight."""
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    return tensors


FAMILY = Family(
    name="llama", load=_load, config_errors=_config_errors,
    options={"num_kv_heads": "model.num_kv_heads={value}: only model.arch=llama has "
             "grouped-query attention (0: as many as model.num_heads)",
             "qkv_bias": "model.qkv_bias={value}: only model.arch=llama has the query, key "
             "and value biases option (gpt and bert always have theirs)",
             **{key: f"model.{key}={{value}}: only model.arch=llama has rotary embeddings"
                for key in ("rope_scaling", *LLAMA3)}, **PACKED_ROWS},
    hf=HFMap(classes={"LlamaForCausalLM": HFClass(_from_hf)}, export_config=_to_hf,
             names=_names, extras=_extras, parts={"w_kv": 1},
             vocab_axes={("embed", "wte"): 0, ("head", "w_head"): 1}, canonical=_canonical))
