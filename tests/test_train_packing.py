"""data.pack through the training entry point: the document end resolved from the corpus
(its eot id) or data.eod_id (Megatron data), the refusals as one error line before any
device work, and a short packed run that saves the resolved config (tests/test_train.py's
subprocess helpers and corpus).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

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
