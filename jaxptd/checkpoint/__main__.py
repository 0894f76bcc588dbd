"""`python -m jaxptd.checkpoint inspect DIR` (a checkpoint, run or step directory): lists
the steps, the layout each was written with, whether each passes the cheap checks and
which one a run would resume from; its exit status says so to scripts (INSPECT_STATUS).
Reads files only: neither JAX nor Orbax is imported.
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxptd.checkpoint.files import LAYOUT_KEYS, find_checkpoints
from jaxptd.checkpoint.integrity import inspect

INSPECT_STATUS = """exit status: 0 every step passes the cheap checks and a run resumes from
the newest; 1 a run resumes from a step that passes them, but some step is damaged,
half-written or set aside as <step>.corrupt; 2 no step would restore (or no checkpoints
were found: an error line)"""


def main(argv=None) -> int:
    """`inspect DIR`: lists the steps; the exit status is INSPECT_STATUS's."""
    parser = argparse.ArgumentParser(prog="python -m jaxptd.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="list the steps, their layout, whether each passes the "
                   "cheap checks and which one a run resumes from", epilog=INSPECT_STATUS
                   ).add_argument("directory", help="a checkpoint directory, a run directory "
                                  "or one step")
    args = parser.parse_args(argv)
    if not os.path.exists(args.directory):
        print(f"error: {args.directory}: no such file or directory", file=sys.stderr)
        return 2
    directory = find_checkpoints(args.directory)
    if directory is None:
        print(f"error: {args.directory}: no checkpoints found (looked for step directories "
              "there, in its checkpoints/ and in its config.yaml's checkpoint.dir)",
              file=sys.stderr)
        return 2
    records = inspect(directory)
    resume = max((r["step"] for r in records if r["status"] == "complete"), default=None)
    print(f"{directory}: {len(records)} step director{'y' if len(records) == 1 else 'ies'}; "
          + (f"a run resumes from step {resume}" if resume is not None
             else "none would restore"))
    for r in records:
        layout = r["layout"] or {}
        shape = " ".join(f"{k}={layout[k]}" for k in (*LAYOUT_KEYS, "zero1", "processes")
                         if k in layout) or "layout unknown"
        status = f"{r['status']} ({r['problem']})" if r["problem"] else r["status"]
        mark = "  <- resume" if r["step"] == resume and r["status"] == "complete" else ""
        print(f"step {r['step']:>8}  {status:<12}  {shape}  {r['path']}{mark}")
    if resume is None:
        return 2
    return 0 if all(r["status"] == "complete" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
