"""Reading prepared token directories: meta validation, deterministic batches, entropy.

Owns the on-disk corpus format (``FORMAT_VERSION``) as seen by readers. A prepared corpus
is a directory holding

- ``train.bin``, ``val.bin``: flat token ids in ``meta["dtype"]`` (native little-endian
  numpy), documents each followed by ``meta["eot_id"]``;
- ``meta.json``: ``format_version``, ``dtype``, ``vocab_size``, ``tokenizer``, ``eot_id``,
  ``train_tokens``, ``val_tokens``, ``source`` (and informational extras).

Invariants:

- ``meta.json`` is written last and the directory appears by an atomic rename
  (``corpus.py``), so a directory with a valid ``meta.json`` is complete; ``read_meta``
  still checks each ``.bin`` size against its token count.
- ``TokenDataset.batch`` is a pure function of (seed, step, global_batch, seq_len): no
  iterator state, so resuming at step k reads exactly the batch an unbroken run would.
- Validation uses the same ``batch`` on the ``"val"`` split, with the run's seed and
  ``step`` = evaluation batch index 0..n-1: the same fixed batches at every evaluation,
  so validation losses are comparable across a run.

Pure numpy: no JAX here, so the data path can be tested and used without a backend.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxptd.data import megatron
from jaxptd.data.errors import DataError
from jaxptd.data.splits import SPLITS

FORMAT_VERSION = 1
_DTYPES = ("uint16", "uint32")
_REQUIRED_META = ("format_version", "dtype", "vocab_size", "tokenizer", "eot_id",
                  "train_tokens", "val_tokens", "source")
# Entropy counting reads the memmap in pieces so memory stays bounded for any corpus.
_ENTROPY_CHUNK = 1 << 24


def read_meta(directory: str | Path) -> dict:
    """Load and validate ``meta.json`` of a prepared corpus directory.

    Args:
      directory: the prepared corpus directory.
    Returns:
      the meta dict (all ``_REQUIRED_META`` keys present and well-typed).
    Raises:
      DataError: directory or meta.json missing, unreadable, or inconsistent with the
        ``.bin`` files.
    """
    directory = Path(directory)
    meta_path = directory / "meta.json"
    expected = "a directory prepared by `python -m jaxptd.data.prepare` (with meta.json)"
    if not directory.is_dir():
        raise DataError(f"corpus {str(directory)!r} does not exist or is not a directory; "
                        f"expected {expected}")
    if not meta_path.is_file():
        raise DataError(f"corpus {str(directory)!r} has no meta.json; expected {expected}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{str(meta_path)!r} is not readable JSON ({err}); "
                        f"expected {expected}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{str(meta_path)!r} must hold a JSON object, got "
                        f"{type(meta).__name__}")
    missing = [key for key in _REQUIRED_META if key not in meta]
    if missing:
        raise DataError(f"{str(meta_path)!r} lacks keys {missing}; expected {expected}")
    _check_meta_values(meta_path, meta)
    for split in SPLITS:
        _check_bin_size(directory, meta, split)
    return meta


def _check_meta_values(meta_path: Path, meta: dict) -> None:
    """Type and range checks for the meta fields readers rely on."""
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"{str(meta_path)!r}: format_version={meta['format_version']!r}, "
                        f"this jaxptd reads format_version={FORMAT_VERSION}; re-prepare it")
    if meta["dtype"] not in _DTYPES:
        raise DataError(f"{str(meta_path)!r}: dtype={meta['dtype']!r} must be one of "
                        f"{list(_DTYPES)}")
    for key in ("vocab_size", "eot_id", "train_tokens", "val_tokens"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise DataError(f"{str(meta_path)!r}: {key}={meta[key]!r} must be an integer >= 0")
    if not 0 <= meta["eot_id"] < meta["vocab_size"]:
        raise DataError(f"{str(meta_path)!r}: eot_id={meta['eot_id']} must lie in "
                        f"[0, vocab_size={meta['vocab_size']})")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        raise DataError(f"{str(meta_path)!r}: vocab_size={meta['vocab_size']} does not fit "
                        f"dtype={meta['dtype']}")


def _check_bin_size(directory: Path, meta: dict, split: str) -> None:
    """A .bin whose size disagrees with meta is truncated or foreign: refuse it."""
    bin_path = directory / f"{split}.bin"
    expected = meta[f"{split}_tokens"] * np.dtype(meta["dtype"]).itemsize
    actual = bin_path.stat().st_size if bin_path.is_file() else None
    if actual != expected:
        raise DataError(f"{str(bin_path)!r} has {actual} bytes, meta.json says "
                        f"{meta[f'{split}_tokens']} {meta['dtype']} tokens = {expected} bytes; "
                        f"re-prepare the corpus")


def _open_tokens(directory: Path, meta: dict, split: str) -> np.ndarray:
    """Read-only memmap of one split, shape [split_tokens]; np.memmap refuses empty files."""
    if meta[f"{split}_tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r")


class TokenDataset:
    """One split of a prepared corpus or of a Megatron-LM dataset (megatron.py), memory-mapped.

    Attributes:
      directory: the corpus directory (or the Megatron dataset's path prefix).
      split: "train" or "val".
      meta: the validated meta.json dict.
      tokens: read-only memmap of token ids, shape [num_tokens], dtype meta["dtype"].
      vocab_size, eot_id: from meta (eot_id None for a Megatron dataset).
    """

    def __init__(self, directory: str | Path, split: str = "train"):
        if split not in SPLITS:
            raise DataError(f"split={split!r} must be one of {list(SPLITS)}")
        self.directory = Path(directory)
        self.split = split
        if megatron.is_prefix(self.directory):
            self.tokens, self.meta = megatron.open_split(self.directory, split)
        else:
            self.meta = read_meta(self.directory)
            self.tokens = _open_tokens(self.directory, self.meta, split)
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = self.meta["eot_id"]

    def __len__(self) -> int:
        return len(self.tokens)

    def check_length(self, seq_len: int, remedy: str = "") -> None:
        """DataError unless the split holds a row of seq_len + 1 tokens."""
        if len(self.tokens) < seq_len + 1:
            remedy = f"; lower model.seq_len, prepare more text{' ' + remedy if remedy else ''}"
            raise DataError(f"split {self.split!r} of {str(self.directory)!r} has "
                            f"{len(self.tokens)} tokens; model.seq_len={seq_len} needs at "
                            f"least seq_len + 1 = {seq_len + 1}{remedy}")

    def starts(self, seed: int, step: int, global_batch: int, seq_len: int) -> np.ndarray:
        """Start offsets of every row of global batch ``step``, shape [global_batch] int64.

        Drawn uniformly over the valid starts 0..len - seq_len - 1 (each row needs
        seq_len + 1 tokens) by a Generator seeded with (seed, step) alone.
        """
        if seed < 0 or step < 0:
            raise DataError(f"seed={seed}, step={step}: both must be >= 0")
        if global_batch < 1 or seq_len < 1:
            raise DataError(f"global_batch={global_batch}, seq_len={seq_len}: both must be >= 1")
        self.check_length(seq_len)
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, len(self.tokens) - seq_len, size=global_batch)

    def batch(self, seed: int, step: int, global_batch: int, seq_len: int,
              rows: range | slice | None = None) -> np.ndarray:
        """Rows ``rows`` of global batch ``step``: int32 array [len(rows), seq_len + 1].

        Inputs are ``[:, :-1]``, targets ``[:, 1:]``. All global_batch offsets are drawn
        (cheap) but only the owned rows are read from disk, so a process reads only its
        share and its rows equal the same rows of the full batch.

        Args:
          seed, step: together they fix the batch; any process computes the same one.
          global_batch: rows in the whole batch across all processes.
          seq_len: tokens per row fed to the model.
          rows: a range or slice of row indices in [0, global_batch); None means all.
        """
        starts = self.starts(seed, step, global_batch, seq_len)
        owned = range(global_batch) if rows is None else _owned_rows(rows, global_batch)
        out = np.empty((len(owned), seq_len + 1), dtype=np.int32)  # [rows, seq_len + 1]
        for out_row, row in enumerate(owned):
            start = int(starts[row])
            out[out_row] = self.tokens[start:start + seq_len + 1]
        return out


def _owned_rows(rows: range | slice, global_batch: int) -> range:
    """Normalise ``rows`` to a range inside [0, global_batch), refusing out-of-range ones."""
    if isinstance(rows, slice):
        return range(global_batch)[rows]
    if not isinstance(rows, range):
        raise DataError(f"rows={rows!r} must be a range or a slice")
    if len(rows) and (min(rows) < 0 or max(rows) >= global_batch):
        raise DataError(f"rows={rows!r} must lie in [0, global_batch={global_batch})")
    return rows


def unigram_entropy(directory: str | Path, split: str = "train") -> float:
    """Entropy in nats of the token unigram distribution of one split.

    A model that ignores context entirely cannot beat this loss, so validation loss is
    compared against it. Counts with np.bincount over the memmap in chunks.

    Args:
      directory: a prepared corpus directory.
      split: "train" or "val".
    Returns:
      H = -sum_v p(v) log p(v) over token ids v with nonzero count.
    """
    dataset = TokenDataset(directory, split)
    if len(dataset) == 0:
        raise DataError(f"split {split!r} of {str(dataset.directory)!r} is empty; "
                        "entropy needs at least one token")
    counts = np.zeros(dataset.vocab_size, dtype=np.int64)
    for begin in range(0, len(dataset), _ENTROPY_CHUNK):
        chunk_counts = np.bincount(dataset.tokens[begin:begin + _ENTROPY_CHUNK],
                                   minlength=dataset.vocab_size)
        if len(chunk_counts) > dataset.vocab_size:
            raise DataError(f"split {split!r} of {str(dataset.directory)!r} holds token id "
                            f"{len(chunk_counts) - 1} >= vocab_size={dataset.vocab_size}")
        counts += chunk_counts
    probs = counts[counts > 0] / len(dataset)
    return float(-(probs * np.log(probs)).sum())
