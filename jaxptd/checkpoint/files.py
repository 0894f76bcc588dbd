"""A checkpoint directory on disk: where a run keeps it, which steps it holds, what files
each step wrote, and whether the directory takes writes. Standard library only.

Owns the names and records of the on-disk format that are not Orbax's:

- step directories are named by the step (`5`); Orbax writes a save under `<step>` +
  TMP_MARK + a suffix and renames it into place when complete; restore moves a damaged
  step aside to `<step>.corrupt` (integrity.inspect reports each kind);
- `files.json` (FILE_LIST) in the step directory: every file the save wrote (Orbax's
  metadata, OCDBT manifests and data files, the layout item) with its size. Process 0
  writes it after every process has finished writing and before Orbax renames the
  temporary directory into place, so it is part of the atomic save (a step either has it
  or was never complete);
- the layout item, `layout/metadata`: how the step was written (store.layout_metadata)
  and its arrays' checksums (checksums.py).

Everything that reads a checkpoint directory without restoring it (inspect, the run
directory's history, `python -m jaxptd.hf export`) finds it and its steps here.
"""
from __future__ import annotations

import json
import os
import tempfile

from jaxptd.runtime import storage
from jaxptd.checkpoint import CheckpointError
from jaxptd.config import ConfigError, load_config
from jaxptd.runtime.runlog import human_bytes

FILE_LIST = "files.json"
TMP_MARK = ".orbax-checkpoint-tmp"
# Orbax writes this one in every finished step (a save is complete once it is there) and
# rewrites it while renaming the step into place: listed without a size.
FINISHED = "_CHECKPOINT_METADATA"
REWRITTEN = (FINISHED,)
PROBE_BYTES = 1 << 16
# What the layout item says of the parallel layout a step was written with.
LAYOUT_KEYS = ("data", "pipe", "tensor", "chunks")


def check_writable(directory: str, key: str = "checkpoint.dir") -> str:
    """Creates `directory` if needed and proves that PROBE_BYTES can be written there, so
    a full disk or a tiny file-size limit is found before the run starts."""
    directory = os.path.abspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"{key}={directory}: not a writable directory ({e.strerror})") from None
    with storage.guard(f"{key}={directory}", f"writing a {human_bytes(PROBE_BYTES)} probe"):
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as f:
                f.write(bytes(PROBE_BYTES))
                f.flush()
        except OSError as e:
            if storage.write_failure(e):
                raise
            raise CheckpointError(
                f"{key}={directory}: not a writable directory ({e.strerror})") from None
    return directory


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


def read_json(path: str):
    """A JSON file's content (OSError, or ValueError for bad UTF-8 or JSON)."""
    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def layout_metadata(config, processes: int) -> dict:
    """What a step records about how it was written (JSON-serialisable)."""
    par = config.parallel
    return {**{k: getattr(par, k) for k in LAYOUT_KEYS}, "zero1": config.optimizer.zero1,
            "processes": processes, "padded_vocab": config.model.padded_vocab(par.tensor),
            "config": config.to_dict()}


def read_layout(step_dir: str) -> dict | None:
    """The layout item of a step (None when unreadable)."""
    try:
        layout = read_json(os.path.join(step_dir, "layout", "metadata"))
    except (OSError, ValueError):
        return None
    return layout if isinstance(layout, dict) else None


def is_step_dir(path: str) -> bool:
    """Whether `path` looks like one step of a checkpoint directory."""
    name = os.path.basename(os.path.normpath(path))
    return name.split(".")[0].isdigit() and os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, p)) for p in (FINISHED, "state"))


def complete_steps(directory: str) -> list[int]:
    """The steps in checkpoint directory `directory` whose save finished (renamed into
    place, FINISHED written), ascending; [] when there are none."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()
                  and os.path.exists(os.path.join(directory, name, FINISHED)))


def find_checkpoints(path: str) -> str | None:
    """The checkpoint directory meant by `path`: itself, a step's parent, or a run
    directory's checkpoints. None when none is found.

    A run directory is read where it is, so a copied or moved one stands alone: its
    config.yaml's checkpoint.dir is taken relative to the run directory it records when it
    lay inside it (the default `<run_dir>/checkpoints`), and as it is only when it lay
    elsewhere (a checkpoint.dir the config set apart)."""
    if not os.path.isdir(path):
        return None
    if is_step_dir(path):
        return os.path.dirname(os.path.normpath(path)) or "."
    candidates = [path, os.path.join(path, "checkpoints")]
    recorded = _recorded_checkpoints(path)
    if recorded is not None:
        candidates.insert(1, recorded)
    for candidate in candidates:
        if os.path.isdir(candidate) and any(
                is_step_dir(os.path.join(candidate, n)) for n in os.listdir(candidate)):
            return candidate
    return None


def _recorded_checkpoints(run_dir: str) -> str | None:
    """checkpoint.dir of run_dir's config.yaml, moved along with run_dir when it was inside
    the train.run_dir it records (None: no readable config.yaml)."""
    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        return None
    try:
        config = load_config(config_file)
    except ConfigError:
        return None
    recorded_run, recorded = (os.path.abspath(d) for d in (config.train.run_dir,
                                                           config.checkpoint_dir))
    if os.path.commonpath([recorded_run, recorded]) != recorded_run:
        return recorded
    return os.path.join(run_dir, os.path.relpath(recorded, recorded_run))
