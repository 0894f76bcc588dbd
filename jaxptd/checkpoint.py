"""Checkpoints: Orbax only. Save asynchronously, keep the newest K, restore into any layout.

Owns where the train state goes on disk and how it comes back. `python -m jaxptd.checkpoint
inspect DIR` lists the steps, the layout each was written with and whether it is complete.

A step directory holds two Orbax items: `state` (the train state in the logical layout,
OCDBT, each process writing only its own shards) and `layout` (JSON: data, pipe, tensor,
chunks, zero1, processes, padded_vocab and the whole config it was written with).

Invariants:

- A save is written under a temporary name and renamed when complete (Orbax's atomic
  finalize), so a save killed halfway is never a step that restore picks; it is skipped with
  a warning naming it.
- Restore reads into the shardings of the abstract (logical) state it is given: each device
  reads only its shards, so a checkpoint restores at any (data, pipe, tensor, chunks) and
  process count. Leaves whose shape differs only in padded vocabulary rows (128 x tensor
  padding) are read at their saved shape and padded with zeros or sliced: padding rows
  never take part in the loss. Any other shape difference is a CheckpointError.
- Training never starts from garbage: a step that fails to read (a truncated or deleted
  file) on any process is reported with its path and moved aside to `<step>.corrupt`, and
  every process falls back together to the previous complete step. When none is readable
  the run stops with an `error:` line.
- The state holds everything a bitwise-identical resume needs: params, optimizer state,
  step, RNG key (the batch of step k is a pure function of the seed and k).
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import orbax.checkpoint as ocp

TMP_MARK = ".orbax-checkpoint-tmp"
LAYOUT_KEYS = ("data", "pipe", "tensor", "chunks")


class CheckpointError(ValueError):
    """A user-caused checkpoint problem (unwritable directory, unreadable step); one line."""


def check_writable(directory: str) -> str:
    """Creates `directory` if needed and proves a file can be written there."""
    directory = os.path.abspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir={directory}: not a writable directory ({e.strerror})") from None
    return directory


def layout_metadata(config, processes: int) -> dict:
    """What a step records about how it was written (JSON-serialisable)."""
    par = config.parallel
    return {**{k: getattr(par, k) for k in LAYOUT_KEYS}, "zero1": config.optimizer.zero1,
            "processes": processes, "padded_vocab": config.model.padded_vocab(par.tensor),
            "config": config.to_dict()}


def warn(message: str) -> None:
    import jax
    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a collective: all processes must call it)."""
    import jax
    import numpy as np
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# Status codes tensorstore puts in the message when a step's files are damaged or missing.
READ_ERROR_CODES = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                    "Error reading", "Error opening")


def _is_read_error(error: Exception) -> bool:
    """True for failures to read a step's files (damaged data), False for anything else.
    Orbax wraps tensorstore's error, so the whole chain of causes is examined."""
    while error is not None:
        if isinstance(error, OSError) or any(code in str(error) for code in READ_ERROR_CODES):
            return True
        error = error.__cause__ or error.__context__
    return False


class Checkpointer:
    """Saves every `every` steps (0: never), keeps `keep`, restores the newest good step."""

    def __init__(self, directory: str, every: int, keep: int, async_save: bool = True,
                 metadata: dict | None = None):
        self.directory = check_writable(directory)
        self.every, self.metadata = every, metadata or {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "layout": ocp.JsonCheckpointHandler()})

    def restore_latest(self, abstract_state, vocab_size: int):
        """(state, step) from the newest step that every process reads; None if no step.

        Skips half-written saves and falls back past unreadable steps, with warnings.
        Raises CheckpointError when steps exist but none can be read.
        """
        for name in sorted(os.listdir(self.directory)):
            if TMP_MARK in name:
                warn(f"skipping half-written checkpoint {os.path.join(self.directory, name)}")
        steps = sorted(self.manager.all_steps(), reverse=True)
        failures = []
        for step in steps:
            try:
                state, error = self.restore(abstract_state, step, vocab_size), None
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted by _is_read_error below
                if not _is_read_error(e):
                    raise  # a bug, not a damaged step: never move good checkpoints aside
                state, error = None, e
            if _all_agree(error is None):
                return state, step
            failures.append(self._set_aside(step, error))
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.directory}: "
                                  + "; ".join(failures))
        return None

    def _set_aside(self, step: int, error: Exception | None) -> str:
        """Reports an unreadable step and renames it so no later run or save meets it."""
        import jax
        from jax.experimental import multihost_utils
        path = os.path.join(self.directory, str(step))
        detail = " ".join(str(error).split())[:300] if error else "failed on another process"
        warn(f"checkpoint {path} is unreadable ({detail}); moved to {path}.corrupt, falling "
             "back to the previous step")
        if jax.process_index() == 0:
            os.replace(path, f"{path}.corrupt")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxptd-set-aside-{step}")
        self.manager.reload()
        return f"step {step}: {detail}"

    def restore(self, abstract_state, step: int, vocab_size: int):
        """Reads `step` into the shardings of `abstract_state` (the logical layout),
        padding or slicing padded-vocabulary rows when the tensor size changed."""
        import jax
        saved = self.manager.item_metadata(step)["state"]
        saved = saved.tree if hasattr(saved, "tree") else saved
        # Saved containers may differ in type (a NamedTuple comes back a dict): match by path.
        shapes = {_path_key(p): leaf.shape for p, leaf in
                  jax.tree_util.tree_leaves_with_path(saved)}
        targets = jax.tree_util.tree_map_with_path(
            lambda path, want: _read_target(path, want, shapes.get(_path_key(path)),
                                            vocab_size), abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(targets)))["state"]
        return jax.tree.map(_resize, restored, abstract_state)

    def has(self, step: int) -> bool:
        """True when `step` is on disk (or being saved)."""
        return step in self.manager.all_steps()

    def due(self, step: int) -> bool:
        """True when `step` is a save step not yet on disk."""
        return bool(self.every) and step % self.every == 0 and not self.has(step)

    def save(self, step: int, state) -> bool:
        """Starts an (asynchronous) save of the logical `state` at `step` (callers check
        `due` or `has` first, before converting the state)."""
        return self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), layout=ocp.args.JsonSave(self.metadata)))

    def close(self) -> None:
        """Waits for a save in flight to finish, then releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(e, "key", getattr(e, "name", getattr(e, "idx", e)))) for e in path)


def _read_target(path, want, have: tuple | None, vocab_size: int):
    """The ShapeDtypeStruct to read a saved leaf (of shape `have`) into: its saved shape
    when only padded vocabulary rows differ, else the target itself."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    name = jax.tree_util.keystr(path)
    if have is None:
        raise CheckpointError(f"checkpoint has no leaf {name}: written by a different model")
    have = tuple(have)
    if have == tuple(want.shape):
        return want
    if len(have) != len(want.shape) or any(
            h != w and min(h, w) < vocab_size for h, w in zip(have, want.shape)):
        raise CheckpointError(f"checkpoint leaf {name} has shape {have}, this "
                              f"run needs {tuple(want.shape)}: a different model")
    sharding = want.sharding
    mesh_sizes = dict(sharding.mesh.shape)
    for size, entry in zip(have, sharding.spec):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        if size % math.prod(mesh_sizes[a] for a in axes):
            sharding = NamedSharding(sharding.mesh, P())
    return jax.ShapeDtypeStruct(have, want.dtype, sharding=sharding)


def _resize(array, want):
    """Pads with zeros or slices `array` to `want`'s shape, in `want`'s sharding."""
    import jax
    import jax.numpy as jnp
    if array.shape == want.shape:
        return array

    def fit(x):
        x = x[tuple(slice(0, min(h, w)) for h, w in zip(x.shape, want.shape))]
        return jnp.pad(x, [(0, w - s) for s, w in zip(x.shape, want.shape)])

    return jax.jit(fit, out_shardings=want.sharding)(array)


def inspect(directory: str) -> list[dict]:
    """One record per step directory: step, complete, layout (None when unreadable)."""
    records = []
    for name in os.listdir(directory):
        step_text = name.split(".")[0]
        if not step_text.isdigit():
            continue
        path = os.path.join(directory, name)
        complete = name.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))
        try:
            with open(os.path.join(path, "layout", "metadata")) as f:
                layout = json.load(f)
        except (OSError, ValueError):
            layout = None
        status = "complete" if complete else "corrupt" if name.endswith(".corrupt") \
            else "half-written"
        records.append({"step": int(step_text), "path": path, "status": status,
                        "layout": layout})
    return sorted(records, key=lambda r: (r["step"], r["path"]))


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m jaxptd.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="list steps, their layout and completeness").add_argument(
        "directory")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"error: {args.directory}: not a checkpoint directory", file=sys.stderr)
        return 2
    for r in inspect(args.directory):
        layout = r["layout"] or {}
        shape = " ".join(f"{k}={layout[k]}" for k in (*LAYOUT_KEYS, "zero1", "processes")
                         if k in layout) or "layout unknown"
        print(f"step {r['step']:>8}  {r['status']:<12}  {shape}  {r['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
