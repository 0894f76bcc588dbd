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
previous ends) and refuses other files. A document whose text has no tokens is empty: no
sequence and no eod (`preprocess_data.py` appends the eod only to a non-empty document),
its document index equal to the previous one. A .bin whose size per token disagrees with
the dtype code is reported as a wrong dtype code, naming the dtypes that would fit.

Splits: documents keep their order; the last `val_documents(D - 1)` documents (0.5%, at
least one when there are two or more) are "val", the rest "train", so each split is one
contiguous memory-mapped range of PREFIX.bin. Megatron's own `--split` is contiguous in
the same way. When that leaves a split without tokens (one document, or empty documents
at the end), the split is by tokens instead, as `prepare` does for a jaxptd corpus: the
last 0.5% of the tokens (splits.val_tail) are "val". A Megatron file names no tokenizer
and no vocabulary: `vocab_size` is one more than the largest id (one pass over the
tokens, in chunks), `eot_id` and `tokenizer` are None (packed rows take the eod id from
the config's data.eod_id).

Writing (`write`): tokens of each document (eot included by the caller, none for an empty
one) to PREFIX.bin, uint16 when the vocabulary fits (Megatron's choice below 65500 ids)
else int32, one sequence per non-empty document; both files appear by renames, .idx last,
so a reader never sees a half-written pair. The bytes equal those Megatron-LM's
`IndexedDatasetBuilder` writes for the same documents (tests/test_megatron_data.py).
"""
from __future__ import annotations

import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from jaxptd.data.errors import DataError
from jaxptd.data.splits import val_tail

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
         7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(t): c for c, t in CODES.items()}
VAL_FRACTION = 0.005
_CHUNK = 1 << 24


class Index(NamedTuple):
    dtype: np.dtype  # token dtype of PREFIX.bin
    lengths: np.ndarray  # [S] int32 tokens per sequence
    pointers: np.ndarray  # [S] int64 byte offsets
    documents: np.ndarray  # [D] int64 sequence index boundaries


def is_prefix(path: str | Path) -> bool:
    """Whether `path` names a Megatron dataset (PREFIX.idx or PREFIX.bin exists)."""
    return Path(f"{path}.idx").is_file() or Path(f"{path}.bin").is_file()


def read_index(prefix: str | Path) -> Index:
    """Reads and checks PREFIX.idx against PREFIX.bin; DataError names what is wrong."""
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for present, missing in ((idx, data), (data, idx)):
        if not missing.is_file():
            raise DataError(f"Megatron dataset {str(prefix)!r}: {str(missing)!r} is missing "
                            f"beside {str(present)!r}")
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
    _check_dtype(index, idx, data)
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


def _check_dtype(index: Index, idx: Path, data: Path) -> None:
    """The dtype code against the bytes a token that the pointers (written as the
    lengths times the item size) and the .bin's size both give: when they agree with each
    other and not with the code, the code is wrong (changed, or the .idx of another
    .bin), not the layout."""
    lengths = index.lengths.astype(np.int64)
    tokens, size = int(lengths.sum()), data.stat().st_size
    before_last = int(lengths[:-1].sum())  # tokens before the last pointer
    if before_last and int(index.pointers[-1]) % before_last == 0:
        per_token = int(index.pointers[-1]) // before_last
    elif tokens and size % tokens == 0:  # one sequence: its pointer is 0
        per_token = size // tokens
    else:
        return
    if per_token == index.dtype.itemsize or size != tokens * per_token:
        return
    fits = [f"{np.dtype(t).name} (code {c})" for c, t in CODES.items()
            if np.dtype(t).itemsize == per_token and np.dtype(t).kind in "iu"]
    raise DataError(f"{str(idx)!r}: dtype code {CODE_OF[index.dtype]} says "
                    f"{index.dtype.name}, {index.dtype.itemsize} byte(s) a token, but its "
                    f"pointers and {str(data)!r} ({size} bytes for {tokens} tokens) say "
                    f"{per_token}" + (f": {' or '.join(fits)}" if fits else "")
                    + "; the dtype code does not belong to this .bin")


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
    rule = "the last 0.5% of the documents"
    if total >= 2 and not 0 < cut < total:  # a split without tokens: split by tokens
        cut = total - val_tail(total, VAL_FRACTION)
        rule = "the last 0.5% of the tokens (the documents' split leaves a split empty)"
    tokens = (np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r") if total
              else np.zeros(0, index.dtype))
    split_tokens = {"train": tokens[:cut], "val": tokens[cut:]}[split]
    meta = {"format": "megatron", "dtype": index.dtype.name, "tokenizer": None,
            "eot_id": None, "vocab_size": _vocab_size(str(prefix), index.dtype.name,
                                                     _stamp(prefix)),
            "train_tokens": cut, "val_tokens": total - cut, "val_rule": rule,
            "source": str(prefix)}
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
    """Writes PREFIX.bin/.idx, one sequence per non-empty document; returns {'documents',
    'tokens'}."""
    dtype = np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    code = CODE_OF[dtype]
    prefix = Path(prefix)
    tmp = {ext: prefix.with_name(f".{prefix.name}.{ext}.tmp-{os.getpid()}")
           for ext in ("bin", "idx")}
    lengths, doc_index = [], [0]  # sequences; per document the index past its last one
    try:
        with open(tmp["bin"], "wb") as handle:
            for tokens in documents:
                if len(tokens):  # an empty document has no sequence (Megatron's builder)
                    handle.write(np.asarray(tokens).astype(dtype).tobytes())
                    lengths.append(len(tokens))
                doc_index.append(len(lengths))
        lengths = np.asarray(lengths, np.int32)
        ends = np.cumsum(lengths.astype(np.int64) * dtype.itemsize)
        pointers = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        with open(tmp["idx"], "wb") as handle:
            handle.write(HEADER.pack(MAGIC, 1, code, len(lengths), len(doc_index)))
            handle.write(lengths.tobytes() + pointers.tobytes()
                         + np.asarray(doc_index, np.int64).tobytes())
        os.replace(tmp["bin"], f"{prefix}.bin")
        os.replace(tmp["idx"], f"{prefix}.idx")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return {"documents": len(doc_index) - 1, "tokens": int(lengths.sum())}
