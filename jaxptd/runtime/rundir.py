"""Who may write a run directory: one run at a time, and never over a history it would
not continue.

Owns three rules about `train.run_dir` and `checkpoint.dir`:

- `RunLock`: process 0 of a run holds an exclusive `flock` on `<dir>/.jaxptd.lock` in the
  run directory and, when it lies outside it, the checkpoint directory, from before the
  run writes anything there until it ends. The file names its holder (host, pid, start
  time). A second run is refused in one line naming the holder; the other processes of
  a multi-process run learn process 0's outcome (distributed.lead_decides) and stop with
  the same line. The kernel drops a flock when its process dies, however it dies
  (SIGKILL included), so a killed run never blocks the next one: what it leaves is a file
  that no longer locks anything. A holder checks after locking that the path still names
  the file it locked (a releasing run unlinks it first), so two runs never hold two
  files of one name. A file system without flock runs unlocked, with a warning.
- `unrestored_history`: a run that restores nothing starts from step 0, and would
  rewrite metrics.jsonl and config.yaml and save new steps beside old ones. That is
  refused (the caller raises it) when the directories show checkpoints of an earlier run
  that this one does not continue: damaged steps set aside as `<step>.corrupt` (after
  "no readable checkpoint") or steps in the checkpoint directory that the run
  directory's config.yaml names when this run's checkpoint.dir is another. A run killed
  before its first save left no checkpoint: retraining its steps loses nothing, and is
  allowed.
- `moved_record`: a run directory's config.yaml records where that run lay; given as
  `--config` from a copy or a moved directory, it would train into the recorded place,
  not the copy: said in a warning naming the override that continues the copy.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from jaxptd.runtime import distributed, runlog
from jaxptd.checkpoint import integrity
from jaxptd.config import ConfigError, load_config
from jaxptd.runtime.runlog import LOG

LOCK_NAME = ".jaxptd.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirError(ConfigError):
    """A run directory another run holds, or whose history a run would overwrite."""


class RunLock:
    """The locks of one run on its directories (see the module docstring). A context
    manager: leaving it releases whatever `acquire` took."""

    def __init__(self, config):
        run_dir, ckpt_dir = (os.path.abspath(d) for d in (config.train.run_dir,
                                                         config.checkpoint_dir))
        self.directories = [("train.run_dir", run_dir)]
        if os.path.commonpath([run_dir, ckpt_dir]) != run_dir:
            self.directories.append(("checkpoint.dir", ckpt_dir))
        self.held: list[tuple[str, int]] = []  # (lock file, its descriptor)

    def acquire(self, jax) -> None:
        """Locks the directories on process 0; raises RunDirError on every process when
        another run holds one. A collective."""
        message = self._take() if jax.process_index() == 0 else None
        message = distributed.lead_decides(jax, message)
        if message is not None:
            self.release()
            raise RunDirError(message)

    def _take(self) -> str | None:
        for key, directory in self.directories:
            if not os.path.isdir(directory):
                continue  # checkpoint.every=0 and no checkpoints: nothing to guard there
            path = os.path.join(directory, LOCK_NAME)
            try:
                fd = _lock(path)
            except BlockingIOError:
                return (f"{key}={directory} is in use by another run ({_holder(path)}); "
                        f"wait for it to end or stop it, or use another {key}")
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                LOG.warning(f"{key}={directory}: the file system cannot lock files "
                            f"({e.strerror}); two runs there at once would mix their files")
                continue
            self.held.append((path, fd))
        return None

    def release(self) -> None:
        for path, fd in reversed(self.held):
            try:
                os.unlink(path)  # before unlocking: a waiting run then finds a new file
            except OSError:
                pass
            os.close(fd)
        self.held = []

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _lock(path: str) -> int:
    """A descriptor of `path` holding its exclusive flock, the holder written into it.
    Raises BlockingIOError while another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # unlinked by its releasing holder after we opened it: again
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return fd


def _holder(path: str) -> str:
    """'process 123 on host, since ...' from a lock file, as far as it can be read."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return f"process {holder['pid']} on {holder['host']}, since {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock {path} names no holder yet"


def unrestored_history(config) -> str | None:
    """Why a run of `config` that restored nothing must not start from step 0 (see the
    module docstring), or None."""
    run_dir, ckpt_dir = config.train.run_dir, os.path.abspath(config.checkpoint_dir)
    trained = runlog.trained_to(run_dir)
    history = f", of a run trained to step {trained} (train.run_dir={run_dir})" \
        if trained else ""
    aside = [os.path.basename(r["path"]) for r in _steps(ckpt_dir)
             if r["status"] == "corrupt"]
    if aside:
        return (f"checkpoint.dir={ckpt_dir} holds no readable checkpoint, only damaged "
                f"steps set aside ({', '.join(aside)}){history}: a run from step 0 would "
                "write over that history; to start over, move the .corrupt steps out of it, "
                "or use a new train.run_dir and checkpoint.dir")
    previous = _previous_checkpoint_dir(run_dir)
    if previous not in (None, ckpt_dir) and _steps(previous):
        trained = f", trained to step {trained}," if trained else ""
        return (f"the run in train.run_dir={run_dir}{trained} keeps its checkpoints in "
                f"{previous} (its config.yaml), and checkpoint.dir={ckpt_dir} holds none: a "
                f"run from step 0 would write over its history; set checkpoint.dir={previous}"
                " to continue it, or use a new train.run_dir")
    return None


def _steps(directory: str) -> list[dict]:
    """integrity.inspect's records of the saved (not half-written) steps in `directory`."""
    return [r for r in integrity.inspect(directory) if r["status"] != "half-written"] \
        if os.path.isdir(directory) else []


def _previous_checkpoint_dir(run_dir: str) -> str | None:
    """checkpoint.dir of the config.yaml a run left in `run_dir` (None: none readable)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    try:
        return os.path.abspath(load_config(path).checkpoint_dir)
    except ConfigError:
        return None


def moved_record(config_path: str | None, config) -> str | None:
    """A warning when `config_path` is the config.yaml of a run directory (one holding
    starts/ or checkpoints/) other than the train.run_dir it gives: a copied or moved run
    directory; None otherwise."""
    if not config_path or os.path.basename(config_path) != "config.yaml":
        return None
    here = os.path.dirname(os.path.abspath(config_path))
    if not any(os.path.isdir(os.path.join(here, d)) for d in (runlog.STARTS, "checkpoints")):
        return None
    recorded = os.path.abspath(config.train.run_dir)
    if recorded == here:
        return None
    return (f"--config {config_path} is the record of a run directory now at {here}; this "
            f"run writes into train.run_dir={recorded}, the directory it records: add "
            f"train.run_dir={here} checkpoint.dir={os.path.join(here, 'checkpoints')} to "
            "continue the copy")
