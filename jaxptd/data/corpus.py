"""Text -> prepared token directory: tokenizers, the val split, atomic write, stdlib corpus,
and a config's data path resolved to a prepared corpus (``resolve_corpus``).

``python -m jaxptd.data.prepare --input PATH [PATH ...] --output DIR [--tokenizer FILE.json]
[--val-fraction 0.005] [--glob '*.txt'] [--jsonl-key text] [--format megatron]`` (``main``
here; prepare.py is its entry, so that the package, which re-exports this module's
``prepare_corpus`` and ``resolve_corpus``, never imports the module ``-m`` runs) writes the
format read by ``dataset.py``, or with ``--format megatron`` a Megatron-LM indexed dataset
with path prefix OUTPUT (``megatron.py``; the invariants below are for the directory format).

Invariants:

- Each input file is one document, or with ``--jsonl-key KEY`` each line of a JSON Lines
  file is one (its KEY field, a string); every document is followed by the eot id, but
  for one without tokens, which stays empty (as Megatron-LM's ``preprocess_data.py
  --append-eod`` does; both formats hold the same tokens). A ``.jsonl`` input without
  ``--jsonl-key`` is read as text, with a warning.
- A document goes to val iff sha256(its key) / 2**64 < val_fraction, where the key is its
  path relative to the input directory it was found under (a file given directly: its
  name; a JSON Lines document: that key, ':' and its line number). The split of a
  document therefore never changes when files are added elsewhere or the tree is moved.
  When that leaves a split without tokens (too few documents, e.g. one file, or only
  empty ones), the corpus is split by tokens instead: the last val_fraction of all
  tokens (at least one) are the val split.
- The corpus is built in a temporary sibling directory (``.<name>.tmp-*``), ``meta.json``
  last, then renamed into place: readers see a complete corpus or none. Of concurrent
  preparers of one output, the first rename wins and the others discard their copies
  and return the winner's directory. A killed prepare leaves only a ``.tmp-`` sibling,
  which nothing reads.
- An output that already holds a complete corpus is refused (CLI: ``error:``, exit 2)
  unless ``exist_ok=True``, which makes preparation a no-op; ``resolve_corpus`` uses that.
- A storage failure while writing (a full disk, a file-size limit) leaves nothing behind
  (the staging directory or temporary files are removed) and is one StorageError line.
- Which files are documents and how each one is read: ``documents.py``.
- Tokens: the byte tokenizer (vocab 257), or a Hugging Face ``tokenizers`` JSON file
  when given (the package is optional); ``tokenizer.py`` owns both.

The built-in corpus ``pystdlib`` (the running Python's standard library ``*.py`` files,
tests excluded) needs no download, so every machine can train out of the box.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from jaxptd.runtime import storage
from jaxptd.data import megatron
from jaxptd.data.dataset import FORMAT_VERSION, read_meta
from jaxptd.data.documents import find_documents, read_documents
from jaxptd.data.errors import DataError
from jaxptd.data.splits import SPLITS, val_tail
from jaxptd.data.tokenizer import Tokenizer, load_tokenizer

STDLIB_CORPUS = "pystdlib"
# Tests, third-party packages and the IDLE GUI are skipped: they change between patch
# releases and distributions more than the library itself, and tests double the size.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                                  "idlelib", "__pycache__"})


PATH_RULE = "sha256(document key) / 2**64 < val_fraction"
TOKEN_RULE = "the last val_fraction of the tokens (too few documents for the key rule)"


def _hash_unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def _write_splits(documents: list[tuple[str, Path]], val_fraction: float,
                  tokenizer: Tokenizer, directory: Path, jsonl_key: str | None = None) -> dict:
    """Tokenize each document into ``directory``/<split>.bin; returns per-split counts and
    the val rule applied."""
    counts = {f"{split}_{what}": 0 for split in SPLITS for what in ("tokens", "documents")}
    files = {split: open(directory / f"{split}.bin", "wb") for split in SPLITS}
    try:
        for key, ids in _encoded(documents, tokenizer, jsonl_key):
            split = "val" if _hash_unit(key) < val_fraction else "train"
            files[split].write(ids.tobytes())
            counts[f"{split}_tokens"] += len(ids)
            counts[f"{split}_documents"] += 1
    finally:
        for handle in files.values():
            handle.close()
    counts["val_rule"] = PATH_RULE
    if val_fraction > 0 and not (counts["train_tokens"] and counts["val_tokens"]):
        _split_by_tokens(directory, counts, val_fraction, tokenizer.dtype)
    for split in SPLITS:  # durable before the rename publishes the corpus
        with open(directory / f"{split}.bin", "rb+") as handle:
            os.fsync(handle.fileno())
    return counts


def _split_by_tokens(directory: Path, counts: dict, val_fraction: float, dtype) -> None:
    """All tokens sit in one split: the last val_fraction of them become val (at least one,
    and at least one stays in train), reading only that tail."""
    total = counts["train_tokens"] + counts["val_tokens"]
    if total < 2:
        raise DataError(f"--input holds {total} token(s); a training and a validation split "
                        "need at least 2")
    if not counts["train_tokens"]:
        os.replace(directory / "val.bin", directory / "train.bin")
    val_tokens = val_tail(total, val_fraction)
    tail = np.memmap(directory / "train.bin", dtype=dtype, mode="r")[total - val_tokens:]
    (directory / "val.bin").write_bytes(np.asarray(tail).tobytes())
    del tail
    os.truncate(directory / "train.bin", (total - val_tokens) * np.dtype(dtype).itemsize)
    counts.update(train_tokens=total - val_tokens, val_tokens=val_tokens,
                  val_rule=TOKEN_RULE)


def _is_complete(output: Path) -> bool:
    """Whether ``output`` holds a valid prepared corpus (refusing other non-empty paths)."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return False
    if not output.is_dir():
        raise DataError(f"--output {str(output)!r} exists and is not a directory; remove it "
                        "or pick another path")
    try:
        read_meta(output)
    except DataError as err:
        raise DataError(f"--output {str(output)!r} exists and is not a complete prepared "
                        f"corpus ({err}); remove it or pick another path") from None
    return True


def _encoded(documents: list[tuple[str, Path]], tokenizer: Tokenizer,
             jsonl_key: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(split key, token ids followed by the eot id) of each document; a document without
    tokens stays empty, no eot (Megatron's preprocess_data.py --append-eod: an eot ends a
    document, it is not one)."""
    eot = np.array([tokenizer.eot_id], dtype=tokenizer.dtype)
    for key, path, data in read_documents(documents, jsonl_key):
        ids = _encode(tokenizer, data, path)
        yield key, np.concatenate([ids, eot]) if len(ids) else ids


def _encode(tokenizer: Tokenizer, data: bytes, path: Path) -> np.ndarray:
    try:
        return tokenizer.encode(data)
    except UnicodeDecodeError as err:
        raise DataError(f"input file {str(path)!r} is not UTF-8 text (byte {err.start}: "
                        f"{err.reason}), which --tokenizer {tokenizer.name!r} "
                        "requires; fix or drop the file") from None


def write_corpus(documents: list[tuple[str, Path]], output: str | Path, tokenizer: Tokenizer,
                 val_fraction: float, source: str, exist_ok: bool = False,
                 jsonl_key: str | None = None) -> str:
    """Tokenize ``documents`` into the prepared directory ``output``, atomically.

    Args:
      documents: [(split key, path)] as from ``find_documents``.
      output: the directory to create.
      tokenizer: from ``load_tokenizer``.
      val_fraction: expected share of documents in val (see the module docstring).
      source: a short description stored in meta.json.
      exist_ok: if ``output`` already holds a complete corpus, return it unchanged
        instead of raising DataError.
      jsonl_key: read the files as JSON Lines, each line's field of this name a document.
    Returns:
      ``output`` as a string; it holds a complete corpus (possibly a concurrent winner's).
    """
    output = Path(output)
    if _is_complete(output):
        if exist_ok:
            return str(output)
        raise DataError(f"--output {str(output)!r} already holds a prepared corpus; remove it "
                        "to prepare again")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must lie in [0, 1)")
    _make_parent(output)
    with storage.guard(str(output), "preparing the corpus"):
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
        try:
            counts = _write_splits(documents, val_fraction, tokenizer, staging, jsonl_key)
            meta = {"format_version": FORMAT_VERSION, "dtype": tokenizer.dtype.name,
                    "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name,
                    "eot_id": tokenizer.eot_id, "source": source,
                    "val_fraction": val_fraction, **counts}
            with open(staging / "meta.json", "w") as handle:
                json.dump(meta, handle, indent=2)
                handle.flush()
                os.fsync(handle.fileno())
            _publish(staging, output)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after a winning rename
    return str(output)


def _make_parent(output: Path) -> None:
    """Creates the directory ``output`` goes into (both formats); DataError when it cannot
    be created or written."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"--output {str(output)!r} is not writable ({err.strerror}); its "
                        "parent directory must be creatable and writable") from None
    if not os.access(output.parent, os.W_OK):
        raise DataError(f"--output {str(output)!r} is not writable: its parent directory "
                        f"{str(output.parent)!r} is not writable")


def _publish(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``; a concurrent winner's complete corpus is kept."""
    try:
        os.rename(staging, output)  # atomic; replaces only an absent or empty directory
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise DataError(f"--output {str(output)!r} could not be created "
                            f"({err.strerror})") from None
        if not _is_complete(output):
            raise DataError(f"--output {str(output)!r} appeared during preparation and is "
                            "not a prepared corpus; remove it") from None


def prepare_corpus(inputs: Sequence[str], output: str | Path, *, tokenizer: str | None = None,
                   val_fraction: float = 0.005, glob: str | None = None,
                   exist_ok: bool = False, jsonl_key: str | None = None,
                   fmt: str = "jaxptd") -> str:
    """Prepare text files into a token directory (the CLI's work, callable from Python).

    Args:
      inputs: text files or directories searched recursively with ``glob``.
      output: the prepared directory to create, or with fmt="megatron" the path prefix of
        the Megatron-LM dataset (OUTPUT.bin, OUTPUT.idx) to create.
      tokenizer: None/"byte" for the byte tokenizer, or a tokenizers JSON file path.
      val_fraction: expected share of documents held out for validation, in [0, 1).
      glob: file name pattern used inside directories (default: *.txt, or *.jsonl with
        ``jsonl_key``).
      exist_ok: return an existing complete ``output`` instead of raising DataError.
      jsonl_key: read JSON Lines files, one document per line in this text field.
      fmt: "jaxptd" or "megatron" (every document in input order, no split of its own:
        the reader takes the last documents as val, see megatron.py).
    Returns:
      ``output`` as a string.
    """
    loaded = load_tokenizer(tokenizer)
    glob = glob or ("*.jsonl" if jsonl_key else "*.txt")
    documents = find_documents(inputs, glob)
    lines = [str(path) for _, path in documents if path.suffix == ".jsonl"]
    if lines and not jsonl_key:
        print(f"warning: {lines[0]}{f' and {len(lines) - 1} more' if len(lines) > 1 else ''}"
              ": JSON Lines read as plain text, one document a file with its JSON syntax; "
              "--jsonl-key KEY reads each line's KEY field as a document", file=sys.stderr)
    if fmt == "megatron":
        return _write_megatron(documents, output, loaded, exist_ok, jsonl_key)
    source = f"{len(documents)} file(s) matching {glob!r} under {', '.join(map(str, inputs))}"
    if jsonl_key:
        source += f", JSON Lines field {jsonl_key!r}"
    return write_corpus(documents, output, loaded, val_fraction, source, exist_ok, jsonl_key)


def _write_megatron(documents: list[tuple[str, Path]], output: str | Path,
                    tokenizer: Tokenizer, exist_ok: bool, jsonl_key: str | None) -> str:
    """The documents as one Megatron-LM dataset with path prefix ``output``."""
    if megatron.is_prefix(output):
        if exist_ok:
            return str(output)
        raise DataError(f"--output {str(output)!r}: {output}.bin/.idx already exist; "
                        "remove them to prepare again")
    _make_parent(Path(output))
    with storage.guard(str(output), "preparing the corpus"):
        megatron.write(output, (ids for _, ids in _encoded(documents, tokenizer, jsonl_key)),
                       tokenizer.vocab_size)
    return str(output)


def prepare_stdlib(output: str | Path, val_fraction: float = 0.01) -> str:
    """Prepare the running Python's standard library ``*.py`` files (byte tokenizer).

    A no-op when ``output`` already holds a complete corpus. The default val_fraction
    is 0.01 rather than 0.005 so the few hundred files still give a val split of ~1%.
    """
    if _is_complete(Path(output)):  # checked before walking the stdlib: cheap reuse
        return str(output)
    stdlib = sysconfig.get_paths()["stdlib"]
    documents = find_documents([stdlib], "*.py", STDLIB_EXCLUDED_DIRS)
    source = (f"Python {platform.python_version()} standard library: {len(documents)} *.py "
              f"files under {stdlib}, excluding {sorted(STDLIB_EXCLUDED_DIRS)}")
    return write_corpus(documents, output, Tokenizer(), val_fraction, source, exist_ok=True)


def cache_dir() -> Path:
    """Where built-in corpora are prepared: $JAXPTD_CACHE, else ~/.cache/jaxptd."""
    return Path(os.environ.get("JAXPTD_CACHE") or Path.home() / ".cache" / "jaxptd")


def resolve_corpus(path: str) -> str:
    """A prepared corpus directory for a config's data path.

    Args:
      path: "pystdlib" (prepared on first use into ``cache_dir()``/pystdlib-py<version>),
        a prepared directory, that directory's meta.json, or the path prefix of a
        Megatron-LM dataset (PREFIX.bin and PREFIX.idx; megatron.py).
    Returns:
      the prepared directory.
    Raises:
      DataError: the path is missing or not a valid prepared corpus.
    """
    if path == STDLIB_CORPUS:
        return prepare_stdlib(cache_dir() / f"{STDLIB_CORPUS}-py{platform.python_version()}")
    if megatron.is_prefix(path):
        megatron.read_index(path)
        return path
    directory = Path(path)
    if directory.name == "meta.json" and directory.is_file():
        directory = directory.parent
    read_meta(directory)
    return str(directory)


def corpus_tokenizer(path: str) -> str | None:
    """The tokenizer a config's data.path was prepared with ("byte" or a tokenizers file),
    without preparing anything; None for a Megatron-LM dataset (it names none)."""
    if path == STDLIB_CORPUS:
        return "byte"
    if megatron.is_prefix(path):
        return None
    return read_meta(Path(resolve_corpus(path)))["tokenizer"]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for errors a user can cause)."""
    parser = argparse.ArgumentParser(prog="python -m jaxptd.data.prepare",
                                     description="Tokenize text files into a jaxptd corpus.")
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="text files, or directories searched recursively with --glob")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="prepared directory to create (must not hold a corpus yet)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE.json",
                        help="Hugging Face tokenizers JSON file (default: byte-level)")
    parser.add_argument("--val-fraction", type=float, default=0.005,
                        help="expected share of documents held out for validation")
    parser.add_argument("--glob", default=None,
                        help="file pattern inside directories (default: *.txt, or *.jsonl "
                             "with --jsonl-key)")
    parser.add_argument("--jsonl-key", default=None, metavar="KEY",
                        help="inputs are JSON Lines: each line's KEY field (e.g. text) is "
                             "one document")
    parser.add_argument("--format", default="jaxptd", choices=("jaxptd", "megatron"),
                        help="megatron: --output is a path prefix for a Megatron-LM "
                             "indexed dataset (PREFIX.bin, PREFIX.idx)")
    args = parser.parse_args(argv)
    try:
        output = prepare_corpus(args.input, args.output, tokenizer=args.tokenizer,
                                val_fraction=args.val_fraction, glob=args.glob,
                                jsonl_key=args.jsonl_key, fmt=args.format)
    except (DataError, storage.StorageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.format == "megatron":
        index = megatron.read_index(output)
        print(f"prepared Megatron-LM dataset {output}.bin/.idx: {index.lengths.sum()} "
              f"tokens, {len(index.documents) - 1} documents, {index.dtype.name}")
        return 0
    meta = read_meta(output)
    split = "split by tokens: too few documents to split by key" \
        if meta.get("val_rule") == TOKEN_RULE else \
        f"{meta['train_documents']} and {meta['val_documents']} documents"
    print(f"prepared {output}: train {meta['train_tokens']} tokens, val {meta['val_tokens']} "
          f"tokens ({split}), vocab {meta['vocab_size']}")
    return 0
