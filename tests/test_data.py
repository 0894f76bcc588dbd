"""Tests for jaxptd.data: preparation, the val split, batches, entropy, errors, atomicity.

References are independent of the code under test: documents are compared with the text
files they came from, the val rule is recomputed from sha256, batch rows are checked to
be windows of the token file, entropy is computed by hand.
"""
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxptd.data import (DataError, TokenDataset, prepare_corpus, read_meta, resolve_corpus,
                         unigram_entropy)
from jaxptd.data import prepare as prepare_module

REPO = Path(__file__).resolve().parents[1]
EOT = 256


def write_texts(root: Path, texts: dict) -> Path:
    """Write {relative path: bytes} under root; returns root."""
    for rel, data in texts.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def documents_of(directory, split) -> list:
    """The byte documents of a split: the token file cut at every eot."""
    tokens = np.fromfile(Path(directory) / f"{split}.bin", dtype=np.uint16)
    if len(tokens) == 0:
        return []
    assert tokens[-1] == EOT, "every document, the last included, ends with eot"
    cuts = np.flatnonzero(tokens == EOT)
    return [tokens[begin:end].astype(np.uint8).tobytes()
            for begin, end in zip(np.r_[0, cuts[:-1] + 1], cuts)]


def hash_unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxptd.data.prepare", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO)


def assert_user_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


TEXTS = {"a.txt": "héllo wörld\n".encode(), "b.txt": b"\x00\x01binary\xff\n",
         "sub/c.txt": b"third document", "sub/ignored.md": b"not matched"}


def test_prepare_round_trips_bytes_and_writes_meta(tmp_path):
    src = write_texts(tmp_path / "src", TEXTS)
    out = prepare_corpus([str(src)], tmp_path / "corpus")
    meta = json.loads((Path(out) / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["eot_id"] == EOT
    assert meta["tokenizer"] == "byte" and meta["format_version"] == 1 and meta["source"]
    train, val = documents_of(out, "train"), documents_of(out, "val")
    expected = {TEXTS[key] for key in ("a.txt", "b.txt", "sub/c.txt")}
    assert sorted(train + val) == sorted(expected)  # whole documents, none lost or split
    # No key hashes below 0.005 here, so the smallest-hash document is the val split.
    keys = ["a.txt", "b.txt", "sub/c.txt"]
    assert min(map(hash_unit, keys)) >= 0.005
    assert val == [TEXTS[min(keys, key=hash_unit)]]
    assert meta["train_tokens"] == sum(map(len, train)) + len(train)
    assert meta["val_tokens"] == sum(map(len, val)) + len(val)


def test_val_split_follows_path_hash_and_is_stable_when_files_are_added(tmp_path):
    texts = {f"d{i:02d}.txt": f"document {i}".encode() for i in range(40)}
    src = write_texts(tmp_path / "src", texts)
    first = prepare_corpus([str(src)], tmp_path / "first", val_fraction=0.25)
    expected_val = {texts[key] for key in texts if hash_unit(key) < 0.25}
    assert 0 < len(expected_val) < len(texts)
    assert set(documents_of(first, "val")) == expected_val
    write_texts(src, {f"new/e{i}.txt": f"added {i}".encode() for i in range(20)})
    second = prepare_corpus([str(src)], tmp_path / "second", val_fraction=0.25)
    assert set(documents_of(second, "val")) & set(texts.values()) == expected_val
    assert len(documents_of(second, "train")) + len(documents_of(second, "val")) == 60


@pytest.fixture
def corpus(tmp_path):
    """A byte corpus whose train split is ~5000 distinct-ish tokens."""
    rng = np.random.default_rng(0)
    texts = {f"doc{i}.txt": rng.integers(0, 256, size=1000, dtype=np.uint8).tobytes()
             for i in range(6)}
    return prepare_corpus([str(write_texts(tmp_path / "src", texts))], tmp_path / "corpus",
                          val_fraction=0.0)


def test_batch_is_pure_and_rows_are_windows_of_the_tokens(corpus):
    dataset = TokenDataset(corpus, "train")
    tokens = np.fromfile(Path(corpus) / "train.bin", dtype=np.uint16)
    full = dataset.batch(seed=3, step=7, global_batch=8, seq_len=16)
    assert full.shape == (8, 17) and full.dtype == np.int32
    assert np.array_equal(full, TokenDataset(corpus, "train").batch(3, 7, 8, 16))
    assert not np.array_equal(full, dataset.batch(3, 8, 8, 16))
    assert not np.array_equal(full, dataset.batch(4, 7, 8, 16))
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 17)
    for row in full:
        assert (windows == row).all(axis=1).any()


def test_batch_rows_equal_rows_of_the_full_batch_and_read_only_those(corpus):
    dataset = TokenDataset(corpus, "train")
    full = dataset.batch(1, 2, 8, 16)
    for rows in (range(2, 5), slice(1, None, 2), range(0), slice(6, 8)):
        assert np.array_equal(dataset.batch(1, 2, 8, 16, rows=rows), full[rows])

    reads = []

    class CountingTokens:
        def __init__(self, array):
            self.array = array

        def __len__(self):
            return len(self.array)

        def __getitem__(self, index):
            reads.append(index)
            return self.array[index]

    dataset.tokens = CountingTokens(dataset.tokens)
    dataset.batch(1, 2, 8, 16, rows=range(4, 6))
    assert len(reads) == 2
    with pytest.raises(DataError, match="global_batch=8"):
        dataset.batch(1, 2, 8, 16, rows=range(6, 9))


def test_short_split_and_missing_val_raise_data_error(corpus):
    train = TokenDataset(corpus, "train")
    with pytest.raises(DataError, match=r"seq_len=6006 needs at least"):
        train.batch(0, 0, 2, len(train))
    train.batch(0, 0, 2, len(train) - 1)  # exactly seq_len + 1 tokens is enough
    val = TokenDataset(corpus, "val")  # val_fraction=0: an empty split
    with pytest.raises(DataError, match="'val'.* 0 tokens"):
        val.batch(0, 0, 1, 4)
    with pytest.raises(DataError, match="split='test'"):
        TokenDataset(corpus, "test")


def test_unigram_entropy_matches_hand_computed_value(tmp_path):
    src = write_texts(tmp_path / "src", {"x.txt": b"aab", "y.txt": b"ab"})
    corpus = prepare_corpus([str(src)], tmp_path / "corpus", val_fraction=0.0)
    # tokens a a b eot a b eot: p(a)=3/7, p(b)=2/7, p(eot)=2/7
    expected = -(3 / 7 * math.log(3 / 7) + 2 * (2 / 7) * math.log(2 / 7))
    assert unigram_entropy(corpus) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(DataError, match="empty"):
        unigram_entropy(corpus, "val")


def test_cli_prepares_and_refuses_an_existing_corpus(tmp_path):
    src = write_texts(tmp_path / "src", TEXTS)
    result = run_cli("--input", src, "--output", tmp_path / "out", "--val-fraction", "0.5")
    assert result.returncode == 0, result.stderr
    assert "prepared" in result.stdout
    assert read_meta(tmp_path / "out")["train_tokens"] > 0
    again = run_cli("--input", src, "--output", tmp_path / "out")
    assert_user_error(again, str(tmp_path / "out"), "already holds a prepared corpus")


def test_cli_user_errors_exit_2_with_one_line(tmp_path):
    src = write_texts(tmp_path / "src", TEXTS)
    assert_user_error(run_cli("--input", tmp_path / "nope", "--output", tmp_path / "o"),
                      str(tmp_path / "nope"), "does not exist")
    assert_user_error(run_cli("--input", src, "--output", tmp_path / "o", "--glob", "*.rst"),
                      "'*.rst'", "no files matching")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert_user_error(run_cli("--input", src, "--output", blocker / "corpus"),
                      str(blocker / "corpus"), "not writable")
    assert_user_error(run_cli("--input", src, "--output", tmp_path / "o",
                              "--val-fraction", "1.5"), "1.5", "[0, 1)")


@pytest.mark.skipif(__import__("importlib").util.find_spec("tokenizers") is not None,
                    reason="tokenizers is installed")
def test_cli_tokenizer_without_package_names_it(tmp_path):
    src = write_texts(tmp_path / "src", TEXTS)
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")
    assert_user_error(run_cli("--input", src, "--output", tmp_path / "o", "--tokenizer",
                              tokenizer), "'tokenizers'")


def test_resolve_corpus_rejects_bad_paths(corpus, tmp_path):
    assert resolve_corpus(corpus) == corpus
    assert resolve_corpus(str(Path(corpus) / "meta.json")) == corpus
    with pytest.raises(DataError, match="does not exist"):
        resolve_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no meta.json"):
        resolve_corpus(str(tmp_path / "empty"))
    (tmp_path / "empty" / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not readable JSON"):
        resolve_corpus(str(tmp_path / "empty"))
    with open(Path(corpus) / "train.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(DataError, match="train.bin.* re-prepare"):
        TokenDataset(corpus)


def test_interrupted_prepare_leaves_nothing_and_stale_staging_is_ignored(tmp_path,
                                                                         monkeypatch):
    src = write_texts(tmp_path / "src", TEXTS)

    def killed(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "_write_splits", killed)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus([str(src)], tmp_path / "out")
    assert os.listdir(tmp_path) == ["src"]
    # A SIGKILLed prepare leaves its staging directory; the cache lookup must ignore it.
    monkeypatch.setenv("JAXPTD_CACHE", str(tmp_path / "cache"))
    stale = write_texts(tmp_path / "cache" / ".pystdlib-py.tmp-dead",
                        {"train.bin": b"\x01\x00", "meta.json": b"{}"})
    directory = resolve_corpus("pystdlib")
    assert read_meta(directory)["train_tokens"] > 0 and stale.is_dir()


def test_losing_a_concurrent_prepare_keeps_the_winner(tmp_path, monkeypatch):
    src = write_texts(tmp_path / "src", TEXTS)
    winner_src = write_texts(tmp_path / "winner", {"w.txt": b"winner", "v.txt": b"v"})
    write_splits = prepare_module._write_splits

    def race(*args):  # another process publishes the same output mid-way
        with monkeypatch.context() as patch:
            patch.setattr(prepare_module, "_write_splits", write_splits)
            prepare_corpus([str(winner_src)], tmp_path / "out", val_fraction=0.0)
        return write_splits(*args)

    monkeypatch.setattr(prepare_module, "_write_splits", race)
    assert prepare_corpus([str(src)], tmp_path / "out") == str(tmp_path / "out")
    assert sorted(documents_of(tmp_path / "out", "train") +
                  documents_of(tmp_path / "out", "val")) == [b"v", b"winner"]
    assert sorted(os.listdir(tmp_path)) == ["out", "src", "winner"]


def test_pystdlib_corpus_is_prepared_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPTD_CACHE", str(tmp_path))
    directory = resolve_corpus("pystdlib")
    assert Path(directory).parent == tmp_path and "pystdlib-py3." in directory
    meta = read_meta(directory)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257
    assert 1_000_000 < meta["train_tokens"] < 40_000_000 and meta["val_documents"] > 0
    assert b"def " in documents_of(directory, "val")[0] + documents_of(directory, "train")[0]
    stamp = os.stat(Path(directory) / "train.bin").st_mtime_ns
    assert resolve_corpus("pystdlib") == directory
    assert os.stat(Path(directory) / "train.bin").st_mtime_ns == stamp
    assert 2.0 < unigram_entropy(directory) < math.log(257)
