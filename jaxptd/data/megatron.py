"""Megatron-LM indexed datasets (the `.bin`/`.idx` pair of `tools/preprocess_data.py`):
read as token splits with numpy memory maps, and written, without Megatron's code.

Byte layout of PREFIX.idx (little-endian; Megatron-LM megatron/core/datasets/
indexed_dataset.py, `_IndexWriter`/`_IndexReader`):

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       u64       version, 1
    17      u8        token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                      6 float64, 7 float32, 8 uint16
    18      u64       S, the number of sequences
    26      u64       D, the number of document indices (documents + 1)
    34      i32[S]    tokens in each sequence
    34+4S   i64[S]    byte offset of each sequence in PREFIX.bin
    34+12S  i64[D]    document indices: 0, then for each document the index one past its
                      last sequence
    (multimodal files append i8[S] sequence modes; not read here)

PREFIX.bin holds the sequences' tokens back to back in the code's dtype. Megatron's
builder writes one sequence per document (the `--append-eod` token last) unless it splits
sentences, always contiguously; the reader relies on that (each sequence starts where the
previous ends) and refuses other files.

Splits: documents keep their order; the last `val_documents(D - 1)` documents (0.5%, at
least one when there are two or more) are "val", the rest "train", so each split is one
contiguous memory-mapped range of PREFIX.bin. Megatron's own `--split` is contiguous in
the same way. A Megatron file names no tokenizer and no vocabulary: `vocab_size` is one
more than the largest id (one pass over the tokens, in chunks), `eot_id` and `tokenizer`
are None.

Writing (`write`): tokens of each document (eot included by the caller) to PREFIX.bin,
uint16 when the vocabulary fits (Megatron's choice below 65500 ids) else int32, one
sequence per document; both files appear by renames, .idx last, so a reader never sees a
half-written pair.
"""
from __future__ import annotations

import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from jaxptd.data.dataset import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
         7: np.float32, 8: np.uint16}
VAL_FRACTION = 0.005
_CHUNK = 1 << 24


class Index(NamedTuple):
    dtype: np.dtype  # token dtype of PREFIX.bin
    lengths: np.ndarray  # [S] int32 tokens per sequence
    pointers: np.ndarray  # [S] int64 byte offsets
    documents: np.ndarray  # [D] int64 sequence index boundaries


def is_prefix(path: str | Path) -> bool:
    """Whether `path` names a Megatron dataset (PREFIX.idx exists)."""
    return Path(f"{path}.idx").is_file()


def read_index(prefix: str | Path) -> Index:
    """Reads and checks PREFIX.idx against PREFIX.bin; DataError names what is wrong."""
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if not data.is_file():
        raise DataError(f"Megatron dataset {str(prefix)!r}: {str(data)!r} is missing")
    raw = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else b""
    if len(raw) < HEADER.size:
        raise DataError(f"{str(idx)!r} has {len(raw)} bytes, fewer than the 34-byte header")
    magic, version, code, count, doc_count = HEADER.unpack(bytes(raw[:HEADER.size]))
    if magic != MAGIC or version != 1:
        raise DataError(f"{str(idx)!r} is not a Megatron MMIDIDX version 1 index "
                        f"(magic {magic!r}, version {version})")
    if code not in CODES or CODES[code] in (np.float32, np.float64):
        raise DataError(f"{str(idx)!r}: token dtype code {code} is not an integer type")
    need = HEADER.size + 12 * count + 8 * doc_count
    if len(raw) < need:
        raise DataError(f"{str(idx)!r} has {len(raw)} bytes; its header needs {need}")
    offset = HEADER.size
    lengths = np.frombuffer(raw, np.int32, count, offset)
    pointers = np.frombuffer(raw, np.int64, count, offset + 4 * count)
    documents = np.frombuffer(raw, np.int64, doc_count, offset + 12 * count)
    index = Index(np.dtype(CODES[code]), lengths, pointers, documents)
    _check_layout(index, idx, data)
    return index


def _check_layout(index: Index, idx: Path, data: Path) -> None:
    """Contiguous sequences that fill PREFIX.bin; documents 0 = d_0 <= d_1 ... = S."""
    size = index.dtype.itemsize
    ends = np.cumsum(index.lengths.astype(np.int64) * size)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    if np.any(index.lengths < 0) or not np.array_equal(index.pointers, starts):
        raise DataError(f"{str(idx)!r}: sequences are not stored back to back from byte 0; "
                        "only contiguous files (as Megatron's builder writes) are read")
    total = int(ends[-1]) if len(ends) else 0
    if data.stat().st_size != total:
        raise DataError(f"{str(data)!r} has {data.stat().st_size} bytes, its index says "
                        f"{total}")
    docs = index.documents
    if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(index.lengths) or np.any(
            np.diff(docs) < 0):
        raise DataError(f"{str(idx)!r}: document indices must rise from 0 to the sequence "
                        f"count {len(index.lengths)}")


def val_documents(documents: int) -> int:
    """Documents at the end that form the val split (see the module docstring)."""
    return 0 if documents < 2 else max(1, round(documents * VAL_FRACTION))


def open_split(prefix: str | Path, split: str) -> tuple[np.ndarray, dict]:
    """(tokens [n] memmap of the split, meta dict like a prepared corpus's meta.json)."""
    index = read_index(prefix)
    docs = index.documents
    first_val = len(docs) - 1 - val_documents(len(docs) - 1)
    token_ends = np.concatenate([[0], np.cumsum(index.lengths, dtype=np.int64)])
    cut = int(token_ends[docs[first_val]])
    total = int(token_ends[-1])
    tokens = (np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r") if total
              else np.zeros(0, index.dtype))
    split_tokens = {"train": tokens[:cut], "val": tokens[cut:]}[split]
    meta = {"format": "megatron", "dtype": index.dtype.name, "tokenizer": None,
            "eot_id": None, "vocab_size": _vocab_size(str(prefix), index.dtype.name,
                                                     _stamp(prefix)),
            "train_tokens": cut, "val_tokens": total - cut, "source": str(prefix)}
    return split_tokens, meta


def _stamp(prefix) -> tuple:
    stat = os.stat(f"{prefix}.bin")
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=8)  # keyed by (prefix, stamp): the train and val splits share one pass
def _vocab_size(prefix: str, dtype: str, stamp: tuple) -> int:
    """One more than the largest token id of PREFIX.bin."""
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r") if stamp[0] else []
    largest = -1
    for begin in range(0, len(tokens), _CHUNK):
        chunk = tokens[begin:begin + _CHUNK]
        if chunk.min() < 0:
            raise DataError(f"Megatron dataset {str(prefix)!r} holds a negative token id")
        largest = max(largest, int(chunk.max()))
    return largest + 1


def write(prefix: str | Path, documents: Iterable[np.ndarray], vocab_size: int) -> dict:
    """Writes PREFIX.bin/.idx, one sequence per document; returns {'documents', 'tokens'}."""
    dtype = np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    code = next(c for c, t in CODES.items() if np.dtype(t) == dtype)
    prefix = Path(prefix)
    tmp = {ext: prefix.with_name(f".{prefix.name}.{ext}.tmp-{os.getpid()}")
           for ext in ("bin", "idx")}
    lengths = []
    try:
        with open(tmp["bin"], "wb") as handle:
            for tokens in documents:
                handle.write(np.asarray(tokens).astype(dtype).tobytes())
                lengths.append(len(tokens))
        lengths = np.asarray(lengths, np.int32)
        ends = np.cumsum(lengths.astype(np.int64) * dtype.itemsize)
        pointers = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        with open(tmp["idx"], "wb") as handle:
            handle.write(HEADER.pack(MAGIC, 1, code, len(lengths), len(lengths) + 1))
            handle.write(lengths.tobytes() + pointers.tobytes()
                         + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
        os.replace(tmp["bin"], f"{prefix}.bin")
        os.replace(tmp["idx"], f"{prefix}.idx")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return {"documents": len(lengths), "tokens": int(lengths.sum())}
