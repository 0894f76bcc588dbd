"""data.pack through the training entry point: the document end resolved from the corpus
(its eot id) or data.eod_id (Megatron data), the refusals as one error line before any
device work, and a short packed run that saves the resolved config (tests/test_train.py's
subprocess helpers and corpus). The packed loss against transformers: on a GPT-2 imported
from transformers, the step's loss is transformers' mean over the counted labels (-100 on
the target after each document end) and its gradients are transformers', on one device
and at layouts of data, pipe and context (tests/test_parity.py: every kind of layout
against the single device).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, tiny_hf_model
from test_train import ONE, assert_ok, dirs, records, run_train


@pytest.fixture
def megatron_prefix(tmp_path):
    """A Megatron dataset of 40 documents over ids 0..9, each ending with eod 9."""
    from jaxptd.data import megatron
    prefix = tmp_path / "megatron" / "docs"
    prefix.parent.mkdir()
    documents = [np.append(np.arange(i % 9 + 1) % 9, 9) for i in range(40)]
    megatron.write(prefix, documents, vocab_size=10)
    return str(prefix)


def packed(*overrides: str):
    """(config, its train split) for data.pack's resolution (preflight.packing)."""
    from jaxptd.config import load_config
    from jaxptd.data import TokenDataset, resolve_corpus
    config = load_config(None, list(overrides))
    return config, TokenDataset(resolve_corpus(config.data.path), "train")


def test_packing_takes_the_corpus_eot_id_or_data_eod_id(corpus_env, megatron_prefix):
    from jaxptd.data import read_meta
    from jaxptd.runtime.preflight import packing
    _, corpus = corpus_env
    eot = read_meta(corpus)["eot_id"]
    config, train = packed(f"data.path={corpus}", "data.pack=true")
    assert packing(config, train).model.document_end == eot == 256  # the byte tokenizer's
    config, train = packed(f"data.path={corpus}", "data.pack=true",
                           f"model.document_end={eot}", f"data.eod_id={eot}")
    assert packing(config, train).model.document_end == eot  # agreeing keys are fine
    config, train = packed(f"data.path={corpus}")
    assert packing(config, train) is config  # no data.pack: rows stay one stream
    config, train = packed(f"data.path={megatron_prefix}", "data.pack=true",
                           "data.eod_id=9", "model.arch=llama")
    resolved = packing(config, train)
    assert resolved.model.document_end == 9
    assert resolved.model.arch == "llama" and resolved.data == config.data


@pytest.mark.parametrize("overrides, message", [
    (["data.eod_id=-1"], "data.pack=true: the Megatron dataset .* set data.eod_id"),
    (["data.eod_id=12"], "data.eod_id=12: the Megatron dataset .* no id above 9"),
    (["data.eod_id=9", "model.document_end=3"],
     "model.document_end=3: data.pack=true sets it to the corpus's eot id 9"),
])
def test_packing_megatron_data_refusals(megatron_prefix, overrides, message):
    from jaxptd.config import ConfigError
    from jaxptd.runtime.preflight import packing
    config, train = packed(f"data.path={megatron_prefix}", "data.pack=true", *overrides)
    with pytest.raises(ConfigError, match=message):
        packing(config, train)


@pytest.mark.parametrize("case", ["megatron without eod id", "bert", "disagreeing eot",
                                  "eod id of a directory corpus"])
def test_packing_refusals_are_one_error_line(corpus_env, megatron_prefix, tmp_path, capsys,
                                             case):
    """Through the entry point (in this process: each is refused before device work)."""
    from jaxptd.train import loop as train
    _, corpus = corpus_env
    args, named = {
        "megatron without eod id": ([f"data.path={megatron_prefix}"], "data.eod_id"),
        "bert": ([f"data.path={corpus}", "model.arch=bert", "model.vocab_size=261"],
                 "model.arch=bert"),
        "disagreeing eot": ([f"data.path={corpus}", "model.document_end=10"],
                            "model.document_end=10"),
        "eod id of a directory corpus": ([f"data.path={corpus}", "data.eod_id=3"],
                                         "data.eod_id=3"),
    }[case]
    run_dir = tmp_path / "run"
    assert train.main([*ONE, "data.pack=true", f"train.run_dir={run_dir}", *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0] and "data." in errors[0], err
    assert not run_dir.exists()  # refused before it wrote anything


@pytest.mark.slow
def test_packed_run_trains_and_saves_the_resolved_config(corpus_env, tmp_path):
    """data.pack=true: a short run logs the eot id, trains, and its config.yaml and
    checkpoint both carry model.document_end = the corpus's eot id."""
    from jaxptd.checkpoint.integrity import inspect
    from jaxptd.config import load_config
    from jaxptd.data import read_meta
    env, corpus = corpus_env
    eot = read_meta(corpus)["eot_id"]
    result = run_train(env, *ONE, "data.pack=true", "train.steps=2", "checkpoint.every=2",
                       *dirs(tmp_path, "run"))
    assert_ok(result)
    assert f"packed rows (data.pack): documents end at eot id {eot}" in result.stdout, \
        result.stdout[-3000:]
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records(tmp_path / "run") if "loss" in r)
    saved = load_config(str(tmp_path / "run" / "config.yaml"))
    assert saved.data.pack and saved.model.document_end == eot
    (step,) = inspect(str(tmp_path / "ckpt"))
    assert step["status"] == "complete"
    assert step["layout"]["config"]["model"]["document_end"] == eot


# --------------------------------------------------------------------------- the loss's mean

END = 7  # the document end of the comparison with transformers


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(transformers' tiny GPT2LMHeadModel (helpers.tiny_hf_model), its import's
    directory)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxptd.hf import bridge as hf
    model = tiny_hf_model("gpt")
    tmp = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(tmp / "hf")
    assert hf.main(["import", str(tmp / "hf"), str(tmp / "jaxptd")]) == 0
    return model, tmp / "jaxptd"


def _packed_rows(rows: int, seq: int, vocab: int, seed=0):
    """[rows, seq + 1] random ids, END at 1 to 4 random inputs of each row (at least one:
    a row's last document is then at most seq ids, all transformers' GPT-2 reads) and
    nowhere else."""
    rng = np.random.default_rng(seed)
    batch = rng.integers(0, vocab, (rows, seq + 1))
    batch[batch == END] = END + 1
    for i, row in enumerate(batch):
        row[rng.choice(seq, i % 4 + 1, replace=False)] = END
    return batch.astype(np.int32)


def transformers_loss(model, batch):
    """transformers' loss of packed rows [B, s + 1] and its gradients of the token and
    position embeddings (wte, tied to the head, and wpe). Its GPT-2 attends across a row's
    documents, so each runs as a sequence of its own (Megatron's reset attention mask and
    position ids): its inputs up to and with its end (the row's last document also the
    row's final token), labels its ids (shifted by transformers: the target after its end
    is its padding, -100), num_items_in_batch the batch's counted labels, so that the
    losses sum to transformers' mean over them (its Trainer's loss of a batch)."""
    import torch
    model.zero_grad()
    s = batch.shape[1] - 1
    counted = torch.tensor(int(np.sum(batch[:, :-1] != END)))
    total = 0.0
    for row in batch:
        ends = [i + 1 for i in np.flatnonzero(row[:s] == END)]
        for start, stop in zip([0, *ends], [*ends, s + 1]):
            ids = torch.tensor(row[None, start:stop].astype(np.int64))
            total = total + model(ids, labels=ids, num_items_in_batch=counted).loss
    total.backward()
    embed = model.transformer
    return total.item(), {"wte": embed.wte.weight.grad.numpy(),
                          "wpe": embed.wpe.weight.grad.numpy()}


def jaxptd_loss(directory, batch, overrides=()):
    """(the step's loss, its embeddings' gradients, cut to the real vocabulary) of the
    import in `directory` with packed rows (model.document_end = END) at the layout of
    `overrides` (build_grads, no dropout)."""
    from jaxptd.config import load_config
    from jaxptd.hf import bridge as hf
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup, build_grads
    config = load_config(str(directory / "config.yaml"), [
        f"model.document_end={END}", f"train.global_batch={batch.shape[0]}", *overrides])
    setup = Setup(config, make_mesh(config.parallel, jax.devices()[:config.num_devices]))
    layout = setup.state_layout
    params = jax.device_put(layout.to_stacked(hf.load_params(directory)[1]),
                            layout.state_shardings["params"])
    grads, loss, _ = jax.jit(build_grads(setup, deterministic=True))(
        params, jax.device_put(batch, setup.batch_sharding),
        jax.random.key_data(jax.random.key(0)), jnp.int32(0), jnp.float32(1))
    embed = layout.to_logical(jax.device_get(grads))["embed"]
    vocab = config.model.vocab_size
    return float(loss), {"wte": embed["wte"][:vocab], "wpe": embed["wpe"]}


@pytest.mark.parametrize("overrides", [
    [], ["parallel.data=2", "parallel.pipe=3", "parallel.microbatches=2"],  # (3 layers)
    pytest.param(["parallel.pipe=3", "parallel.context=2", "parallel.schedule=zb-h1",
                  "parallel.microbatches=4"], marks=pytest.mark.slow)],
    ids=["one device", "d2-p3-1f1b", "p3-c2-zb-h1"])
def test_packed_loss_is_transformers_mean_over_counted_labels(gpt2, overrides):
    """The step's loss of packed rows is transformers' GPT2LMHeadModel loss with labels
    -100 on the targets after document ends, the mean over the counted labels (not over
    every target: that reads low by the masked fraction), and its gradients transformers'
    (fp32: rtol 1e-5 and 1e-4)."""
    model, directory = gpt2
    seq = model.config.n_positions
    batch = _packed_rows(8, seq, model.config.vocab_size)
    expected, expected_grads = transformers_loss(model, batch)
    loss, grads = jaxptd_loss(directory, batch, overrides)
    # 140 of 160 targets counted: a mean over every target would be 12.5% lower
    assert np.sum(batch[:, :-1] != END) < 0.9 * batch.shape[0] * seq
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert_trees_close(grads, expected_grads, rtol=1e-4)


def test_packed_validation_loss_pools_the_targets_of_its_batches(megatron_prefix):
    """train.loop.evaluate over 3 packed batches (data 2) is the mean over all their
    counted targets, as one batch of all their rows on one device gives it, not the
    mean of the batches' means (which weighs a batch with more document ends more)."""
    from helpers import make_setup, placed_state, reference_loss
    from jaxptd.data import TokenDataset, resolve_corpus
    from jaxptd.train.loop import evaluate
    from jaxptd.train.step import build_eval_step
    setup = make_setup(2, 1, 1, [f"data.path={megatron_prefix}", "model.document_end=9",
                                 "train.eval_batches=3", "train.global_batch=4",
                                 "model.init_std=1.0"])  # batches' means apart: 1.5e-4
    config = setup.config
    val = TokenDataset(resolve_corpus(megatron_prefix), "train")
    state = placed_state(setup)
    pooled = evaluate(setup, build_eval_step(setup), state["params"], val)
    rows = np.concatenate([val.batch(config.train.seed, i, 4, config.model.seq_len)
                           for i in range(3)])
    params = setup.state_layout.to_logical(jax.device_get(state["params"]))
    expected = float(reference_loss(config, setup.vocab, params, rows))
    np.testing.assert_allclose(pooled, expected, rtol=2e-5)
