"""What makes a saved step trustworthy: its file list, its array checksums, and the checks
that restore and `python -m jaxptd.checkpoint inspect` run before believing a step.

Owns three records and their checks:

- `files.json` in the step directory: every file the save wrote (Orbax's metadata, OCDBT
  manifests and data files, the layout item) with its size. Process 0 writes it after
  every process has finished writing and before Orbax renames the temporary directory
  into place, so it is part of the atomic save (a step either has it or was never
  complete). A step without one is damaged, unless it was written before file lists
  existed (an older jaxptd, which recorded no checksums either): that one is checked
  without it.
- `checksums` in the layout item: per array, the uint32 sum of its bit patterns, computed
  on the devices from the state being saved (no extra I/O). A byte flipped inside array
  data that Orbax and tensorstore read without complaint (they do not checksum array
  chunks) changes the sum, so restore refuses it.
- `check_step(path)`: the cheap checks (every listed file present with its size, every
  JSON metadata file parses). Identical on every process reading a shared file system.

A step that fails any of them is damaged: restore sets it aside and falls back
(checkpoint.py); inspect reports it.
"""
from __future__ import annotations

import functools
import json
import os

FILE_LIST = "files.json"
TMP_MARK = ".orbax-checkpoint-tmp"
# JSON files Orbax and jaxptd write in every step (more are checked when present).
REQUIRED_JSON = ("_CHECKPOINT_METADATA", "state/_METADATA", "layout/metadata")
OPTIONAL_JSON_DIRS = ("state/array_metadatas",)
OPTIONAL_JSON = ("state/_sharding",)
# Orbax rewrites this one while renaming the step into place: listed without a size.
REWRITTEN = ("_CHECKPOINT_METADATA",)


def step_files(step_dir: str) -> dict[str, int | None]:
    """{relative path: size (None: not fixed yet)} of every file under `step_dir` except
    the file list itself."""
    files = {}
    for directory, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, step_dir)
            if rel != FILE_LIST:
                files[rel] = None if rel in REWRITTEN else os.path.getsize(path)
    return files


def write_file_list(step_dir: str) -> None:
    """Records the files of a finished (not yet renamed) save, durably."""
    path = os.path.join(step_dir, FILE_LIST)
    with open(path, "w") as f:
        json.dump({"files": step_files(step_dir)}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: str):
    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def _check_listed(step_dir: str) -> str | None:
    """The file list's complaint about `step_dir`, or None (also when there is no list
    and the step predates file lists: its layout item has no checksums either)."""
    list_path = os.path.join(step_dir, FILE_LIST)
    if not os.path.exists(list_path):
        layout = read_layout(step_dir)
        return f"{FILE_LIST}: missing" if layout and "checksums" in layout else None
    try:
        listed = _read_json(list_path)["files"]
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
            content = _read_json(path)
        except FileNotFoundError:
            return f"{rel}: missing"
        except (OSError, ValueError):  # ValueError: bad UTF-8 or JSON
            return f"{rel}: not valid JSON"
        if not isinstance(content, dict):
            return f"{rel}: not a JSON object"
    return None


def read_layout(step_dir: str) -> dict | None:
    """The layout item of a step (None when unreadable)."""
    try:
        layout = _read_json(os.path.join(step_dir, "layout", "metadata"))
    except (OSError, ValueError):
        return None
    return layout if isinstance(layout, dict) else None


def leaf_name(path) -> str:
    """A leaf's path as 'a/b/c', the same for a dict and a NamedTuple holding it."""
    return "/".join(str(getattr(e, "key", getattr(e, "name", getattr(e, "idx", e))))
                    for e in path)


def _bits(x):
    """x's bit patterns as uint32 (wider types as several words)."""
    import jax.numpy as jnp
    from jax import lax
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, width).astype(jnp.uint32)


@functools.lru_cache(maxsize=8)
def _sums_fn(mesh):
    """The jitted per-leaf sums, replicated over `mesh` (one compile per mesh and tree)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    return jax.jit(lambda xs: [jnp.sum(_bits(x), dtype=jnp.uint32) for x in xs],
                   out_shardings=NamedSharding(mesh, P()))


def array_checksums(tree) -> dict[str, int]:
    """{leaf name: uint32 sum of the leaf's bit patterns} for a pytree of global arrays.

    A collective (every process must call it); the sum is exact integer arithmetic, so it
    does not depend on the layout or the process count the arrays are sharded over.
    """
    import jax
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = _sums_fn(leaves[0][1].sharding.mesh)([x for _, x in leaves])
    return {leaf_name(path): int(s) for (path, _), s in zip(leaves, jax.device_get(sums))}


def checksum_mismatch(tree, expected: dict | None) -> str | None:
    """The first leaf of `tree` whose checksum differs from `expected` (None: all agree or
    no checksums recorded)."""
    if not expected:
        return None
    for name, value in array_checksums(tree).items():
        if name in expected and expected[name] != value:
            return f"array {name}: data does not match its checksum"
    return None


def is_step_dir(path: str) -> bool:
    """Whether `path` looks like one step of a checkpoint directory."""
    name = os.path.basename(os.path.normpath(path))
    return name.split(".")[0].isdigit() and os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, p)) for p in ("_CHECKPOINT_METADATA", "state"))


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


def find_checkpoints(path: str) -> str | None:
    """The checkpoint directory meant by `path`: itself, a step's parent, or a run
    directory's checkpoints (its config.yaml's checkpoint.dir). None when none is found."""
    if not os.path.isdir(path):
        return None
    if is_step_dir(path):
        return os.path.dirname(os.path.normpath(path)) or "."
    candidates = [path]
    config_file = os.path.join(path, "config.yaml")
    if os.path.isfile(config_file):
        from jaxptd.config import ConfigError, load_config
        try:
            candidates.append(load_config(config_file).checkpoint_dir)
        except ConfigError:
            pass
    candidates.append(os.path.join(path, "checkpoints"))
    for candidate in candidates:
        if os.path.isdir(candidate) and any(
                is_step_dir(os.path.join(candidate, n)) for n in os.listdir(candidate)):
            return candidate
    return None
