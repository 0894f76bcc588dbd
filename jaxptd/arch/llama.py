"""The Llama family as config validation and the Hugging Face bridge see it: its own
options (grouped-query attention's key/value heads, query, key and value biases, the
rotary frequencies' scaling), its rules (rotary embeddings, no GeLU), and the configs
(rope_type default or Llama 3.1's llama3) and tensor names of its transformers classes:
LlamaForCausalLM, Qwen2ForCausalLM (the biases), and with a mixture of experts
MixtralForCausalLM and Qwen2MoeForCausalLM (a gated shared expert). Export picks the one
class that holds a model (`_export_class`) and refuses a model none holds. Its model is
jaxptd/model/llama.py."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

from jaxptd.arch.interface import PACKED_ROWS, Architecture, Family
from jaxptd.hf.names import SAME, HFClass, HFMap, each_layer, linear, require, reshaped

if TYPE_CHECKING:
    from jaxptd.config.schema import ModelConfig


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
    """What every class of the family shares: sizes, heads, rotary frequencies."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    require(rope_type in ("default", "llama3"),
            f"rope scaling {rope_type!r} is not supported (default and llama3 are)")
    require(hf.get("hidden_act", "silu") == "silu", "hidden_act must be silu")
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


def _llama_from_hf(hf: dict) -> dict:
    require(not hf.get("attention_bias") and not hf.get("mlp_bias"),
            "attention or MLP biases are not supported")
    return _from_hf(hf)


def _no_sliding_window(hf: dict) -> None:
    """Qwen2's and Qwen2-MoE's sliding windows (use_sliding_window, layer_types) and
    Mixtral's (sliding_window): jaxptd's attention sees every earlier token."""
    require(not hf.get("use_sliding_window") and all(
        kind == "full_attention" for kind in hf.get("layer_types") or ()),
        "sliding-window attention (use_sliding_window, layer_types) is not supported")


def _qwen2_from_hf(hf: dict) -> dict:
    """Qwen2ForCausalLM: a Llama with query, key and value biases."""
    _no_sliding_window(hf)
    return {**_from_hf(hf), "qkv_bias": True}


def _moe_from_hf(hf: dict, experts: str) -> dict:
    """The routed experts both MoE classes describe alike; `experts`: the class's key for
    their number."""
    require(not hf.get("router_jitter_noise"), f"router_jitter_noise="
            f"{hf.get('router_jitter_noise')}: jaxptd's router has no jitter (set 0)")
    return {**_from_hf(hf), "moe_experts": hf[experts], "moe_top_k": hf["num_experts_per_tok"],
            "moe_aux_loss": hf.get("router_aux_loss_coef", 0.001)}


def _mixtral_from_hf(hf: dict) -> dict:
    """MixtralForCausalLM: top-k of a softmax router, renormalised; intermediate_size is
    an expert's width; no shared expert."""
    require(hf.get("sliding_window") is None, f"sliding_window={hf.get('sliding_window')}: "
            "sliding-window attention is not supported (null: none)")
    return {**_moe_from_hf(hf, "num_local_experts"), "moe_norm_topk": True}


def _qwen2_moe_from_hf(hf: dict) -> dict:
    """Qwen2MoeForCausalLM: every decoder_sparse_step-th layer (k - 1, 2k - 1, ...: jaxptd's
    model.moe_every) a mixture of moe_intermediate_size experts and a sigmoid-gated shared
    expert, the others intermediate_size's dense MLP (none named in mlp_only_layers); the
    top-k weights renormalised only with norm_topk_prob; query, key and value biases
    unless qkv_bias is false."""
    _no_sliding_window(hf)
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    require(not dense, f"mlp_only_layers={dense}: jaxptd's dense layers are the ones "
            "decoder_sparse_step skips (set [])")
    layers = hf["num_hidden_layers"]
    require(step >= 1 and layers % step == 0, f"decoder_sparse_step={step}: jaxptd's "
            f"mixture of experts is every k-th layer with k dividing num_hidden_layers="
            f"{layers}")
    shared = hf.get("shared_expert_intermediate_size", 5632)
    require(shared > 0, f"shared_expert_intermediate_size={shared}: must be positive")
    return {**_moe_from_hf(hf, "num_experts"), "qkv_bias": hf.get("qkv_bias", True),
            "moe_ffn": hf["moe_intermediate_size"], "moe_shared_ffn": shared,
            "moe_shared_gate": True, "moe_norm_topk": hf.get("norm_topk_prob", False),
            "moe_every": step}


# transformers' classes of the family, by what a model has (`_export_class`)
LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"
MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"


def _export_class(m: ModelConfig) -> str:
    """The class that holds the model: Llama (no biases), Qwen2 (query, key and value
    biases); with experts Mixtral (no shared expert, no biases, renormalised top k) or
    Qwen2-MoE (a gated shared expert). Both routers are a softmax's top k, without
    DeepSeek-V3's bias."""
    if not m.moe:
        return QWEN2 if m.qkv_bias else LLAMA
    require(m.moe_router == "softmax", f"model.moe_router={m.moe_router}: {MIXTRAL} and "
            f"{QWEN2_MOE} route by a softmax")
    require(m.moe_bias_rate == 0, f"model.moe_bias_rate={m.moe_bias_rate}: neither "
            f"{MIXTRAL} nor {QWEN2_MOE} has a router bias")
    if m.moe_shared_ffn:
        require(m.moe_shared_gate, f"model.moe_shared_gate=false: {QWEN2_MOE}'s shared "
                "expert is always gated (and Mixtral has none)")
        return QWEN2_MOE
    require(not m.qkv_bias, f"model.qkv_bias=true without a shared expert: {MIXTRAL} has no "
            f"attention biases and {QWEN2_MOE} always has a shared expert")
    require(m.moe_norm_topk, f"model.moe_norm_topk=false without a shared expert: {MIXTRAL} "
            f"always renormalises the top k and {QWEN2_MOE} always has a shared expert")
    require(m.moe_every == 1, f"model.moe_every={m.moe_every} without a shared expert: "
            f"{MIXTRAL}'s every layer is a mixture and {QWEN2_MOE} always has a shared expert")
    return MIXTRAL


def _to_hf(m: ModelConfig) -> dict:
    """config.json; llama3 scaling as rope_scaling (which transformers 4 and 5 both read)."""
    name = _export_class(m)
    hf = {"architectures": [name], "model_type": MODEL_TYPES[name],
          "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
          "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
          "head_dim": m.head_dim, "intermediate_size": m.ffn,
          "max_position_embeddings": m.seq_len, "vocab_size": m.vocab_size,
          "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta,
          "hidden_act": "silu", "attention_dropout": m.dropout,
          "initializer_range": m.init_std, "tie_word_embeddings": False,
          "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if name == LLAMA:
        hf.update(attention_bias=False, mlp_bias=False)
    if name in (QWEN2, QWEN2_MOE):
        hf.update(use_sliding_window=False)
    if m.moe:
        hf.update(num_experts_per_tok=m.moe_top_k, router_aux_loss_coef=m.moe_aux_loss)
    if name == MIXTRAL:
        hf.update(num_local_experts=m.moe_experts, intermediate_size=m.expert_ffn,
                  sliding_window=None, router_jitter_noise=0.0)
    if name == QWEN2_MOE:
        hf.update(num_experts=m.moe_experts, moe_intermediate_size=m.expert_ffn,
                  shared_expert_intermediate_size=m.moe_shared_ffn,
                  norm_topk_prob=m.moe_norm_topk, decoder_sparse_step=m.moe_every,
                  mlp_only_layers=[], qkv_bias=m.qkv_bias)
    if m.rope_scaling == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3",
                              **{hf_key: getattr(m, key) for key, hf_key in LLAMA3.items()}}
    return hf


MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", MIXTRAL: "mixtral", QWEN2_MOE: "qwen2_moe"}
# a routed expert's three matrices in each MoE class's per-expert names, under its prefix
EXPERTS = {MIXTRAL: ("block_sparse_moe", ("w1", "w3", "w2")),
           QWEN2_MOE: ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _names(m: ModelConfig) -> list:
    """The family's classes: k_proj and v_proj are the two parts of w_kv (their biases of
    b_kv); a MoE's experts, one tensor each in the names save_pretrained writes, the parts
    of the experts' leaves (their axis E). With model.moe_every = k, unit position j's
    layers (j, j + k, ...) under ('layers', 'layer_j')."""
    names = [("model.embed_tokens.weight", ("embed", "wte"), *SAME),
             ("model.norm.weight", ("final_norm", "scale"), *SAME),
             ("lm_head.weight", ("head", "w_head"), lambda x: x.T, lambda x: x.T)]
    for j in range(m.unit):
        names += _layer_names(m, j, sparse=m.moe and j == m.unit - 1)
    return names


def _layer_names(m: ModelConfig, j: int, sparse: bool) -> list:
    """The names of layer j of every unit: attention, norms and its MLP, a mixture of
    experts if `sparse`."""
    n, k, d, h = m.num_heads, m.kv_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: each_layer("model.layers.{i}." + pattern, m, j)  # noqa: E731
    at = ("layers", *m.layer_path(j))
    names = [
        (layer("input_layernorm.weight"), (*at, "ln1", "scale"), *SAME),
        (layer("post_attention_layernorm.weight"), (*at, "ln2", "scale"), *SAME),
        (layer("self_attn.q_proj.weight"), (*at, "attn", "w_q"), *linear((h, n, d))),
        (layer("self_attn.k_proj.weight"), (*at, "attn", "w_kv", 0), *linear((h, k, d))),
        (layer("self_attn.v_proj.weight"), (*at, "attn", "w_kv", 1), *linear((h, k, d))),
        (layer("self_attn.o_proj.weight"), (*at, "attn", "w_o"), *linear((n, d, h), 2)),
    ]
    if m.qkv_bias:
        names += [
            (layer("self_attn.q_proj.bias"), (*at, "attn", "b_q"),
             *reshaped((n, d), (n * d,))),
            (layer("self_attn.k_proj.bias"), (*at, "attn", "b_kv", 0),
             *reshaped((k, d), (k * d,))),
            (layer("self_attn.v_proj.bias"), (*at, "attn", "b_kv", 1),
             *reshaped((k, d), (k * d,)))]
    if not sparse:
        return names + _swiglu(m, j, "mlp", (*at, "mlp"), m.ffn)
    prefix, (gate, up, down) = EXPERTS[_export_class(m)]
    fe, mlp = m.expert_ffn, (*at, "mlp")
    names.append((layer(f"{prefix}.gate.weight"), (*mlp, "w_router"),
                  *linear((h, m.moe_experts))))
    for e in range(m.moe_experts):
        expert = f"{prefix}.experts.{e}.{{}}.weight"
        names += [(layer(expert.format(gate)), (*mlp, "w_experts_gate", e), *linear((h, fe))),
                  (layer(expert.format(up)), (*mlp, "w_experts_up", e), *linear((h, fe))),
                  (layer(expert.format(down)), (*mlp, "w_experts_down", e), *linear((fe, h)))]
    if m.moe_shared_ffn:
        names += _swiglu(m, j, "mlp.shared_expert", (*mlp, "shared"), m.moe_shared_ffn)
        names.append((layer("mlp.shared_expert_gate.weight"), (*mlp, "w_shared_gate"),
                      *linear((h, 1))))
    return names


def _swiglu(m: ModelConfig, j: int, module: str, path: tuple, f: int) -> list:
    """A SwiGLU MLP of width f (w_gate, w_up, w_down under `path`) as the transformers
    `module`'s gate_proj, up_proj and down_proj, in layer j of every unit."""
    h = m.hidden_size
    return [(each_layer(f"model.layers.{{i}}.{module}.{proj}.weight", m, j), (*path, leaf),
             *linear(shape))
            for proj, leaf, shape in (("gate_proj", "w_gate", (h, f)),
                                      ("up_proj", "w_up", (h, f)),
                                      ("down_proj", "w_down", (f, h)))]


def _extras(m: ModelConfig) -> dict:
    """The rotary frequencies older checkpoints keep (a buffer)."""
    return dict.fromkeys(f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
                         for i in range(m.num_layers))


def _canonical(m: ModelConfig, tensors: dict) -> dict:
    """A Llama with tied embeddings has no lm_head.weight; a MoE's experts may come as
    transformers 5 keeps them (`_per_expert`)."""
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    return _per_expert(m, tensors) if m.moe else tensors


def _per_expert(m: ModelConfig, tensors: dict) -> dict:
    """The spellings transformers 5 loads beside the per-expert names that save_pretrained
    writes: a layer's experts fused, mlp.experts.gate_up_proj [E, 2 fe, h] (each expert's
    gate rows, then its up rows) and mlp.experts.down_proj [E, h, fe], and Mixtral's
    modules under mlp. (its legacy name block_sparse_moe. is the one written)."""
    prefix, (gate, up, down) = EXPERTS[_export_class(m)]
    module = re.compile(rf"model\.layers\.(\d+)\.(?:mlp|{prefix})\.(.+)")
    out = {}
    for name, value in tensors.items():
        found = module.fullmatch(name)
        if found is None:
            out[name] = value
            continue
        base, rest = f"model.layers.{found.group(1)}.{prefix}.", found.group(2)
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            require(value.ndim == 3, f"tensor {name!r} has shape {tuple(value.shape)}: "
                    "fused experts are [experts, out, in]")
            fe = value.shape[1] // 2
            parts = ({gate: value[:, :fe], up: value[:, fe:]} if rest.endswith("gate_up_proj")
                     else {down: value})
            out.update({f"{base}experts.{j}.{proj}.weight": stacked[j]
                        for proj, stacked in parts.items() for j in range(len(value))})
        else:
            out[base + rest] = value
    return out


FAMILY = Family(
    name="llama", load=_load, config_errors=_config_errors, gated_mlp=True, experts=True,
    options={"num_kv_heads": "model.num_kv_heads={value}: only model.arch=llama has "
             "grouped-query attention (0: as many as model.num_heads)",
             "qkv_bias": "model.qkv_bias={value}: only model.arch=llama has the query, key "
             "and value biases option (gpt and bert always have theirs)",
             **{key: f"model.{key}={{value}}: only model.arch=llama has rotary embeddings"
                for key in ("rope_scaling", *LLAMA3)}, **PACKED_ROWS},
    hf=HFMap(classes={LLAMA: HFClass(_llama_from_hf), QWEN2: HFClass(_qwen2_from_hf),
                      MIXTRAL: HFClass(_mixtral_from_hf), QWEN2_MOE: HFClass(_qwen2_moe_from_hf)},
             export_config=_to_hf, names=_names, extras=_extras,
             parts={"w_kv": 1, "b_kv": 0, "w_experts_gate": 0, "w_experts_up": 0,
                    "w_experts_down": 0},
             vocab_axes={("embed", "wte"): 0, ("head", "w_head"): 1}, canonical=_canonical))
