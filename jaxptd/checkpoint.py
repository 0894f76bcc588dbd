"""Checkpoints: Orbax only. Save asynchronously, keep the newest K, restore into shardings.

Owns where the train state goes on disk and how it comes back. Invariants:

- A save is written under a temporary name and renamed when complete (Orbax's atomic
  finalize), so a save killed halfway is never a step that `latest_step` returns.
- Restore reads into the shardings of the abstract state it is given: each device reads
  only its shards, and the on-disk layout does not tie the run to the mesh it was saved on.
- The state holds everything a bitwise-identical resume needs: params, optimizer state,
  step, RNG key (the batch of step k is a pure function of the seed and k).
"""
from __future__ import annotations

import os
import tempfile

import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A user-caused checkpoint problem (unwritable directory); one-line message."""


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


class Checkpointer:
    """Saves every `every` steps (0: never), keeps `keep`, restores the newest step."""

    def __init__(self, directory: str, every: int, keep: int, async_save: bool = True):
        self.directory = check_writable(directory)
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete step on disk, or None."""
        return self.manager.latest_step()

    def restore(self, abstract_state, step: int | None = None):
        """Reads `step` (default: newest) into the shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Starts an (asynchronous) save of `state` at `step` when it is due or forced."""
        if not force and (self.every == 0 or step % self.every):
            return False
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def close(self) -> None:
        """Waits for a save in flight to finish, then releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
