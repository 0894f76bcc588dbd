"""How the bench scripts name their result files, write and print their tables and time a
step.

A result file is <out_dir>/<prefix>_<device kind>.json, the device kind with every run of
characters other than letters, digits and '.' made one '_' (e.g.
gpu_train_NVIDIA_H100_80GB_HBM3.json), so results of different devices sit side by side
and each name is one the device machines hand back.
"""
from __future__ import annotations

import datetime
import json
import pathlib
import re
import statistics
import time


def result_path(out_dir, prefix: str, device_kind: str) -> pathlib.Path:
    """<out_dir>/<prefix>_<device kind made a file name>.json"""
    name = re.sub(r"[^A-Za-z0-9.]+", "_", device_kind).strip("_")
    return pathlib.Path(out_dir) / f"{prefix}_{name}.json"


def write_rows(path: str, rows: list, **more) -> None:
    """A table's rows as JSON at path: {"date": today, **more, "rows": rows}."""
    with open(path, "w") as f:
        json.dump({"date": str(datetime.date.today()), **more, "rows": rows}, f, indent=1)


def cell(value, fmt: str, width: int) -> str:
    """One table cell: blank for None; text left-aligned, numbers right-aligned."""
    return " " * width if value is None else format(value, f"{width}{fmt}")


def time_steps(step, state, batch, warmup: int, reps: int):
    """(state after the runs, median seconds of `reps` runs of state, out = step(state,
    batch) after `warmup` untimed ones, the last out), each run waited for."""
    import jax

    for _ in range(warmup):
        state, out = step(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return state, statistics.median(times), out
