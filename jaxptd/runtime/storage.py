"""Writing files: whole or not at all, and a failed write as one line saying what to do.

Owns what every writer in jaxptd (checkpoints, the run directory's config, log and
metrics, prepared data) does about the storage under it:

- `atomic_write(path, text)`: the text goes to a temporary sibling, is fsynced and renamed
  over `path`, so `path` holds its old content or its new one, never a truncated or empty
  file, whatever fails in between (a full disk, a kill).
- `write_failure(error)`: a failure of the storage itself that the user can fix (no space,
  a quota, a file-size limit such as `ulimit -f`, a read-only file system), found anywhere
  in the error's chain of causes, as Python's OSError or as the status text of
  tensorstore, which Orbax wraps. Anything else is None: a bug stays a traceback.
- `guard(where)`: around a writer, turns such a failure into a `StorageError`, the one
  line an entry point prints as `error:` with exit status 2: where, what happened, what
  to do. The checkpointer builds its own line from `write_failure` (the bytes its save
  needs, the steps kept, the half-written step removed).

Standard library only: the data package (no JAX) uses it.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import NamedTuple

# The failures a user fixes on the storage side, and how.
REMEDIES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise the quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EROFS: "write to a writable file system",
}
SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageError(Exception):
    """A write the storage refused (a full disk, a file-size limit); one line."""


class WriteFailure(NamedTuple):
    code: int  # an errno of REMEDIES

    @property
    def reason(self) -> str:
        return os.strerror(self.code).lower()  # "no space left on device"

    @property
    def remedy(self) -> str:
        return REMEDIES[self.code]

    @property
    def space(self) -> bool:
        """Whether more free space (or a smaller output) fixes it."""
        return self.code in SPACE


def causes(error: BaseException | None):
    """`error` and the exceptions it was raised from or during, innermost last."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def write_failure(error: BaseException) -> WriteFailure | None:
    """The storage failure behind `error` (see the module docstring), or None."""
    for e in causes(error):
        if isinstance(e, OSError) and e.errno in REMEDIES:
            return WriteFailure(e.errno)
        text = str(e)  # tensorstore: "... File too large [os_error_code='27']"
        for code in REMEDIES:
            if f"os_error_code='{code}'" in text or os.strerror(code) in text:
                return WriteFailure(code)
    return None


def storage_error(error: BaseException, where: str, doing: str) -> StorageError | None:
    """'<where>: <reason> while <doing>; <what to do>' for a storage failure, else None."""
    failure = write_failure(error)
    if failure is None:
        return None
    return StorageError(f"{where}: {failure.reason} while {doing}; {failure.remedy}")


@contextmanager
def guard(where: str, doing: str):
    """Raises storage_error's StorageError for a storage failure inside the block; other
    errors pass through unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - storage_error decides, the rest is re-raised
        failure = storage_error(e, where, doing)
        if failure is None:
            raise
        raise failure from None


def atomic_write(path: str, text: str) -> None:
    """Replaces `path` with `text` (UTF-8) all at once (see the module docstring)."""
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
