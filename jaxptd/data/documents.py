"""Which files are a corpus's documents and what each one's text is: directories walked
for a pattern (excluded directories pruned), one document a file or, with a JSON Lines key,
one a line. Every document has a split key (data/corpus.py's val rule hashes it): its path
relative to the input directory it was found under, a file given directly its name, a
JSON Lines document that key, ':' and its line number. Unreadable or malformed input is a
DataError naming the file (and line)."""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

from jaxptd.data.errors import DataError


def find_documents(inputs: Sequence[str], glob: str,
                   excluded_dirs: frozenset[str] = frozenset()) -> list[tuple[str, Path]]:
    """Input files as (split key, path), in a deterministic order.

    Args:
      inputs: files, or directories searched recursively for ``glob``.
      glob: file name pattern (fnmatch, no "/") for directories, e.g. "*.txt".
      excluded_dirs: directory names skipped anywhere below an input directory.
    Returns:
      [(key, path)]: inputs in the order given, each directory's files sorted by key.
    """
    documents, seen = [], set()
    for given in inputs:
        root = Path(given)
        if root.is_file():
            found = [(root.name, root)]
        elif root.is_dir():
            found = sorted(_walk(root, glob, excluded_dirs))
        else:
            raise DataError(f"--input {given!r} does not exist; expected a text file or "
                            "a directory")
        for key, path in found:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                documents.append((key, path))
    if not documents:
        raise DataError(f"--input {list(inputs)} holds no files matching --glob {glob!r}")
    return documents


def _walk(root: Path, glob: str, excluded_dirs: frozenset[str]) -> list[tuple[str, Path]]:
    """(key, path) of files below ``root`` whose name matches ``glob``.

    os.walk rather than Path.rglob so excluded directories (site-packages can dwarf the
    stdlib) are pruned instead of walked and filtered.
    """
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in excluded_dirs]
        for name in fnmatch.filter(names, glob):
            path = Path(directory, name)
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _read_document(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DataError(f"input file {str(path)!r} is not readable ({err.strerror})") from None


def _jsonl_documents(key: str, path: Path, field: str) -> Iterator[tuple[str, bytes]]:
    """(key:line, UTF-8 text) of every non-blank line of a JSON Lines file."""
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise DataError(f"input file {str(path)!r} is not readable ({err.strerror})") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"input file {str(path)!r} line {number}: not JSON; "
                                f"--jsonl-key {field} reads JSON Lines (one object a line)") \
                    from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise DataError(f"input file {str(path)!r} line {number}: no text field "
                                f"--jsonl-key {field!r} (it has {fields})")
            yield f"{key}:{number}", text.encode("utf-8")


def read_documents(documents: list[tuple[str, Path]],
               jsonl_key: str | None) -> Iterator[tuple[str, Path, bytes]]:
    """(split key, file, bytes) of every document, in order."""
    for key, path in documents:
        if jsonl_key is None:
            yield key, path, _read_document(path)
        else:
            for line_key, data in _jsonl_documents(key, path, jsonl_key):
                yield line_key, path, data
