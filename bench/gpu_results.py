"""The results file of bench/gpu_train.py: merging runs into it, its summary, its table.

One file per device kind, gpu_train_<device>.json (bench/report.py names it):

    device, platform, date, jax, torch       where and with what it was last written
    global_batch, steps, warmup              the last invocation's settings
    command                                  every invocation that wrote to it, in order
    runs        jaxptd, one per (model, variant): configuration, step time, tokens/s,
                TFLOP/s and MFU (eq. 3 and 6N), peak memory, compile time, losses, the
                command that reproduces it; `error` when it failed, `skipped` when not run
    baselines   PyTorch (bench/torch_gpt.py), one per (model, microbatch size)
    models      derived: each model's base run beside its baseline (the BENCHMARKS table)

Runs replace earlier ones of the same key, so parts measured in separate commands
accumulate. `python -m bench.gpu_results FILE` prints the table of a file.
"""
from __future__ import annotations

import json
import pathlib
import sys

from jaxptd.units import GB
from bench.report import cell

SUMMARY = ("tokens_per_s", "tflops_per_device", "mfu", "tflops_6n", "mfu_6n",
           "peak_memory_bytes", "microbatch_size")
COLUMNS = (  # header, key, format, width; text left-aligned
    ("model", "model", "", 10), ("variant", "variant", "", 32), ("b", "microbatch_size", "d", 3),
    ("m", "microbatches", "d", 3), ("step ms", "step_ms", ".1f", 9),
    ("tokens/s", "tokens_per_s", ".0f", 9), ("TFLOP/s", "tflops_per_device", ".1f", 8),
    ("MFU", "mfu", ".1%", 6), ("6N TF/s", "tflops_6n", ".1f", 8), ("6N MFU", "mfu_6n", ".1%", 7),
    ("peak GB", "peak_gb", ".1f", 8), ("compile s", "compile_s", ".0f", 9),
    ("torch tok/s", "baseline_tokens_per_s", ".0f", 11), ("x torch", "speedup", ".2f", 7))


def load(path: pathlib.Path, previous: pathlib.Path | None = None) -> dict:
    """The file at `path`, else the one at `previous` (an earlier command's), else empty."""
    for source in (path, previous):
        if source is not None and source.exists():
            return json.loads(source.read_text())
    return {"command": [], "runs": [], "baselines": []}


def upsert(rows: list, row: dict, keys: tuple) -> None:
    """Replaces the row with the same values at `keys`, or appends it."""
    for i, old in enumerate(rows):
        if all(old.get(k) == row.get(k) for k in keys):
            rows[i] = row
            return
    rows.append(row)


def summarise(doc: dict) -> list:
    """`models`: each model's base run beside the PyTorch run of the same microbatch size."""
    summary = []
    for run in (r for r in doc["runs"] if r["variant"] == "base"):
        base = next((b for b in doc["baselines"] if b["model"] == run["model"]
                     and b.get("microbatch_size") == run.get("microbatch_size")), {})
        speedup = None
        if run.get("tokens_per_s") and base.get("tokens_per_s"):
            speedup = run["tokens_per_s"] / base["tokens_per_s"]
        summary.append({"model": run["model"], **{k: run.get(k) for k in SUMMARY},
                        "baseline_tokens_per_s": base.get("tokens_per_s"),
                        "baseline_peak_memory_bytes": base.get("peak_memory_bytes"),
                        "speedup": speedup, "error": run.get("error") or run.get("skipped"),
                        "baseline_error": base.get("error") or base.get("skipped")})
    return summary


def save(path: pathlib.Path, doc: dict) -> None:
    """Writes `doc` with its `models` summary brought up to date, the header first."""
    doc["models"] = summarise(doc)
    head = [k for k in doc if k not in ("command", "models", "runs", "baselines")]
    order = [*head, "command", "models", "runs", "baselines"]
    path.write_text(json.dumps({k: doc[k] for k in order}, indent=1))


def _problem(row: dict) -> str | None:
    """'error: ...' or 'skipped: ...' for a row that did not measure, else None."""
    return next((f"{kind}: {row[kind]}" for kind in ("error", "skipped") if row.get(kind)), None)


def _baseline(row: dict) -> str:
    """A baseline's problem, or what it measured (shown where its jaxptd row failed)."""
    return _problem(row) or (f"{row['tokens_per_s']:.0f} tokens/s, step "
                             f"{row['step_time_s'] * 1e3:.1f} ms, peak "
                             f"{row['peak_memory_bytes'] / GB:.1f} GB")


def _line(run: dict, summary: dict) -> str:
    row = dict(run, step_ms=run["step_time_s"] * 1e3 if "step_time_s" in run else None,
               peak_gb=run["peak_memory_bytes"] / GB if run.get("peak_memory_bytes") else None)
    if run["variant"] == "base":
        row.update((k, summary.get(run["model"], {}).get(k))
                   for k in ("baseline_tokens_per_s", "speedup"))
    problem = _problem(run)
    columns = COLUMNS[:2] if problem else COLUMNS
    cells = [cell(row.get(key), fmt, width) for _, key, fmt, width in columns]
    return " ".join(cells + [problem or ""]).rstrip()


def table(doc: dict, keys: list | None = None) -> str:
    """The runs of the file (those of `keys`, (model, variant) pairs, when given), one line
    each; base runs with their PyTorch baseline."""
    summary = {row["model"]: row for row in summarise(doc)}
    runs = [r for r in doc["runs"] if keys is None or (r["model"], r["variant"]) in keys]
    models = list(dict.fromkeys(r["model"] for r in runs))
    runs.sort(key=lambda r: models.index(r["model"]))  # grouped by model, stable
    lines = [f"device: {doc['device']}; jax {doc['jax']}, torch {doc['torch']}; "
             f"{doc['global_batch']} sequences a step, median of {doc['steps']} steps after "
             f"{doc['warmup']}",
             " ".join(f"{header:>{width}}" if fmt else f"{header:<{width}}"
                      for header, _, fmt, width in COLUMNS)]
    lines += [_line(run, summary) for run in runs]
    failed = {r["model"] for r in runs if r["variant"] == "base" and _problem(r)}
    lines += [f"torch baseline {b['model']} b={b.get('microbatch_size')}: {_baseline(b)}"
              for b in doc["baselines"]
              if b["model"] in models and (_problem(b) or b["model"] in failed)]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(table(json.loads(pathlib.Path(name).read_text())))
