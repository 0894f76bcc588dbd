"""The llama family's other transformers classes against transformers itself, live:
Qwen2ForCausalLM (query, key and value biases), MixtralForCausalLM and Qwen2MoeForCausalLM
(mixtures of experts; Qwen2-MoE's gated shared expert and biases, in every second layer
of four: jaxptd's model.moe_every), tiny and random
(float32). The maps name exactly what save_pretrained writes and take the fused experts
transformers 5 keeps in memory; the exported config.json builds the same model in
transformers; imported, a model gives transformers' logits and greedy ids; exported, it
loads in transformers with every tensor as it came; a jaxptd mixture of experts exports
to the class that holds it; what neither side can hold is one error line."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402  (after the skips)

from helpers import (HF_VOCAB, TINY_LLAMAS, assert_export_is_bitwise,  # noqa: E402
                     generate_ids, tiny_hf_model, torch_logits)
from jaxptd.hf import bridge as hf  # noqa: E402
from jaxptd import model as models  # noqa: E402
from jaxptd.arch import HF_CLASSES, family  # noqa: E402
from jaxptd.config import from_dict, load_config  # noqa: E402
from jaxptd.hf.files import read_hf  # noqa: E402
from jaxptd.hf.names import HFError  # noqa: E402
from jaxptd.model import stack  # noqa: E402
from jaxptd.model.tensor import Layout  # noqa: E402

PROMPT = [5, 17, 250, 3, 99]
TOKENS = np.random.default_rng(1).integers(0, HF_VOCAB, (3, 13))


@pytest.fixture(scope="module", params=list(TINY_LLAMAS))
def saved(request, tmp_path_factory):
    """(kind, transformers model, the directory save_pretrained wrote)."""
    model = tiny_hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(directory)
    return request.param, model, directory


def _model_config(hf_dir):
    """(jaxptd's model config of a transformers directory, its tensors as saved)."""
    arch, config, tensors = read_hf(hf_dir)
    return from_dict({"model": HF_CLASSES[arch].config(config)}).model, tensors


def test_maps_name_what_save_pretrained_writes_and_what_transformers_keeps(saved):
    """The names are save_pretrained's (per-expert, Mixtral's block_sparse_moe); the
    model's own state dict (fused gate_up_proj and down_proj, Mixtral's experts under
    mlp.) is brought to exactly those tensors by the map's `canonical`."""
    _, model, hf_dir = saved
    m, tensors = _model_config(hf_dir)
    hf_map = family(m).hf
    names = {name for entry in hf_map.names(m)
             for name in ((entry[0],) if isinstance(entry[0], str) else entry[0])}
    assert names == set(tensors)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    if m.moe:
        assert any(name.endswith("experts.gate_up_proj") for name in state)
    canonical = hf_map.canonical(m, state)
    assert set(canonical) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(canonical[name], value, err_msg=name)


def test_exported_config_builds_the_same_model(saved, tmp_path):
    """config.json -> jaxptd's model section -> config.json: transformers builds the
    class it names from it, the original's weights fit it and give the original's logits
    (sizes, experts, top k, renormalisation, biases, eps and rope theta all kept)."""
    kind, model, hf_dir = saved
    m, _ = _model_config(hf_dir)
    (tmp_path / "config.json").write_text(json.dumps(family(m).hf.export_config(m)))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == TINY_LLAMAS[kind][1]
    rebuilt = getattr(transformers, TINY_LLAMAS[kind][0])(config).eval()
    rebuilt.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(torch_logits(rebuilt, TOKENS), torch_logits(model, TOKENS))


# --------------------------------------------------------------- through jaxptd's model

@pytest.fixture(scope="module")
def imported(saved, tmp_path_factory):
    """(kind, transformers model, its directory, the import's directory)."""
    kind, model, hf_dir = saved
    out = tmp_path_factory.mktemp(kind) / "jaxptd"
    assert hf.main(["import", str(hf_dir), str(out)]) == 0
    return kind, model, hf_dir, out


def test_import_gives_transformers_logits_and_greedy_ids(imported):
    """Qwen2-MoE's greedy ids at tensor 2 (its experts' widths and the kv heads split)."""
    kind, model, _, out = imported
    config, params, _ = hf.load_params(out)
    m = config.model
    vocab = params["embed"]["wte"].shape[0]
    ours = jax.jit(models.forward_logits, static_argnums=(2, 3))(
        params, jnp.asarray(TOKENS), m, Layout(vocab))
    expected = torch_logits(model, TOKENS)
    np.testing.assert_allclose(np.asarray(ours)[..., :HF_VOCAB], expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    tensor = 2 if kind == "qwen2-moe" else 1
    vocab = m.padded_vocab(tensor)
    ids = generate_ids(m, hf.pad_vocab(jax.device_get(params), vocab), vocab, tensor,
                       PROMPT, 10, temperature=0.0)
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)
    assert ids.tolist() == greedy[0, len(PROMPT):].tolist()


def test_export_round_trips_every_tensor(imported, tmp_path):
    """import -> export: the tensors save_pretrained wrote, bit for bit, under the same
    names; transformers loads the directory and gives the original's logits."""
    _, model, hf_dir, out = imported
    assert_export_is_bitwise(out, hf_dir, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded) is type(model)
    np.testing.assert_array_equal(torch_logits(reloaded, TOKENS), torch_logits(model, TOKENS))


JAXPTD_MOES = {  # a jaxptd mixture of experts -> the class export writes
    "MixtralForCausalLM": ["model.moe_ffn=20"],
    "Qwen2MoeForCausalLM": ["model.moe_shared_ffn=24", "model.moe_shared_gate=true",
                            "model.qkv_bias=true", "model.moe_norm_topk=false",
                            "model.num_layers=4", "model.moe_every=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JAXPTD_MOES))
def test_a_jaxptd_mixture_of_experts_exports(name, tmp_path):
    """A model jaxptd drew (its biases drawn too, not zeros) saved as a checkpoint exports
    as `name`, which transformers loads with jaxptd's logits and greedy ids."""
    config = load_config(None, [
        "model.arch=llama", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_size=40", "model.vocab_size=301",
        "model.seq_len=32", "model.moe_experts=4", "model.moe_top_k=2",
        f"train.run_dir={tmp_path / 'run'}", *JAXPTD_MOES[name]])
    m = config.model
    vocab = m.padded_vocab(1)
    params = jax.device_get(jax.jit(  # (one compile; eagerly, one per op)
        functools.partial(models.get(m).init_params, m, vocab))(jax.random.key(7)))
    keys = iter(jax.random.split(jax.random.key(8), 8))
    for layer in stack.layer_trees(params["layers"], m):
        attn = layer["attn"]
        for leaf in ("b_q", "b_kv") if m.qkv_bias else ():
            attn[leaf] = np.asarray(0.1 * jax.random.normal(next(keys), attn[leaf].shape))
    # a router with clear margins (as tiny_hf_model's)
    mlp = stack.layer_tree(params["layers"], m, m.unit - 1)["mlp"]
    mlp["w_router"] = np.asarray(0.5 * jax.random.normal(next(keys), mlp["w_router"].shape))
    # (the import's own steps: the single-device layout and a step-0 checkpoint)
    hf._save(hf._single_device_setup(config), params, tmp_path / "run" / "checkpoints")
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [name]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == name
    ours = jax.jit(models.forward_logits, static_argnums=(2, 3))(
        params, jnp.asarray(TOKENS), m, Layout(vocab))
    expected = torch_logits(model, TOKENS)
    np.testing.assert_allclose(np.asarray(ours)[..., :HF_VOCAB], expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    ids = generate_ids(m, params, vocab, 1, PROMPT, 10, temperature=0.0)
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)
    assert ids.tolist() == greedy[0, len(PROMPT):].tolist()


# --------------------------------------------------------------- what cannot be held

@pytest.mark.parametrize("kind, changes, message", [
    ("mixtral", {"sliding_window": 16}, "sliding_window=16"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("qwen2-moe", {"decoder_sparse_step": 3}, "decoder_sparse_step=3"),
    ("qwen2-moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen2-moe", {"use_sliding_window": True}, "sliding-window"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
])
def test_import_refuses_what_jaxptd_cannot_represent(kind, changes, message, tmp_path,
                                                     capsys):
    tiny_hf_model(kind).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **changes}))
    capsys.readouterr()  # transformers' progress bars
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_router=sigmoid"], "moe_router=sigmoid"),
    (["model.moe_bias_rate=0.001"], "moe_bias_rate=0.001"),
    (["model.moe_shared_ffn=32"], "moe_shared_gate=false"),
    (["model.qkv_bias=true"], "qkv_bias=true without a shared expert"),
    (["model.moe_norm_topk=false"], "moe_norm_topk=false without a shared expert"),
    (["model.moe_every=2"], "moe_every=2 without a shared expert"),
])
def test_export_refuses_what_neither_class_holds(overrides, message):
    m = load_config(None, ["model.arch=llama", "model.moe_experts=4", *overrides]).model
    with pytest.raises(HFError, match=message):
        family(m).hf.export_config(m)


def test_fused_experts_of_the_wrong_rank_are_one_error_line(tmp_path, capsys):
    """A fused experts tensor that is not [experts, out, in] is named (Mixtral's; the
    fused spelling is read alike for both classes)."""
    from safetensors.numpy import save_file
    tiny_hf_model("mixtral").save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = np.zeros((4, 32), np.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.experts.down_proj" in err and "[experts, out, in]" in err
