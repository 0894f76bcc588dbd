"""What makes a saved step trustworthy before it is read: the cheap checks that restore
and `python -m jaxptd.checkpoint inspect` run, and the records inspect lists.
Standard library only.

Owns:

- `check_step(path)`: every file the step's `files.json` lists present with its size,
  every JSON metadata file parses. A step without a file list is damaged, unless it was
  written before file lists existed (an older jaxptd, which recorded no checksums
  either): that one is checked without it. Identical on every process reading a shared
  file system.
- `inspect(directory)`: one record per step directory (complete, damaged, half-written
  or set aside as corrupt), its problem and its layout; `newest_complete`, the newest
  complete step's number and config (what a resumed run continues).

The arrays themselves are checked against their checksums after reading (checksums.py).
A step that fails any check is damaged: restore sets it aside and falls back (store.py);
inspect reports it.
"""
from __future__ import annotations

import os

from jaxptd.checkpoint.files import FILE_LIST, TMP_MARK, read_json, read_layout

# JSON files Orbax and jaxptd write in every step (more are checked when present).
REQUIRED_JSON = ("_CHECKPOINT_METADATA", "state/_METADATA", "layout/metadata")
OPTIONAL_JSON_DIRS = ("state/array_metadatas",)
OPTIONAL_JSON = ("state/_sharding",)


def _check_listed(step_dir: str) -> str | None:
    """The file list's complaint about `step_dir`, or None (also when there is no list
    and the step predates file lists: its layout item has no checksums either)."""
    list_path = os.path.join(step_dir, FILE_LIST)
    if not os.path.exists(list_path):
        layout = read_layout(step_dir)
        return f"{FILE_LIST}: missing" if layout and "checksums" in layout else None
    try:
        listed = read_json(list_path)["files"]
        listed = {str(k): None if v is None else int(v) for k, v in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{FILE_LIST}: unreadable"
    for rel, size in sorted(listed.items()):
        try:
            actual = os.path.getsize(os.path.join(step_dir, rel))
        except OSError:
            return f"{rel}: missing"
        if size is not None and actual != size:
            return f"{rel}: {actual} bytes, expected {size}"
    return None


def _json_files(step_dir: str) -> list[tuple[str, bool]]:
    """(relative path, required) of the JSON metadata files to parse."""
    files = [(rel, True) for rel in REQUIRED_JSON] + [(rel, False) for rel in OPTIONAL_JSON]
    for rel_dir in OPTIONAL_JSON_DIRS:
        directory = os.path.join(step_dir, rel_dir)
        if os.path.isdir(directory):
            files += [(os.path.join(rel_dir, n), True) for n in sorted(os.listdir(directory))]
    return files


def check_step(step_dir: str) -> str | None:
    """None when `step_dir` passes the cheap checks, else one short line saying why not."""
    problem = _check_listed(step_dir)
    if problem:
        return problem
    for rel, required in _json_files(step_dir):
        path = os.path.join(step_dir, rel)
        if not required and not os.path.exists(path):
            continue
        try:
            content = read_json(path)
        except FileNotFoundError:
            return f"{rel}: missing"
        except (OSError, ValueError):  # ValueError: bad UTF-8 or JSON
            return f"{rel}: not valid JSON"
        if not isinstance(content, dict):
            return f"{rel}: not a JSON object"
    return None


def inspect(directory: str) -> list[dict]:
    """One record per step directory: step, path, status, problem, layout.

    status: "complete" (passes check_step), "damaged" (fails it: `problem` says why),
    "half-written" (a save that never finished) or "corrupt" (set aside by a restore).
    """
    records = []
    for name in os.listdir(directory):
        step_text = name.split(".")[0]
        path = os.path.join(directory, name)
        if not step_text.isdigit() or not os.path.isdir(path):
            continue
        problem = None
        if TMP_MARK in name:
            status = "half-written"
        elif not name.isdigit():
            status = "corrupt"
        else:
            problem = check_step(path)
            status = "damaged" if problem else "complete"
        records.append({"step": int(step_text), "path": path, "status": status,
                        "problem": problem, "layout": read_layout(path)})
    return sorted(records, key=lambda r: (r["step"], r["path"]))


def newest_complete(directory: str) -> tuple[int, dict | None]:
    """(step, the config it was written with as a to_dict()) of the newest complete step in
    checkpoint directory `directory`; (0, None) when there is none."""
    steps = [r for r in inspect(directory) if r["status"] == "complete"] \
        if os.path.isdir(directory) else []
    return (steps[-1]["step"], (steps[-1]["layout"] or {}).get("config")) if steps else (0, None)
