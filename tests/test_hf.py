"""The Hugging Face bridge against transformers itself, live: tiny random GPT-2 and Llama
models (odd sizes, grouped-query attention, several layers) imported give transformers'
logits and loss; exported, they load in transformers and round-trip every value; training
resumes from an import at another layout; bad input is one error line."""
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402  (after the skips)

from helpers import (HF_VOCAB, assert_trees_close, damage, reference_loss,  # noqa: E402
                     tiny_hf_model, torch_logits, train_a_step_from_import)
from jaxptd import generate
from jaxptd.hf import bridge as hf  # noqa: E402
from jaxptd.config import Config  # noqa: E402
from jaxptd import model as models  # noqa: E402
from jaxptd.data import TokenDataset  # noqa: E402
from jaxptd.model.tensor import Layout  # noqa: E402

VOCAB = HF_VOCAB


@pytest.fixture(scope="module", params=["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def imported(request, tmp_path_factory):
    """(kind, transformers model, its directory, the import's directory)."""
    model = tiny_hf_model(request.param)
    tmp = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(tmp / "hf")
    assert hf.main(["import", str(tmp / "hf"), str(tmp / "jaxptd")]) == 0
    return request.param, model, tmp / "hf", tmp / "jaxptd"


def test_import_gives_transformers_logits_and_loss(imported):
    _, model, _, out = imported
    config, params, step = hf.load_params(out)
    config = config.model
    assert step == 0
    batch = np.random.default_rng(1).integers(0, VOCAB, (3, config.seq_len + 1))
    vocab = params["embed"]["wte"].shape[0]
    ours = models.forward_logits(params, jnp.asarray(batch[:, :-1]), config, Layout(vocab))
    expected = torch_logits(model, batch[:, :-1])
    np.testing.assert_allclose(np.asarray(ours)[..., :VOCAB], expected,
                               atol=2e-6 * np.abs(expected).max())
    # GPT-2 reads at most n_positions = seq_len tokens: its loss from its logits by torch
    hf_loss = torch.nn.functional.cross_entropy(
        torch.tensor(expected).reshape(-1, VOCAB), torch.tensor(batch[:, 1:]).reshape(-1)).item()
    loss = reference_loss(Config(model=config), vocab, params, batch)
    np.testing.assert_allclose(float(loss), hf_loss, rtol=1e-6)


def test_export_round_trips_every_value(imported, tmp_path):
    kind, model, hf_dir, out = imported
    assert hf.main(["export", str(out), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    original = load_file(hf_dir / "model.safetensors")
    tied = {"lm_head.weight"} if kind == "gpt" else set()  # GPT-2 ties it to wte
    assert set(exported) == set(original) - tied
    for name, value in original.items():
        if name in exported:
            np.testing.assert_array_equal(exported[name], value, err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 11))
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(model, tokens))
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "again")]) == 0
    assert_trees_close(hf.load_params(tmp_path / "again")[1], hf.load_params(out)[1], rtol=0)


@pytest.mark.slow
def test_training_resumes_from_an_import_at_another_layout(imported, tmp_path):
    """The Llama import (kv heads 2, tensor 2, pipe 3) fine-tunes: the first step's loss is
    transformers' loss on the same batch."""
    kind, model, _, out = imported
    if kind != "llama":
        pytest.skip("one architecture is enough: the restore path does not depend on it")
    corpus, record = train_a_step_from_import(out, tmp_path, [
        "parallel.pipe=3", "parallel.tensor=2", "parallel.microbatches=2", "model.seq_len=16",
        "train.global_batch=4"])
    batch = TokenDataset(corpus, "train").batch(0, 0, 4, 16).astype(np.int64)
    with torch.no_grad():
        expected = model(torch.tensor(batch), labels=torch.tensor(batch)).loss.item()
    np.testing.assert_allclose(record["loss"], expected, rtol=1e-5)


@pytest.mark.slow
def test_copied_run_directory_reads_its_own_steps_and_records_stay(imported, tmp_path,
                                                                    capsys):
    """A fine-tune in an import's directory keeps the import's record (starts/import.yaml)
    and step 0's; a copy of that run directory holding only the older step 0 exports,
    inspects and generates from its own step 0, not the original's newer step 1."""
    from jaxptd.checkpoint import __main__ as checkpoint_cli
    from jaxptd.checkpoint.files import read_layout
    kind, _, hf_dir, out = imported
    if kind != "gpt":
        pytest.skip("one architecture is enough: run directories do not depend on it")
    step0 = read_layout(str(out / "checkpoints" / "0"))
    train_a_step_from_import(out, tmp_path, ["train.global_batch=4",
                                             "checkpoint.every=1"])
    run = tmp_path / "run"
    assert (run / "starts" / "import.yaml").read_text() == (out / "config.yaml").read_text()
    starts = sorted(p.name for p in (run / "starts").iterdir())
    assert len(starts) == 2 and starts[0].startswith("0-"), starts
    assert (run / "starts" / starts[0]).read_text() == (run / "config.yaml").read_text()
    assert read_layout(str(run / "checkpoints" / "0")) == step0
    assert sorted(os.listdir(run / "checkpoints")) == ["0", "1"]

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "1")
    capsys.readouterr()
    assert hf.main(["export", str(copy), str(tmp_path / "exported")]) == 0
    assert f"step 0 of {copy}" in capsys.readouterr().out
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    original = load_file(hf_dir / "model.safetensors")  # step 0 is the import's weights
    for name, value in exported.items():
        np.testing.assert_array_equal(value, original[name], err_msg=name)
    assert checkpoint_cli.main(["inspect", str(copy)]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(f"{copy / 'checkpoints'}: 1 step directory"), listing
    assert generate.main(["--checkpoint", str(copy), "--prompt-ids", "1,2",
                          "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_config(d, architectures=["T5ForConditionalGeneration"]), "is not supported"),
    (lambda d: os.remove(d / "model.safetensors"), "no *.safetensors"),
    (lambda d: _edit_config(d, n_inner=40, intermediate_size=40), "has shape"),
    (lambda d: os.remove(d / "config.json"), "no config.json"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["'), "not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "not a JSON object"),
    (lambda d: _edit_config(d, remove=("n_layer", "num_hidden_layers")), "config.json has no"),
    (lambda d: damage(d / "model.safetensors", "truncate"), "not a readable safetensors"),
    (lambda d: damage(d / "model.safetensors", "empty"), "not a readable safetensors"),
])
def test_bad_input_is_one_error_line(imported, tmp_path, capsys, damage, message):
    """In `hf import` and in `generate --hf`, which reads the same way."""
    _, _, hf_dir, _ = imported
    shutil.copytree(hf_dir, tmp_path / "hf")
    damage(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    _one_error_line(capsys, message)
    assert not (tmp_path / "out").exists()
    assert generate.main(["--hf", str(tmp_path / "hf"), "--prompt-ids", "1"]) == 2
    _one_error_line(capsys, message)
    assert hf.main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'nothing'}: no such file or directory" in capsys.readouterr().err
    assert generate.main(["--checkpoint", str(tmp_path / "nothing"), "--prompt-ids", "1"]) == 2
    assert f"{tmp_path / 'nothing'}: no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert hf.main(["export", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "no complete checkpoint steps" in capsys.readouterr().err


def test_unwritable_output_is_one_error_line(imported, tmp_path, capsys, monkeypatch):
    """A file where the output directory should be, a file above it, a read-only file
    system (injected: root writes through a read-only mode), a directory not writable."""
    kind, _, hf_dir, out = imported
    if kind != "gpt":
        pytest.skip("the output handling does not depend on the architecture")
    (tmp_path / "file").write_text("a file")
    for command in (["export", str(out)], ["import", str(hf_dir)]):
        assert hf.main([*command, str(tmp_path / "file")]) == 2
        _one_error_line(capsys, str(tmp_path / "file"), "is a file")
        assert hf.main([*command, str(tmp_path / "file" / "below")]) == 2
        _one_error_line(capsys, str(tmp_path / "file"), "is a file")
    assert (tmp_path / "file").read_text() == "a file"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert hf.main(["export", str(out), str(tmp_path / "ro" / "hf")]) == 2
    _one_error_line(capsys, str(tmp_path / "ro"), "read-only file system", "writable")
    monkeypatch.undo()
    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "locked")
    assert hf.main(["export", str(out), str(tmp_path / "locked"), "--overwrite"]) == 2
    _one_error_line(capsys, str(tmp_path / "locked"), "not writable")
    assert sorted(os.listdir(tmp_path)) == ["file", "locked", "ro"]


def _edit_config(directory, remove=(), **changes):
    """Changes the keys config.json has (and `architectures`), removes those in `remove`."""
    config = json.loads((directory / "config.json").read_text())
    config.update({k: v for k, v in changes.items() if k in config or k == "architectures"})
    config = {k: v for k, v in config.items() if k not in remove}
    (directory / "config.json").write_text(json.dumps(config))


def _one_error_line(capsys, *words):
    """The one `error:` line on stderr, which names each of `words`."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def test_export_refuses_a_non_empty_directory_and_overwrite_replaces_it(imported, tmp_path,
                                                                        capsys):
    """Into a directory holding another model: refused, nothing touched. With --overwrite
    the directory holds exactly the new set, at the modes the umask gives (files and
    directory alike), nothing left beside it; never over the checkpoint being read."""
    kind, model, _, out = imported
    if kind != "gpt":
        pytest.skip("the directory handling does not depend on the architecture")
    target = tmp_path / "target"
    target.mkdir()
    foreign = ("config.json", "model.safetensors", "generation_config.json")
    for name in foreign:
        (target / name).write_text("another model")
    assert hf.main(["export", str(out), str(target)]) == 2
    _one_error_line(capsys, str(target), "--overwrite")
    assert all((target / name).read_text() == "another model" for name in foreign)
    umask = os.umask(0o027)
    try:
        assert hf.main(["export", str(out), str(target), "--overwrite"]) == 0
    finally:
        os.umask(umask)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert {stat.S_IMODE((target / name).stat().st_mode) for name in os.listdir(target)} \
        == {0o640}
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert os.listdir(tmp_path) == ["target"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 11))
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(model, tokens))
    capsys.readouterr()  # transformers' progress bars
    (tmp_path / "empty").mkdir()
    assert hf.main(["export", str(out), str(tmp_path / "empty")]) == 0
    for source in (out, out / "checkpoints"):
        assert hf.main(["export", str(source), str(out), "--overwrite"]) == 2
        _one_error_line(capsys, str(out))
    assert hf.load_params(out)[2] == 0


def test_import_refuses_an_existing_directory_and_overwrite_replaces_it(imported, tmp_path,
                                                                        capsys):
    """A second import into a directory refuses before writing anything; --overwrite
    replaces the whole directory (a run's leftovers gone), its config and checkpoint one
    consistent set."""
    import yaml

    kind, _, hf_dir, _ = imported
    if kind != "gpt":
        pytest.skip("the directory handling does not depend on the architecture")
    run = tmp_path / "run"
    assert hf.main(["import", str(hf_dir), str(run)]) == 0
    (run / "metrics.jsonl").write_text("{}\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert hf.main(["import", str(hf_dir), str(run)]) == 2
    _one_error_line(capsys, str(run), "--overwrite")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert hf.main(["import", str(hf_dir), str(run), "--overwrite"]) == 0
    assert sorted(os.listdir(run)) == ["checkpoints", "config.yaml", "starts"]
    assert os.listdir(tmp_path) == ["run"]
    config, _, step = hf.load_params(run)
    assert step == 0 and yaml.safe_load((run / "config.yaml").read_text())["checkpoint"] == {
        "dir": str(run / "checkpoints")} == {"dir": config.checkpoint.dir}
    assert hf.main(["import", str(hf_dir), str(hf_dir), "--overwrite"]) == 2
    _one_error_line(capsys, str(hf_dir))
    assert (hf_dir / "config.json").is_file()


def test_unexpected_or_missing_tensors_are_named(imported, tmp_path, capsys):
    """Nothing in the safetensors files is dropped without a word: 3 layers' weights under
    a 2-layer config.json, a stray layer, a missing tensor or an untied copy of the tied
    output layer are one error line naming them; the buffers transformers keeps beside
    the weights (GPT-2's causal masks) are not weights and import."""
    from safetensors.numpy import save_file

    kind, _, hf_dir, _ = imported
    if kind != "gpt":
        pytest.skip("the check does not depend on the architecture")
    original = load_file(hf_dir / "model.safetensors")

    def attempt(name, tensors, **config):
        directory = tmp_path / name
        shutil.copytree(hf_dir, directory)
        save_file(tensors, directory / "model.safetensors")
        _edit_config(directory, **config)
        return hf.main(["import", str(directory), str(tmp_path / f"{name}-out")])

    assert attempt("two", original, n_layer=2) == 2
    _one_error_line(capsys, "does not have", "transformer.h.2.attn.c_attn.weight")
    stray = {**original, "transformer.h.9.mlp.c_fc.bias": original["transformer.h.0.mlp.c_fc.bias"]}
    assert attempt("stray", stray) == 2
    _one_error_line(capsys, "does not have", "transformer.h.9.mlp.c_fc.bias")
    missing = {k: v for k, v in original.items() if k != "transformer.h.1.ln_2.bias"}
    assert attempt("missing", missing) == 2
    _one_error_line(capsys, "lack", "transformer.h.1.ln_2.bias")
    untied = {**original, "lm_head.weight": original["transformer.wte.weight"] + 1}
    assert attempt("untied", untied) == 2
    _one_error_line(capsys, "lm_head.weight", "transformer.wte.weight")
    buffers = {**original, "lm_head.weight": original["transformer.wte.weight"],
               **{f"transformer.h.{i}.attn.bias": np.ones((1, 1, 20, 20), np.float32)
                  for i in range(3)}}
    assert attempt("buffers", buffers) == 0


@pytest.mark.slow
def test_gpt2_with_the_exact_gelu_round_trips(tmp_path):
    """activation_function=gelu (erf, not GPT-2's tanh) imports as model.gelu=erf with
    transformers' logits, and exports as it came."""
    source = tiny_hf_model("gpt")
    source.config.activation_function = "gelu"
    model = transformers.GPT2LMHeadModel(source.config).eval()
    model.load_state_dict(source.state_dict())
    model.save_pretrained(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    config, params, _ = hf.load_params(tmp_path / "out")
    assert config.model.gelu == "erf"
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, config.model.seq_len))
    ours = models.forward_logits(params, jnp.asarray(tokens), config.model,
                                 Layout(params["embed"]["wte"].shape[0]))
    expected = torch_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(ours)[..., :VOCAB], expected,
                               atol=2e-6 * np.abs(expected).max())
    assert hf.main(["export", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())[
        "activation_function"] == "gelu"
