"""Tests for jaxptd.data: preparation, the val split, batches, entropy, errors, atomicity,
Hugging Face tokenizers files, and training on a BPE corpus.

References are independent of the code under test: documents are compared with the text
files they came from, the val rule is recomputed from sha256, batch rows are checked to
be windows of the token file, entropy is computed by hand, BPE token files are decoded
and re-encoded by the tokenizers library itself.
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
from jaxptd.data import corpus as prepare_module

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


def byte_stream(texts) -> np.ndarray:
    """The byte tokens of documents in order, each followed by eot."""
    return np.concatenate([np.r_[np.frombuffer(t, np.uint8).astype(np.uint16), EOT]
                           for t in texts])


def test_prepare_round_trips_bytes_and_writes_meta(tmp_path):
    src = write_texts(tmp_path / "src", TEXTS)
    out = prepare_corpus([str(src)], tmp_path / "corpus")
    meta = json.loads((Path(out) / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["eot_id"] == EOT
    assert meta["tokenizer"] == "byte" and meta["format_version"] == 1 and meta["source"]
    # No key hashes below 0.005 here: too few documents, so the last 0.5% of the tokens
    # (rounded up) are the val split and the rest, in order, the train split.
    keys = ["a.txt", "b.txt", "sub/c.txt"]
    assert min(map(hash_unit, keys)) >= 0.005
    stream = byte_stream([TEXTS[key] for key in keys])
    val_tokens = math.ceil(len(stream) * 0.005)
    train = np.fromfile(Path(out) / "train.bin", dtype=np.uint16)
    val = np.fromfile(Path(out) / "val.bin", dtype=np.uint16)
    np.testing.assert_array_equal(np.r_[train, val], stream)
    assert len(val) == val_tokens == meta["val_tokens"]
    assert meta["train_tokens"] == len(stream) - val_tokens
    assert meta["val_rule"] == prepare_module.TOKEN_RULE


def test_one_file_and_json_lines_prepare_from_the_cli(tmp_path):
    """One text file is split by tokens; JSON Lines give a document per line, split by
    key (file name and line number)."""
    book = tmp_path / "book.txt"
    book.write_bytes(b"a long single document. " * 400)
    result = run_cli("--input", book, "--output", tmp_path / "one", "--val-fraction", "0.1")
    assert result.returncode == 0, result.stderr
    assert "split by tokens" in result.stdout
    meta = read_meta(tmp_path / "one")
    assert meta["val_tokens"] == math.ceil((len(book.read_bytes()) + 1) * 0.1)
    lines = [{"text": f"document number {i}", "id": i} for i in range(60)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    result = run_cli("--input", jsonl, "--output", tmp_path / "lines", "--jsonl-key", "text",
                     "--val-fraction", "0.2")
    assert result.returncode == 0, result.stderr
    expected_val = [lines[i]["text"].encode() for i in range(60)
                    if hash_unit(f"corpus.jsonl:{i + 1}") < 0.2]
    assert 0 < len(expected_val) < 60
    assert documents_of(tmp_path / "lines", "val") == expected_val
    assert len(documents_of(tmp_path / "lines", "train")) == 60 - len(expected_val)
    raw = run_cli("--input", jsonl, "--output", tmp_path / "raw")  # no --jsonl-key
    assert raw.returncode == 0 and raw.stderr.startswith("warning: "), raw.stderr
    assert "corpus.jsonl" in raw.stderr and "--jsonl-key" in raw.stderr
    jsonl.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    assert_user_error(run_cli("--input", jsonl, "--output", tmp_path / "bad", "--jsonl-key",
                              "text"), "line 2", "'text'", "body")


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


# ------------------------------------------------------- Hugging Face tokenizers files
# Tokenizers are trained in-process (nothing is downloaded) and saved as JSON; references
# are the library itself: its decode of the stored ids and its encode of each document.

WORDS = ("the model reads tokens from files while every pipeline stage sends activations "
         "forward and gradients back; tensor ranks split heads and columns, données, "
         "größe, 東京, naïve café").split()
BPE_VOCAB = 320  # 256 byte symbols + 2 special tokens + 62 merges


def sentences(seed: int, count: int) -> str:
    rng = np.random.default_rng(seed)
    lines = (" ".join(rng.choice(WORDS, size=rng.integers(4, 12))) for _ in range(count))
    return "\n".join(lines) + "\n"


def hf_decode(hf, ids) -> str:
    return hf.decode([int(i) for i in ids], skip_special_tokens=False)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer.json path, the trained library Tokenizer): byte-level BPE, vocab 320.

    "</s>" gets id 0 and "<|endoftext|>" id 1, so the eot preference order is visible. The
    saved file also configures truncation and padding, as many model tokenizer.json files
    do; the in-memory reference keeps the library defaults (neither).
    """
    pytest.importorskip("tokenizers")  # in the dev extra; its absence is tested below
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["</s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([sentences(0, 200)], trainer)
    assert hf.get_vocab_size(with_added_tokens=True) == BPE_VOCAB
    hf.enable_truncation(16)
    hf.enable_padding(length=64)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    hf.save(str(path))
    hf.no_truncation()
    hf.no_padding()
    return path, hf


def split_at(tokens: np.ndarray, eot: int) -> list:
    """Token arrays of the documents of a split: cut at every eot, which ends each one."""
    assert len(tokens) == 0 or tokens[-1] == eot
    cuts = np.flatnonzero(tokens == eot)
    return [tokens[begin:end] for begin, end in zip(np.r_[0, cuts[:-1] + 1], cuts)]


def test_bpe_corpus_decodes_to_the_documents_with_one_eot_each(bpe, tmp_path):
    path, hf = bpe
    texts = {f"d{i}.txt": sentences(i + 1, 6) for i in range(8)}
    texts["special.txt"] = "a text about <|endoftext|> and </s> markers\n"
    texts["empty.txt"] = ""
    src = write_texts(tmp_path / "src", {key: text.encode() for key, text in texts.items()})
    result = run_cli("--input", src, "--output", tmp_path / "out", "--tokenizer",
                     os.path.relpath(path, REPO), "--val-fraction", "0.3")  # run in REPO
    assert result.returncode == 0, result.stderr
    meta = read_meta(tmp_path / "out")
    eot = hf.token_to_id("<|endoftext|>")  # preferred to "</s>", although that id is lower
    assert eot > hf.token_to_id("</s>")
    assert (meta["vocab_size"], meta["dtype"], meta["eot_id"]) == (BPE_VOCAB, "uint16", eot)
    assert meta["tokenizer"] == str(path.resolve())
    expected_val = {key for key in texts if hash_unit(key) < 0.3}
    assert 0 < len(expected_val) < len(texts)
    lengths = []
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=np.uint16)
        assert meta[f"{split}_tokens"] == len(tokens)
        documents = split_at(tokens, eot)  # the literal "<|endoftext|>" text is not an eot
        lengths += map(len, documents)
        keys = sorted(expected_val if split == "val" else set(texts) - expected_val)
        # the empty text has no tokens and so no eot (Megatron's --append-eod)
        assert sorted(hf_decode(hf, ids) for ids in documents) == \
            sorted(texts[k] for k in keys if texts[k])
        for ids in documents:  # the library's own ids, not just text that decodes right
            text = hf_decode(hf, ids)
            if "<|endoftext|>" not in text:
                assert ids.tolist() == hf.encode(text, add_special_tokens=False).ids
    assert max(lengths) > 64 and min(lengths) > 0  # the file's truncation/padding unused


def word_level(path: Path, words: int, eot_id: int) -> Path:
    """A WordLevel tokenizer file: "w<i>" -> i for i < words, "<|endoftext|>" -> eot_id."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words)} | {"<|endoftext|>": eot_id}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(path))
    return path


@pytest.mark.parametrize("words, eot_id, dtype", [(65535, 65535, "uint16"),
                                                  (70000, 70001, "uint32")])
def test_vocab_size_is_largest_id_plus_one_and_dtype_holds_it(tmp_path, words, eot_id, dtype):
    """Ids 0..words-1 and eot_id; the second file leaves id 70000 unused (a gap)."""
    tokenizer = word_level(tmp_path / "words.json", words, eot_id)
    src = write_texts(tmp_path / "src", {"a.txt": b"w1 w65534 w7\nw0", "b.txt": b"w3"})
    if words > 65536:
        (src / "b.txt").write_bytes(b"w65535 w65536 w69999")
    out = prepare_corpus([str(src)], tmp_path / "out", tokenizer=str(tokenizer),
                         val_fraction=0.0)
    meta = read_meta(out)
    assert (meta["vocab_size"], meta["dtype"], meta["eot_id"]) == (eot_id + 1, dtype, eot_id)
    expected = [[1, 65534, 7, 0], [int(word[1:]) for word in (src / "b.txt").read_text().split()]]
    assert [ids.tolist() for ids in split_at(TokenDataset(out).tokens, eot_id)] == expected


def other_tokenizer(bpe, kind: str):
    """A library Tokenizer of another kind than the byte-level ``bpe``, vocab ~200."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    _, hf = bpe
    if kind == "prepending":  # as Llama-2's tokenizer.json does
        prepending = Tokenizer.from_str(hf.to_str())
        prepending.normalizer = normalizers.Prepend("_")
        return prepending
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))  # SentencePiece-style
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                  show_progress=False)
    metaspace.train_from_iterator([sentences(0, 200)], trainer)
    return metaspace


@pytest.mark.parametrize("kind", ["byte-level", "metaspace", "prepending"])
def test_long_document_is_encoded_in_pieces_that_equal_the_whole(bpe, tmp_path, monkeypatch,
                                                                 kind):
    """Cut at spaces and newlines (byte-level), at spaces only (metaspace: a newline cut
    adds a word start), or not at all (a normalizer prepending to each text)."""
    from jaxptd.data import tokenizer as tokenizer_module

    reference = bpe[1] if kind == "byte-level" else other_tokenizer(bpe, kind)
    reference.save(str(tmp_path / "tokenizer.json"))
    text = sentences(7, 80)
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS", 500)
    monkeypatch.setattr(tokenizer_module, "_CHECK_CHARS", 50)  # check windows: <= 100 chars
    tokenizer = tokenizer_module.load_tokenizer(str(tmp_path / "tokenizer.json"))
    encoded = []

    class Spy:  # records the texts the library encodes, the last piece last
        def encode(self, piece, **kwargs):
            encoded.append(piece)
            return reference.encode(piece, **kwargs)

    tokenizer._hf = Spy()
    ids = tokenizer.encode(text.encode()).tolist()
    assert ids == reference.encode(text, add_special_tokens=False).ids
    pieces = [piece for piece in encoded[:-1] if len(piece) >= 500] + encoded[-1:]
    assert "".join(pieces) == text
    starts = {piece[0] for piece in pieces[1:]}
    if kind == "byte-level":
        assert len(pieces) > 3 and " " in starts and len(starts) > 1
    elif kind == "metaspace":
        assert len(pieces) > 3 and starts == {" "}
    else:  # every cut refused, the first rightly: a naive cut there changes the ids
        window, left = encoded[:2]
        cut = text.index(window) + len(left)
        naive = sum((reference.encode(part, add_special_tokens=False).ids
                     for part in (text[:cut], text[cut:])), [])
        assert pieces == [text] and naive != ids
        assert len(encoded) == 3 * tokenizer_module._REFUSED_CUTS + 1


def test_tokenizer_file_user_errors_are_one_line(bpe, tmp_path):
    path, _ = bpe
    src = write_texts(tmp_path / "src", TEXTS)
    bad = {"garbled.json": "{not json", "config.json": '{"model_max_length": 1024}'}
    for name, content in bad.items():
        (tmp_path / name).write_text(content)
        assert_user_error(run_cli("--input", src, "--output", tmp_path / "o", "--tokenizer",
                                  tmp_path / name), repr(str(tmp_path / name)),
                          "is not a tokenizers JSON file")
    no_eot = Path(tmp_path / "no_eot.json")
    no_eot.write_text(path.read_text().replace("<|endoftext|>", "<|x|>").replace("</s>", "<y>"))
    with pytest.raises(DataError, match=r"none of the end-of-document tokens \['<\|endoftext"):
        prepare_corpus([str(src)], tmp_path / "o", tokenizer=str(no_eot))
    # TEXTS["b.txt"] is not UTF-8: refused rather than altered (the byte tokenizer takes it)
    assert_user_error(run_cli("--input", src, "--output", tmp_path / "o", "--tokenizer", path),
                      repr(str(src / "b.txt")), "not UTF-8 text (byte 8:")
    assert not (tmp_path / "o").exists()


def test_missing_or_old_tokenizers_package_is_a_user_error(tmp_path, monkeypatch, capsys):
    """Runs whether or not tokenizers is installed: the missing and the old package are
    simulated."""
    src = write_texts(tmp_path / "src", {"a.txt": b"text"})
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    assert prepare_module.main(["--input", str(src), "--output", str(tmp_path / "o"),
                                "--tokenizer", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and "'tokenizers'" in error
    old = type(sys)("tokenizers")  # a release before encode_special_tokens (0.15.1)
    old.__version__ = "0.14.1"
    old.Tokenizer = type("Tokenizer", (), {"from_file": staticmethod(lambda spec: object())})
    monkeypatch.setitem(sys.modules, "tokenizers", old)
    with pytest.raises(DataError, match=r"tokenizers >= 0.15.1, found 0.14.1"):
        prepare_corpus([str(src)], tmp_path / "o", tokenizer=str(path))


@pytest.mark.slow
def test_train_runs_on_a_bpe_corpus_and_refuses_a_smaller_model_vocab(bpe, tmp_path, capsys):
    """`python -m jaxptd.train` on the BPE corpus with model.vocab_size = the tokenizer's
    vocab (padded to 128 x tensor 2 = 512 rows); the default 257 is refused in one line."""
    from jaxptd.train import loop as train

    path, _ = bpe
    lines = sentences(0, 200).splitlines(keepends=True)  # the tokenizer's training text
    src = write_texts(tmp_path / "src", {f"d{i}.txt": "".join(lines[i::20]).encode()
                                         for i in range(20)})
    corpus = prepare_corpus([str(src)], tmp_path / "corpus", tokenizer=str(path),
                            val_fraction=0.2)
    assert TokenDataset(corpus).tokens.max() == BPE_VOCAB - 1  # the top id is fed to the model
    overrides = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                 "model.seq_len=16", "train.global_batch=4", "parallel.data=1",
                 "parallel.tensor=2", "train.steps=3", "train.log_every=1",
                 "train.eval_every=0", "checkpoint.every=0",  # no eval compile: CI time
                 "optimizer.warmup_steps=1", f"data.path={corpus}",
                 f"train.run_dir={tmp_path / 'run'}"]
    assert train.main(overrides) == 2  # model.vocab_size left at its default, 257
    refused = capsys.readouterr().err
    assert refused.count("\n") == 1 and refused.startswith("error: model.vocab_size=257")
    assert f"corpus vocabulary {BPE_VOCAB}" in refused
    result = subprocess.run([sys.executable, "-m", "jaxptd.train", *overrides,
                             f"model.vocab_size={BPE_VOCAB}"], cwd=REPO, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle]
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    # Uniform over the tokenizer's 320 ids at init (ln 512 if the padded rows counted).
    assert losses[0] == pytest.approx(math.log(BPE_VOCAB), abs=0.2)


@pytest.mark.parametrize("fmt", ["jaxptd", "megatron"])
def test_full_disk_while_preparing_is_one_error_line_and_leaves_nothing(tmp_path, full_disk,
                                                                        fmt):
    book = tmp_path / "book.txt"
    book.write_bytes(b"many words " * 20_000)  # 220 KB of tokens, 440 KB as uint16
    result = run_cli("--input", book, "--output", full_disk / "out", "--format", fmt)
    assert_user_error(result, f"{full_disk / 'out'}: no space left on device", "free space")
    assert sorted(os.listdir(full_disk)) == ["filler"]
