"""Megatron-LM indexed datasets: our writer and reader round-trip, a file built by hand
from the published byte layout reads, and broken files are one-line user errors."""
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxptd.data import DataError, TokenDataset, resolve_corpus, unigram_entropy
from jaxptd.data import megatron

REPO = Path(__file__).resolve().parents[1]
EOT = 256


def hand_built(prefix: Path, code: int, dtype, sequences: list, documents: list) -> None:
    """PREFIX.bin/.idx written from the layout in Megatron-LM's indexed_dataset.py, with no
    code of ours: header, int32 lengths, int64 byte pointers, int64 document indices."""
    data = b"".join(np.asarray(seq, dtype).tobytes() for seq in sequences)
    prefix.with_suffix(".bin").write_bytes(data)
    itemsize = np.dtype(dtype).itemsize
    pointers, offset = [], 0
    for seq in sequences:
        pointers.append(offset)
        offset += len(seq) * itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(documents))
    idx += struct.pack(f"<{len(sequences)}i", *map(len, sequences))
    idx += struct.pack(f"<{len(sequences)}q", *pointers)
    idx += struct.pack(f"<{len(documents)}q", *documents)
    prefix.with_suffix(".idx").write_bytes(idx)


def test_hand_built_file_reads_with_its_document_split(tmp_path):
    """int32 tokens (code 4), the third document split into two sentences (sequences):
    the last document is val, the rest train, in file order."""
    sequences = [[5, 6, 7, 70000], [8, 9], [10, 11, 12], [13], [1, 2, 3, 4, 5]]
    prefix = tmp_path / "hand"
    hand_built(prefix, 4, np.int32, sequences, [0, 1, 2, 4, 5])
    assert resolve_corpus(str(prefix)) == str(prefix)
    train, val = TokenDataset(prefix, "train"), TokenDataset(prefix, "val")
    assert train.tokens.tolist() == [5, 6, 7, 70000, 8, 9, 10, 11, 12, 13]
    assert val.tokens.tolist() == [1, 2, 3, 4, 5]
    assert train.vocab_size == 70001 and train.eot_id is None
    rows = train.batch(seed=3, step=1, global_batch=4, seq_len=3)
    flat = train.tokens.tolist()
    for row in rows.tolist():  # every row is a window of the train tokens
        assert any(flat[i:i + 4] == row for i in range(len(flat) - 3))
    counts = np.bincount([1, 2, 3, 4, 5])[1:] / 5
    assert unigram_entropy(prefix, "val") == pytest.approx(-(counts * np.log(counts)).sum())


def test_writer_and_reader_round_trip(tmp_path):
    """prepare --format megatron: one uint16 sequence per document with its eot, in input
    order; the bytes agree with the hand-built layout and the reader gives them back."""
    texts = {"a.txt": b"first doc", "b.txt": "zw\xc3\xb6lf".encode("latin-1"), "c.txt": b"x"}
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
    prefix = tmp_path / "out" / "corpus"
    prefix.parent.mkdir()
    result = subprocess.run([sys.executable, "-m", "jaxptd.data.prepare", "--input",
                             str(tmp_path), "--output", str(prefix), "--format", "megatron"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    docs = [list(data) + [EOT] for data in texts.values()]
    hand_built(tmp_path / "expected", 8, np.uint16, docs, [0, 1, 2, 3])
    for ext in (".bin", ".idx"):
        assert (prefix.parent / f"corpus{ext}").read_bytes() == \
            (tmp_path / f"expected{ext}").read_bytes()
    train, val = TokenDataset(prefix, "train"), TokenDataset(prefix, "val")
    assert train.tokens.tolist() + val.tokens.tolist() == sum(docs, [])
    assert val.tokens.tolist() == docs[-1] and train.vocab_size == EOT + 1
    again = subprocess.run([sys.executable, "-m", "jaxptd.data.prepare", "--input",
                            str(tmp_path), "--output", str(prefix), "--format", "megatron"],
                           cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("error: ")
    assert len(again.stderr.strip().splitlines()) == 1


def prepare_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxptd.data.prepare", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True)


def test_empty_texts_are_empty_documents_as_megatron_writes_them(tmp_path):
    """preprocess_data.py appends the eod only to a document with tokens, and the builder
    records an empty document as a repeated document index with no sequence. The output
    directory is created as for the default format; the jaxptd format holds the same
    tokens (no lone eot either)."""
    texts = {"a.txt": b"ab", "b.txt": b"", "c.txt": b"c", "d.txt": b""}
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
    prefix = tmp_path / "new" / "dir" / "corpus"  # no parent yet
    result = prepare_cli("--input", tmp_path, "--output", prefix, "--format", "megatron")
    assert result.returncode == 0, result.stderr
    assert "4 documents" in result.stdout, result.stdout
    hand_built(tmp_path / "expected", 8, np.uint16, [[97, 98, EOT], [99, EOT]], [0, 1, 1, 2, 2])
    for ext in (".bin", ".idx"):
        assert prefix.with_suffix(ext).read_bytes() == \
            (tmp_path / f"expected{ext}").read_bytes()
    result = prepare_cli("--input", tmp_path, "--output", tmp_path / "own")
    assert result.returncode == 0, result.stderr
    own = [np.fromfile(tmp_path / "own" / f"{s}.bin", np.uint16) for s in ("train", "val")]
    assert np.concatenate(own).tolist() == [97, 98, EOT, 99, EOT]


def test_empty_last_documents_split_by_tokens(tmp_path):
    """The last 0.5% of the documents (2 of 300) are empty: the documents' split would
    leave val without a token, so the last 0.5% of the tokens are val instead."""
    sequences = [[i % 250, EOT] for i in range(298)]
    prefix = tmp_path / "tail"
    hand_built(prefix, 8, np.uint16, sequences, list(range(299)) + [298, 298])
    train, val = TokenDataset(prefix, "train"), TokenDataset(prefix, "val")
    total = 2 * 298
    assert len(val) == math.ceil(total * 0.005) and len(train) + len(val) == total
    assert val.tokens.tolist() == sum(sequences, [])[-len(val):]
    assert "tokens" in val.meta["val_rule"]
    single = tmp_path / "single"  # one document: no document for val at all
    hand_built(single, 8, np.uint16, [list(range(400))], [0, 1])
    assert len(TokenDataset(single, "val")) == 2


def test_changed_dtype_code_names_the_dtypes(tmp_path):
    prefix = tmp_path / "d"
    hand_built(prefix, 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    raw = bytearray(prefix.with_suffix(".idx").read_bytes())
    raw[17] = 4  # uint16 -> int32
    prefix.with_suffix(".idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"dtype code 4 says int32.* say 2: int16 \(code 3\)"
                                        r" or uint16 \(code 8\)") as raised:
        resolve_corpus(str(prefix))
    assert "back to back" not in str(raised.value)


def test_prefix_without_idx_names_the_idx(tmp_path):
    prefix = tmp_path / "d"
    hand_built(prefix, 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    prefix.with_suffix(".idx").unlink()
    with pytest.raises(DataError, match=r"d.idx' is missing beside") as raised:
        resolve_corpus(str(prefix))
    assert "meta.json" not in str(raised.value)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40)),
     "version 1"),
    (lambda p: p.with_suffix(".bin").write_bytes(b"\x00" * 3), "its index says"),
    (lambda p: p.with_suffix(".bin").unlink(), "is missing"),
    (lambda p: hand_built(p, 8, np.uint16, [[1, 2], [3]], [0, 2, 1]), "document indices"),
    (lambda p: hand_built(p, 7, np.float32, [[1.0]], [0, 1]), "not an integer type"),
])
def test_broken_files_are_user_errors(tmp_path, damage, message):
    prefix = tmp_path / "d"
    hand_built(prefix, 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    damage(prefix)
    with pytest.raises(DataError, match=message):
        resolve_corpus(str(prefix))


def test_non_contiguous_sequences_are_refused(tmp_path):
    prefix = tmp_path / "gap"
    hand_built(prefix, 8, np.uint16, [[1, 2], [3]], [0, 1, 2])
    raw = bytearray(prefix.with_suffix(".idx").read_bytes())
    struct.pack_into("<q", raw, 34 + 2 * 4 + 8, 6)  # second pointer 4 -> 6
    prefix.with_suffix(".idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="back to back"):
        megatron.read_index(prefix)
