"""Generation: greedy ids equal transformers' greedy `generate` (GPT-2 and Llama, tensor
parallel included), the KV-cache decode equals decoding without a cache, sampling draws
only what temperature, top-k and top-p allow, and the CLI prints text and ids."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import HF_VOCAB, generate_ids, make_setup, tiny_hf_model
from jaxptd import generate
from jaxptd import model as models
from jaxptd.model.tensor import Layout

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 250, 3, 99]


@pytest.mark.parametrize("kind, tensor", [pytest.param("gpt", 1, marks=pytest.mark.slow),
                                          ("llama", 2)])
def test_greedy_ids_equal_transformers_generate(kind, tensor, tmp_path):
    """Llama tensor parallel: its 2 kv heads over 2 ranks (its ffn 70 splits in 2)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxptd.hf import bridge as hf
    model = tiny_hf_model(kind)
    model.save_pretrained(tmp_path)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
    _, cfg, params = hf.load_hf(str(tmp_path))
    vocab = cfg.padded_vocab(tensor)
    ids = generate_ids(cfg, hf.pad_vocab(params, vocab), vocab, tensor, PROMPT, 12,
                       temperature=0.0)
    assert ids.tolist() == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("arch, tensor", [pytest.param("llama", 4, marks=pytest.mark.slow)])
def test_kv_cache_decode_equals_decoding_without_cache(arch, tensor):
    """Greedy ids through the cache (tensor 4; Llama's 2 kv heads replicated) equal a loop
    that reruns the training forward on the whole sequence for every token."""
    extra = ["model.arch=llama", "model.num_kv_heads=2"] if arch == "llama" else []
    setup = make_setup(1, 1, 1, ["model.num_layers=2", *extra])
    cfg = setup.config.model
    params = models.get(cfg).init_params(cfg, cfg.padded_vocab(tensor), jax.random.key(3))
    ids = generate_ids(cfg, params, cfg.padded_vocab(tensor), tensor, PROMPT, 9,
                       temperature=0.0)
    forward = jax.jit(lambda p, t: models.forward_logits(p, t, cfg, Layout(
        cfg.padded_vocab(tensor))))
    sequence = list(PROMPT)
    for _ in range(9):  # causal: the zeros after the sequence do not change its logits
        padded = jnp.asarray([sequence + [0] * (len(PROMPT) + 9 - len(sequence))])
        logits = forward(params, padded)[0, len(sequence) - 1, : cfg.vocab_size]
        sequence.append(int(jnp.argmax(logits)))
    assert ids.tolist() == sequence[len(PROMPT):]


def test_sampling_draws_only_what_is_allowed():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draw = jax.jit(lambda key, **kw: generate.sample(logits, key, **kw),
                   static_argnames=("temperature", "top_k", "top_p"))
    keys = jax.random.split(jax.random.key(0), 2000)

    def frequencies(**kw):
        ids = np.array([int(draw(k, **kw)[0]) for k in keys[:400]])
        return np.bincount(ids, minlength=4) / len(ids)

    assert frequencies(temperature=1.0, top_k=2, top_p=1.0)[2:].sum() == 0
    assert frequencies(temperature=1.0, top_k=0, top_p=0.7)[2:].sum() == 0  # 0.5 + 0.3
    assert frequencies(temperature=1.0, top_k=0, top_p=0.4).tolist() == [1, 0, 0, 0]
    assert int(draw(keys[0], temperature=0.0, top_k=0, top_p=1.0)[0]) == 0
    full = frequencies(temperature=1.0, top_k=0, top_p=1.0)
    np.testing.assert_allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.07)
    assert frequencies(temperature=0.01, top_k=0, top_p=1.0).tolist() == [1, 0, 0, 0]


@pytest.mark.slow
def test_cli_prints_text_and_ids_from_a_checkpoint(tmp_path):
    """A text prompt through the byte tokenizer of the checkpoint's data (pystdlib), and
    one-line errors."""
    pytest.importorskip("transformers")
    from jaxptd.hf import bridge as hf
    tiny_hf_model("gpt").save_pretrained(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    command = [sys.executable, "-m", "jaxptd.generate", "--checkpoint", str(tmp_path / "run"),
               "--max-new-tokens", "6", "--top-k", "20", "--seed", "1"]
    result = subprocess.run(command + ["--prompt", "def "], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    ids = json.loads(lines[-1])
    assert len(ids) == 6 and all(0 <= i < HF_VOCAB for i in ids)
    assert lines[0].startswith("def ")
    bad = subprocess.run(command + ["--prompt-ids", "1,999"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "[0, 301)" in bad.stderr
