"""The GPT family (the papers' GPT-2-shaped decoder) as config validation and the Hugging
Face bridge see it: GPT2LMHeadModel's config and tensor names. Its model is
jaxptd/model/gpt.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxptd.arch.interface import PACKED_ROWS, Architecture, Family
from jaxptd.hf.names import SAME, HFClass, HFMap, each_layer, gelu, require, reshaped

if TYPE_CHECKING:
    from jaxptd.config.schema import ModelConfig


def _load() -> Architecture:
    from jaxptd.model import gpt  # Flax starts JAX: config validation must not (plan --verify)
    return gpt.ARCH


def _from_hf(hf: dict) -> dict:
    act = gelu(hf, "activation_function", "gelu_new")
    require(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights",
                                                                     True),
            "attention scaling other than 1/sqrt(head_dim) is not supported")
    return {"arch": "gpt", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "seq_len": hf["n_positions"],
            "vocab_size": hf["vocab_size"], "ffn_size": hf.get("n_inner") or 0,
            "layernorm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "dropout": hf.get("resid_pdrop", 0.1), "init_std": hf.get("initializer_range", 0.02),
            "gelu": act}


def _to_hf(m: ModelConfig) -> dict:
    require(not m.moe, f"model.moe_experts={m.moe_experts}: GPT2LMHeadModel has no mixture "
            "of experts")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_layer": m.num_layers, "n_embd": m.hidden_size, "n_head": m.num_heads,
            "n_positions": m.seq_len, "vocab_size": m.vocab_size, "n_inner": m.ffn,
            "layer_norm_epsilon": m.layernorm_eps,
            "activation_function": "gelu_new" if m.gelu == "tanh" else "gelu",
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
            "initializer_range": m.init_std, "tie_word_embeddings": True,
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


def _names(m: ModelConfig) -> list:
    """GPT2LMHeadModel. Conv1D weights are stored [in, out]."""
    n, d, h = m.num_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: each_layer("transformer.h.{i}." + pattern, m)  # noqa: E731
    return [
        ("transformer.wte.weight", ("embed", "wte"), *SAME),
        ("transformer.wpe.weight", ("embed", "wpe"), *SAME),
        ("transformer.ln_f.weight", ("final_norm", "scale"), *SAME),
        ("transformer.ln_f.bias", ("final_norm", "bias"), *SAME),
        (layer("ln_1.weight"), ("layers", "ln1", "scale"), *SAME),
        (layer("ln_1.bias"), ("layers", "ln1", "bias"), *SAME),
        (layer("attn.c_attn.weight"), ("layers", "attn", "w_qkv"),
         *reshaped((h, 3, n, d), (h, 3 * h))),
        (layer("attn.c_attn.bias"), ("layers", "attn", "b_qkv"), *reshaped((3, n, d), (3 * h,))),
        (layer("attn.c_proj.weight"), ("layers", "attn", "w_out"), *reshaped((n, d, h), (h, h))),
        (layer("attn.c_proj.bias"), ("layers", "attn", "b_out"), *SAME),
        (layer("ln_2.weight"), ("layers", "ln2", "scale"), *SAME),
        (layer("ln_2.bias"), ("layers", "ln2", "bias"), *SAME),
        (layer("mlp.c_fc.weight"), ("layers", "mlp", "w_fc1"), *SAME),
        (layer("mlp.c_fc.bias"), ("layers", "mlp", "b_fc1"), *SAME),
        (layer("mlp.c_proj.weight"), ("layers", "mlp", "w_fc2"), *SAME),
        (layer("mlp.c_proj.bias"), ("layers", "mlp", "b_fc2"), *SAME),
    ]


def _extras(m: ModelConfig) -> dict:
    """The tied output layer; the causal-mask buffers."""
    return {"lm_head.weight": "transformer.wte.weight",
            **dict.fromkeys(each_layer("transformer.h.{i}.attn.bias", m)),
            **dict.fromkeys(each_layer("transformer.h.{i}.attn.masked_bias", m))}


def _canonical(m: ModelConfig, tensors: dict) -> dict:
    """GPT2Model-style names without 'transformer.'."""
    return {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": v
            for n, v in tensors.items()}


FAMILY = Family(
    name="gpt", load=_load, options=PACKED_ROWS, experts=True,
    hf=HFMap(classes={"GPT2LMHeadModel": HFClass(_from_hf)}, export_config=_to_hf,
             names=_names, extras=_extras, parts={"w_qkv": 1, "b_qkv": 0},
             vocab_axes={("embed", "wte"): 0}, canonical=_canonical))
