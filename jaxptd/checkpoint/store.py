"""Saving and restoring the train state with Orbax: asynchronously, the newest K kept,
restored into any layout.

Owns `Checkpointer`: where the train state goes on disk and how it comes back (the
directory's format: files.py; the checks: integrity.py and checksums.py).

Invariants:

- A save is written under a temporary name and renamed when complete (Orbax's atomic
  finalize), so a save killed halfway is never a step that restore picks; it is skipped with
  a warning naming it. A save that fails (a full disk) is one CheckpointError naming the
  directory, the bytes it needed and what to do; so is a file-size limit (`ulimit -f`)
  or a read-only file system (storage.write_failure). Its temporary directory is removed,
  and removed again until no write of that save is left to recreate it (Orbax stops
  waiting at the first failed write; the writes already issued go on, and succeed once
  the removal frees space).
- Restore reads into the shardings of the abstract (logical) state it is given: each device
  reads only its shards, so a checkpoint restores at any (data, pipe, tensor, chunks) and
  process count. Leaves whose shape differs only in padded vocabulary rows (128 x tensor
  padding) are read at their saved shape and padded with zeros or sliced: the padding is
  zeros from initialisation on (jaxptd/model/stack.py), so this gives what a run
  initialised at the new size would hold. A whole step whose arrays differ otherwise is a
  CheckpointError ("a different model").
- Training never starts from garbage: a step that fails the cheap checks, fails to read,
  or whose arrays do not match their checksums, on any process, is reported in one line
  and moved aside to `<step>.corrupt`, and every process falls back together to the
  previous step. When none is readable the run stops with an `error:` line.
- The state holds everything a bitwise-identical resume needs: params, optimizer state,
  step, RNG key (the batch of step k is a pure function of the seed and k).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd.runtime import storage
from jaxptd.checkpoint import CheckpointError, ModelMismatch
from jaxptd.checkpoint.checksums import array_checksums, checksum_mismatch, leaf_name
from jaxptd.checkpoint.files import (TMP_MARK, check_writable, read_layout, step_files,
                                     write_file_list)
from jaxptd.checkpoint.integrity import check_step
from jaxptd.runtime.runlog import LOG, human_bytes, one_line


class _Damaged(Exception):
    """A step that fails a check (its message is one short line)."""


def _all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# Status codes tensorstore puts in the message when a step's files are damaged or missing.
READ_ERROR_CODES = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                    "Error reading", "Error opening", "error while reading")


def _is_read_error(error: Exception) -> bool:
    """True for failures to read a step's files (damaged data), False for anything else
    (a bug must not move good steps aside). Orbax wraps tensorstore's error, so the whole
    chain of causes is examined."""
    return any(isinstance(e, (OSError, UnicodeDecodeError, json.JSONDecodeError))
               or any(code in str(e) for code in READ_ERROR_CODES) for e in storage.causes(error))


class Checkpointer:
    """Saves every `every` steps (0: never), keeps `keep`, restores the newest good step.

    Saves run in the background unless `async_save` is False. `completed()` hands back
    (step, seconds, bytes) of the saves finished since the last call (process 0 only).
    """

    def __init__(self, directory: str, every: int, keep: int, async_save: bool = True,
                 metadata: dict | None = None):
        self.directory = check_writable(directory)
        self.every, self.metadata, self.async_save = every, metadata or {}, async_save
        self._pending: tuple[int, float, int] | None = None  # step, start time, state bytes
        self._finished: list[tuple[int, float, int]] = []
        self._failed = False
        self._clock = time.monotonic
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_files))
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "layout": ocp.JsonCheckpointHandler()})

    def _record_files(self) -> None:
        """Process 0, after every process has written the step, before Orbax renames it:
        the step's file list, which thereby belongs to the atomic save."""
        step, started, _ = self._pending
        prefix = f"{step}{TMP_MARK}"
        for name in os.listdir(self.directory):
            if name.startswith(prefix):
                path = os.path.join(self.directory, name)
                write_file_list(path)
                size = sum(n or 0 for n in step_files(path).values())
                self._finished.append((step, self._clock() - started, size))

    def completed(self) -> list[tuple[int, float, int]]:
        """(step, seconds, bytes on disk) of each save finished since the last call."""
        done, self._finished[:] = list(self._finished), []
        return done

    def restore_latest(self, abstract_state, vocab_size: int):
        """(state, step) from the newest step that every process reads; None if no step.

        Removes half-written saves (the caller holds the run's lock) and sets damaged steps
        aside, one warning line each.
        Raises CheckpointError when steps exist but none can be read, or when a whole step
        was written by a different model.
        """
        self.remove_half_written()
        failures = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            state, problem = self._try_restore(abstract_state, step, vocab_size)
            if problem is None:
                return state, step
            failures.append(self._set_aside(step, problem))
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.directory}: "
                                  + "; ".join(failures) + " (each moved to <step>.corrupt)")
        return None

    def remove_half_written(self) -> None:
        """Removes the saves killed before their rename (never a complete step), one
        warning line each. The caller holds the run's lock: no other save is writing."""
        for name in sorted(os.listdir(self.directory)):
            if TMP_MARK in name:
                path = os.path.join(self.directory, name)
                if jax.process_index() == 0:
                    shutil.rmtree(path, ignore_errors=True)
                LOG.warning(f"removed half-written checkpoint {path} (a save that did not "
                            "finish)")

    def _try_restore(self, abstract_state, step: int, vocab_size: int):
        """(state, None) or (None, why the step is damaged), agreed by every process."""
        problem = check_step(os.path.join(self.directory, str(step)))
        if not _all_agree(problem is None):
            return None, problem or "failed on another process"
        state = None
        try:
            state = self.restore(abstract_state, step, vocab_size)
        except CheckpointError:
            raise
        except _Damaged as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - sorted by _is_read_error below
            if not _is_read_error(e):
                raise  # a bug, not a damaged step: never move good checkpoints aside
            problem = one_line(e)
        if not _all_agree(problem is None):
            return None, problem or "failed on another process"
        return state, None

    def _set_aside(self, step: int, problem: str) -> str:
        """Reports a damaged step and renames it so no later run or save meets it."""
        path = os.path.join(self.directory, str(step))
        aside, n = f"{path}.corrupt", 0
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.corrupt-{n}"
        LOG.warning(f"checkpoint step {step} is damaged ({problem}); moved to {aside}, falling "
             "back to the previous step")
        if jax.process_index() == 0:
            os.replace(path, aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxptd-set-aside-{step}")
        self.manager.reload()
        return f"step {step}: {problem}"

    def restore(self, abstract_state, step: int, vocab_size: int):
        """Reads `step` into the shardings of `abstract_state` (the logical layout),
        padding or slicing padded-vocabulary rows when the tensor size changed, and checks
        the arrays against the checksums the save recorded (_Damaged when they differ)."""
        saved = self.manager.item_metadata(step)["state"]
        saved = saved.tree if hasattr(saved, "tree") else saved
        # Saved containers may differ in type (a NamedTuple comes back a dict): match by path.
        shapes = {leaf_name(p): leaf.shape for p, leaf in
                  jax.tree_util.tree_leaves_with_path(saved)}
        targets = jax.tree_util.tree_map_with_path(
            lambda path, want: read_target(path, want, shapes.get(leaf_name(path)),
                                            vocab_size), abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(targets)))["state"]
        mismatch = checksum_mismatch(restored, (self.layout(step) or {}).get(
            "checksums"))
        if mismatch:
            raise _Damaged(mismatch)
        return jax.tree.map(resize, restored, abstract_state)

    def layout(self, step: int) -> dict | None:
        """The layout item of `step` (how it was written, its config and checksums)."""
        return read_layout(os.path.join(self.directory, str(step)))

    def has(self, step: int) -> bool:
        """True when `step` is on disk (or being saved)."""
        return step in self.manager.all_steps()

    def due(self, step: int) -> bool:
        """True when `step` is a save step not yet on disk."""
        return bool(self.every) and step % self.every == 0 and not self.has(step)

    def save(self, step: int, state) -> bool:
        """Starts a save of the logical `state` at `step` (callers check `due` or `has`
        first, before converting the state); waits for it unless saving asynchronously.
        Raises CheckpointError when this or the previous save finds the disk full."""
        try:
            self.manager.wait_until_finished()  # a failure of the previous save shows here
        except Exception as e:  # noqa: BLE001 - _save_failed re-raises what is not a full disk
            self._save_failed(e)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        self._pending = (step, self._clock(), nbytes)
        metadata = {**self.metadata, "checksums": array_checksums(state)}
        try:
            saved = self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), layout=ocp.args.JsonSave(metadata)))
            if not self.async_save:
                self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._save_failed(e)
        return saved

    def _save_failed(self, error: Exception):
        """A storage failure (a full disk, a file-size limit: storage.write_failure)
        becomes one CheckpointError saying what to do (the half-written step removed);
        anything else is re-raised."""
        failure = storage.write_failure(error)
        if failure is None:
            raise error
        self._failed = True
        step, _, nbytes = self._pending
        if jax.process_index() == 0:
            self._remove_until_quiet(step)
        free = shutil.disk_usage(self.directory).free
        kept = sorted(s for s in self.manager.all_steps() if s != step)
        intact = "no earlier step was saved" if not kept else \
            f"step {kept[0]} is intact" if len(kept) == 1 else \
            f"steps {', '.join(map(str, kept))} are intact"
        # a lower checkpoint.keep frees space only where more than one earlier step is kept
        remedy = failure.remedy + (" or lower checkpoint.keep" if failure.space and len(kept) > 1
                                   else "")
        raise CheckpointError(
            f"checkpoint.dir={self.directory}: {failure.reason} while saving step {step}: "
            f"the save needs about {human_bytes(nbytes)} ({nbytes} bytes), "
            f"{human_bytes(free)} free; {intact}; {remedy}") from None

    def _remove_until_quiet(self, step: int, quiet_s: float = 1.0, limit_s: float = 30.0):
        """Removes step's temporary directory until it stays absent for quiet_s: writes of
        the failed save still in flight recreate it (measured: 1 in 6 runs under load)."""
        start = last_seen = time.monotonic()
        while time.monotonic() - last_seen < quiet_s and time.monotonic() - start < limit_s:
            for name in os.listdir(self.directory):
                if name.startswith(f"{step}{TMP_MARK}"):
                    last_seen = time.monotonic()
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            time.sleep(0.05)

    def close(self) -> None:
        """Waits for a save in flight to finish, then releases the manager."""
        if self._failed:  # the manager holds the failed save's error: do not raise it again
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001
                pass
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._save_failed(e)
        self.manager.close()


def read_target(path, want, have: tuple | None, vocab_size: int):
    """The ShapeDtypeStruct to read a saved leaf (of shape `have`) into: its saved shape
    when only padded vocabulary rows differ, else the target itself."""
    name = jax.tree_util.keystr(path)
    if have is None:
        raise ModelMismatch(f"checkpoint has no leaf {name}: written by a different model")
    have = tuple(have)
    if have == tuple(want.shape):
        return want
    if len(have) != len(want.shape) or any(
            h != w and min(h, w) < vocab_size for h, w in zip(have, want.shape)):
        raise ModelMismatch(f"checkpoint leaf {name} has shape {have}, this "
                              f"run needs {tuple(want.shape)}: a different model")
    sharding = want.sharding
    mesh_sizes = dict(sharding.mesh.shape)
    for size, entry in zip(have, sharding.spec):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        if size % math.prod(mesh_sizes[a] for a in axes):
            sharding = NamedSharding(sharding.mesh, P())
    return jax.ShapeDtypeStruct(have, want.dtype, sharding=sharding)


def resize(array, want):
    """Pads with zeros or slices `array` to `want`'s shape, in `want`'s sharding."""
    if array.shape == want.shape:
        return array

    def fit(x):
        x = x[tuple(slice(0, min(h, w)) for h, w in zip(x.shape, want.shape))]
        return jnp.pad(x, [(0, w - s) for s, w in zip(x.shape, want.shape)])

    return jax.jit(fit, out_shardings=want.sharding)(array)
