"""The BERT family as config validation and the Hugging Face bridge see it: its own
options (post-LayerNorm, special token ids) and rules (rows [CLS] A [SEP] B [SEP], four
distinct special ids), the config and tensor names of BertForPreTraining and
BertForMaskedLM and their MegatronBert (pre-LayerNorm) forms. transformers' BERT is
post-LayerNorm with the exact GeLU, its MegatronBert pre-LayerNorm (jaxptd's BERT): both
map exactly, through model.norm_position and model.gelu; a BERT's [PAD] [CLS] [SEP] [MASK]
ids become model.special_ids unless they are the top 4 of the vocabulary. Its model is
jaxptd/model/bert.py."""
from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Iterator

from jaxptd.arch.interface import Architecture, Family
from jaxptd.hf.names import (SAME, HFClass, HFMap, each_layer, gelu, linear, require,
                             reshaped)

if TYPE_CHECKING:
    from jaxptd.config.schema import ModelConfig


def _load() -> Architecture:
    from jaxptd.model import bert  # Flax starts JAX: config validation must not (plan --verify)
    return bert.ARCH


def _config_errors(m: ModelConfig) -> Iterator[str]:
    if m.seq_len < 5:
        yield f"model.seq_len={m.seq_len}: BERT's rows [CLS] A [SEP] B [SEP] need at least 5"
    if not m.special_ids:
        return
    try:
        ids = m.bert_specials
    except ValueError:
        ids = ()
    if not (len(ids) == len(set(ids)) == 4 and all(0 <= i < m.vocab_size for i in ids)):
        yield (f"model.special_ids={m.special_ids!r}: must be four different ids PAD,CLS,SEP,"
               f"MASK in [0, model.vocab_size={m.vocab_size}), e.g. 0,101,102,103")


TOKENS = {"pad_token_id": "[PAD]", "cls_token_id": "[CLS]", "sep_token_id": "[SEP]",
          "mask_token_id": "[MASK]"}  # model.special_ids' order


def _from_hf(hf: dict, norm_position: str) -> dict:
    """BertFor* (post-LayerNorm) or MegatronBertFor* (pre-LayerNorm). The special ids
    config.json lacks come from the tokenizer files (hf_files.read_hf)."""
    require(hf.get("type_vocab_size", 2) == 2, f"type_vocab_size={hf.get('type_vocab_size')}:"
            " jaxptd's BERT has 2 token types (sentences A and B)")
    require(hf.get("position_embedding_type", "absolute") == "absolute",
            f"position_embedding_type={hf.get('position_embedding_type')!r}: jaxptd's BERT "
            "has absolute (learned) positions")
    require(not hf.get("is_decoder") and not hf.get("add_cross_attention"),
            "a BERT decoder (is_decoder, add_cross_attention) is not supported")
    ids = [hf.get(key) for key in TOKENS]
    unknown = [token for token, i in zip(TOKENS.values(), ids) if i is None]
    require(not unknown, f"no id for {' '.join(unknown)} in config.json or a tokenizer file "
            "(tokenizer.json, vocab.txt): put the model's tokenizer files beside config.json")
    vocab = hf["vocab_size"]
    return {"arch": "bert", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": hf["num_attention_heads"],
            "seq_len": hf["max_position_embeddings"], "vocab_size": vocab,
            "ffn_size": hf["intermediate_size"], "layernorm_eps": hf.get("layer_norm_eps", 1e-12),
            "dropout": hf.get("hidden_dropout_prob", 0.1),
            "init_std": hf.get("initializer_range", 0.02), "gelu": gelu(hf, "hidden_act", "gelu"),
            "norm_position": norm_position,
            "special_ids": "" if ids == list(range(vocab - 4, vocab)) else ",".join(map(str, ids))}


def _to_hf(m: ModelConfig) -> dict:
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
            **dict(zip(TOKENS, m.bert_specials)), "tie_word_embeddings": True,
            "torch_dtype": "float32"}


_NOT_IN_MASKED_LM = ("bert.pooler.dense.weight", "bert.pooler.dense.bias",
                     "cls.seq_relationship.weight", "cls.seq_relationship.bias")


def _norms(m: ModelConfig) -> tuple:
    """HF name prefixes of (ln1 per layer, ln2 per layer, the final norm). Post-LN
    (layers.Block): ln1 of layer i is BERT's embedding LayerNorm (i = 0) or layer i - 1's
    output LayerNorm, the final norm the last layer's."""
    layer = lambda pattern: each_layer("bert.encoder.layer.{i}." + pattern, m)  # noqa: E731
    if m.norm_position == "pre":
        return layer("attention.ln"), layer("ln"), "bert.encoder.ln"
    outputs = layer("output.LayerNorm")
    return ("bert.embeddings.LayerNorm",) + outputs[:-1], \
        layer("attention.output.LayerNorm"), outputs[-1]


def _names(m: ModelConfig) -> list:
    """BertForPreTraining (post-LN) or MegatronBertForPreTraining (pre-LN): torch Linear
    weights [out, in]; query, key and value are the three parts of w_qkv and b_qkv; the
    decoder is tied to the word embeddings (its bias is b_vocab)."""
    n, d, h = m.num_heads, m.head_dim, m.hidden_size
    layer = lambda pattern: each_layer("bert.encoder.layer.{i}." + pattern, m)  # noqa: E731
    ln1, ln2, final = _norms(m)
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
                     *linear((h, n, d))),
                    (layer(f"attention.self.{name}.bias"), ("layers", "attn", "b_qkv", part),
                     *reshaped((n, d), (h,)))]
    return entries + [
        (layer("attention.output.dense.weight"), ("layers", "attn", "w_out"),
         *linear((n, d, h), 2)),
        (layer("attention.output.dense.bias"), ("layers", "attn", "b_out"), *SAME),
        (layer("intermediate.dense.weight"), ("layers", "mlp", "w_fc1"), *linear((h, m.ffn))),
        (layer("intermediate.dense.bias"), ("layers", "mlp", "b_fc1"), *SAME),
        (layer("output.dense.weight"), ("layers", "mlp", "w_fc2"), *linear((m.ffn, h))),
        (layer("output.dense.bias"), ("layers", "mlp", "b_fc2"), *SAME),
        ("bert.pooler.dense.weight", ("heads", "w_pool"), *linear((h, h))),
        ("bert.pooler.dense.bias", ("heads", "b_pool"), *SAME),
        ("cls.predictions.transform.dense.weight", ("heads", "w_mlm"), *linear((h, h))),
        ("cls.predictions.transform.dense.bias", ("heads", "b_mlm"), *SAME),
        ("cls.predictions.transform.LayerNorm.weight", ("heads", "mlm_norm", "scale"), *SAME),
        ("cls.predictions.transform.LayerNorm.bias", ("heads", "mlm_norm", "bias"), *SAME),
        ("cls.predictions.bias", ("heads", "b_vocab"), *SAME),
        ("cls.seq_relationship.weight", ("heads", "w_sop"), *linear((h, 2))),
        ("cls.seq_relationship.bias", ("heads", "b_sop"), *SAME),
    ]


def _extras(m: ModelConfig) -> dict:
    """The tied decoder and its bias; the position and type id buffers."""
    return {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias",
            "bert.embeddings.position_ids": None, "bert.embeddings.token_type_ids": None}


def _canonical(m: ModelConfig, tensors: dict) -> dict:
    """Older BERTs (bert-base's) call LayerNorm's weight and bias gamma and beta."""
    return {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight",
                   re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", n)): v
            for n, v in tensors.items()}


FAMILY = Family(
    name="bert", load=_load, config_errors=_config_errors, encoder=True,
    options={"norm_position": "model.norm_position={value}: only model.arch=bert has "
             "post-LayerNorm",
             "special_ids": "model.special_ids={value!r}: only model.arch=bert has special "
             "tokens"},
    hf=HFMap(classes={f"{prefix}For{head}": HFClass(partial(_from_hf, norm_position=norm),
                                                    TOKENS, () if head == "PreTraining"
                                                    else _NOT_IN_MASKED_LM)
                      for prefix, norm in (("Bert", "post"), ("MegatronBert", "pre"))
                      for head in ("PreTraining", "MaskedLM")},
             export_config=_to_hf, names=_names, extras=_extras,
             parts={"w_qkv": 1, "b_qkv": 0},
             vocab_axes={("embed", "wte"): 0, ("heads", "b_vocab"): 0}, canonical=_canonical))
