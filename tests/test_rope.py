"""Llama 3.1's rotary scaling (model.rope_scaling=llama3) against transformers itself: the
scaled frequencies are `ROPE_INIT_FUNCTIONS['llama3']`'s (and differ from the unscaled
ones in each of the three bands), and a tiny random LlamaForCausalLM with llama3 scaling,
read three times past its original length, imports with transformers' logits and exports
to a directory transformers loads with the same logits. Both spellings of the HF config
(`rope_parameters`, `rope_scaling`) import alike; other rope types are one error line."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import HF_VOCAB  # noqa: E402  (after the skips)
from jaxptd.hf import bridge as hf  # noqa: E402
from jaxptd import model as models  # noqa: E402
from jaxptd.arch import HF_CLASSES  # noqa: E402
from jaxptd.config import from_dict  # noqa: E402
from jaxptd.hf.names import HFError  # noqa: E402
from jaxptd.model.llama import inverse_frequencies  # noqa: E402
from jaxptd.model.tensor import Layout  # noqa: E402

# original 32, low 1, high 4: wavelengths over 32 scaled, under 8 kept, between smoothed;
# head_dim 16 at theta 500 has wavelengths 6.3 (kept), 13.7 and 29.7 (smoothed), 65 to
# 1435 (scaled): every band
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LENGTH = 96  # three times the original length


def _hf_config(**rope):
    return transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=70, vocab_size=HF_VOCAB, max_position_embeddings=LENGTH,
        rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, rope_scaling={**LLAMA3, **rope})


def _imported_config(hf_config: dict):
    return from_dict({"model": HF_CLASSES["LlamaForCausalLM"].config(hf_config)}).model


def test_llama3_frequencies_are_transformers_and_scale_each_band():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _hf_config()
    cfg = _imported_config(hf_config.to_dict())
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_seq_len) == ("llama3", 8.0, 32)
    ours = np.asarray(inverse_frequencies(cfg))
    expected = ROPE_INIT_FUNCTIONS["llama3"](hf_config)[0].numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    plain = np.asarray(inverse_frequencies(dataclasses.replace(
        cfg, rope_scaling="none", rope_factor=8.0)))
    np.testing.assert_allclose(plain, 500.0 ** -(np.arange(0, 16, 2) / 16), rtol=1e-6)
    wavelength = 2 * np.pi / plain
    kept, scaled = wavelength < 8, wavelength > 32
    between = ~kept & ~scaled
    assert kept.sum() == 1 and between.sum() == 2 and scaled.sum() == 5
    np.testing.assert_array_equal(ours[kept], plain[kept])
    np.testing.assert_allclose(ours[scaled], plain[scaled] / 8, rtol=1e-6)
    assert np.all((ours[between] < plain[between]) & (ours[between] > plain[between] / 8))


def test_both_hf_spellings_import_alike_and_other_types_are_refused():
    """transformers 5 writes rope_parameters (rope_theta inside); Llama 3.1's own
    config.json has rope_scaling beside a top-level rope_theta. Without
    original_max_position_embeddings, max_position_embeddings is the original length."""
    written = _hf_config().to_dict()
    assert "rope_parameters" in written  # what the installed transformers writes
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500.0, rope_scaling=dict(LLAMA3))
    assert _imported_config(written) == _imported_config(legacy)
    del legacy["rope_scaling"]["original_max_position_embeddings"]
    assert _imported_config(legacy).rope_original_seq_len == LENGTH
    with pytest.raises(HFError, match="rope scaling 'yarn' is not supported"):
        HF_CLASSES["LlamaForCausalLM"].config({**legacy, "rope_scaling": {"rope_type": "yarn"}})


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_import_and_export_give_transformers_logits_past_the_original_length(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config()).eval()
    model.save_pretrained(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "jaxptd")]) == 0
    config, params, _ = hf.load_params(tmp_path / "jaxptd")
    assert config.model.rope_scaling == "llama3" and config.model.seq_len == LENGTH
    tokens = np.random.default_rng(0).integers(0, HF_VOCAB, (2, LENGTH))
    expected = _torch_logits(model, tokens)
    ours = models.forward_logits(params, jnp.asarray(tokens), config.model,
                                 Layout(params["embed"]["wte"].shape[0]))
    np.testing.assert_allclose(np.asarray(ours)[..., :HF_VOCAB], expected,
                               atol=2e-6 * np.abs(expected).max())
    unscaled = models.forward_logits(params, jnp.asarray(tokens),
                                     dataclasses.replace(config.model, rope_scaling="none"),
                                     Layout(params["embed"]["wte"].shape[0]))
    assert np.abs(np.asarray(unscaled)[..., :HF_VOCAB] - expected).max() \
        > 100 * 2e-6 * np.abs(expected).max()  # the scaling is seen

    assert hf.main(["export", str(tmp_path / "jaxptd"), str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["rope_scaling"] == LLAMA3
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    np.testing.assert_array_equal(_torch_logits(reloaded, tokens), expected)
