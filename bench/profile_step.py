"""Where one training step's time goes: a jax.profiler trace of one step, summed by XLA op.

The step is built as bench/gpu_train.py builds it (same model names and variants) and run
--warmup times; then one step is traced with `jax.profiler.trace` and the trace read back
with `jax.profiler.ProfileData` (part of jaxlib: no TensorFlow, TensorBoard or xprof).
Device time is summed per HLO instruction: on a GPU, the kernels and copies on the CUDA
stream lines, each attributed to the HLO op its `hlo_op` stat names (one op may launch
several kernels; a kernel without that stat counts under its own name); on CPU, the XLA
thunks on the host threads. Each op gets its category from the compiled HLO text
(opcode; fusion kind and backend kind, e.g. a Triton GEMM; custom-call target, e.g.
cuBLAS or cuDNN) and the JAX operation it came from (its metadata op_name).

    python -m bench.profile_step --model gpt-1.3B [--variant base] [--top 25]

Prints the top ops and the time by category; writes <--out-dir>/profile_<model>_<device>.json
(bench/report.py names it). Streams overlap, so the op times can add up to more than the
step's wall time.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import re
import shlex
import sys
import tempfile
import time

from bench import gpu_train
from bench.report import result_path

HLO_LINE = re.compile(r"\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?:.*?\s)?(?P<op>[a-z][\w\-]*)\("
                      r"(?P<rest>.*)")


def hlo_ops(hlo_text: str) -> dict:
    """{instruction name: (category, JAX op name)} for every instruction of the module."""
    ops = {}
    for line in hlo_text.splitlines():
        match = HLO_LINE.match(line)
        if not match:
            continue
        op, rest = match["op"], match["rest"]
        detail = [re.search(pattern, rest) for pattern in {
            "fusion": (r"kind=(k\w+)", r'"kind":"([^"]+)"'),
            "custom-call": (r'custom_call_target="([^"]+)"',)}.get(op, ())]
        category = ":".join([op] + [d.group(1) for d in detail if d])
        source = re.search(r'op_name="([^"]+)"', rest)
        ops[match["name"]] = (category, source.group(1)[-120:] if source else "")
    return ops


def self_times(events: list) -> list:
    """[(name, start, end)] of one trace line -> [(name, self ns)]: an event's time less
    the events nested in it (on CPU a while loop's thunk spans its body's thunks)."""
    stack, out = [], []
    for name, start, end in sorted(events, key=lambda e: (e[1], -e[2])):
        while stack and stack[-1][2] <= start:
            stack.pop()
        if stack:
            stack[-1][3] -= min(end, stack[-1][2]) - start
        stack.append([name, start, end, end - start])
        out.append(stack[-1])
    return [(name, own) for name, _, _, own in out]


def line_events(profile, device: bool):
    """Per trace line, [(op, start ns, end ns)]. device: the stream lines of the device
    planes, every event (its op named by its `hlo_op` stat, else by its own name); else
    the host planes' events that have an `hlo_op` stat."""
    for plane in profile.planes:
        if not plane.name.startswith("/device:" if device else "/host:"):
            continue
        for line in plane.lines:
            if device and not line.name.lower().startswith("stream"):
                continue
            events = []
            for event in line.events:
                op = dict(event.stats).get("hlo_op") or (event.name if device else None)
                if op:
                    events.append((op, event.start_ns, event.end_ns))
            yield events


def op_times(profile) -> dict:
    """{op name: [self nanoseconds, events]} from a ProfileData: the device's stream lines
    when the trace has any (GPU), else the host's XLA events (CPU)."""
    lines = [events for events in line_events(profile, True) if events]
    totals = collections.defaultdict(lambda: [0, 0])
    for events in lines or line_events(profile, False):
        for name, own in self_times(events):
            totals[name][0] += own
            totals[name][1] += 1
    return dict(totals)


def summarise(times: dict, ops: dict, top: int) -> dict:
    """The `top` ops by time and the time of every category, in ms and percent of the sum."""
    total = sum(ns for ns, _ in times.values()) or 1

    def lookup(name):  # a kernel named after its op: loop_fusion_52 for loop_fusion.52
        return ops.get(name) or ops.get(re.sub(r"_(\d+)$", r".\1", name)) or ("kernel", "")

    rows = [{"op": name, "category": lookup(name)[0], "source": lookup(name)[1],
             "ms": ns / 1e6, "percent": 100 * ns / total, "events": count}
            for name, (ns, count) in sorted(times.items(), key=lambda kv: -kv[1][0])]
    by_category = collections.defaultdict(lambda: {"ms": 0.0, "percent": 0.0, "ops": 0})
    for row in rows:
        entry = by_category[row["category"]]
        entry.update(ms=entry["ms"] + row["ms"], percent=entry["percent"] + row["percent"],
                     ops=entry["ops"] + 1)
    categories = [{"category": c, **entry}
                  for c, entry in sorted(by_category.items(), key=lambda kv: -kv[1]["ms"])]
    return {"op_time_ms": total / 1e6, "ops": rows[:top], "categories": categories}


def trace_one_step(step, state, batch):
    """(ProfileData of one traced step, its wall seconds)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(step(state, batch))
        seconds = time.perf_counter() - start
        (path,) = pathlib.Path(trace_dir).rglob("*.xplane.pb")
        return ProfileData.from_file(str(path)), seconds


def print_summary(summary: dict, top_categories: int = 10) -> None:
    print(f"{'ms':>9} {'%':>6} {'events':>6}  op  [category]  source")
    for row in summary["ops"]:
        print(f"{row['ms']:9.3f} {row['percent']:6.2f} {row['events']:6d}  {row['op']}  "
              f"[{row['category']}]  {row['source']}")
    print(f"{'ms':>9} {'%':>6} {'ops':>6}  category")
    for row in summary["categories"][:top_categories]:
        print(f"{row['ms']:9.3f} {row['percent']:6.2f} {row['ops']:6d}  {row['category']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-1.3B")
    parser.add_argument("--variant", default="base")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out-dir", default="bench/results")
    parser.error = gpu_train._fail
    args = parser.parse_args(argv)
    try:
        job = gpu_train.make_job(args.model, args.variant, args.global_batch)
        gpu_train.check_out_dir(args.out_dir)
    except gpu_train.BenchError as e:
        gpu_train._fail(str(e))
    if job.skipped:
        print(f"{args.model}: skipped: {job.skipped}")
        return 0
    setup, state, batch, step, _, compile_s = gpu_train.compile_for(job.config())
    device = setup.mesh.devices.flat[0]
    state = gpu_train.run_steps(step, state, batch, args.warmup)[0]
    profile, step_s = trace_one_step(step, state, batch)
    summary = summarise(op_times(profile), hlo_ops(step.as_text()), args.top)
    command = "python -m bench.profile_step " + shlex.join(argv)
    print(f"{args.model} {args.variant} on {device.device_kind}: traced step {step_s * 1e3:.1f}"
          f" ms, op time {summary['op_time_ms']:.1f} ms")
    print_summary(summary)
    path = result_path(args.out_dir, f"profile_{args.model}", device.device_kind)
    path.write_text(json.dumps(dict(
        device=device.device_kind, jax=gpu_train.version("jax"), model=args.model,
        variant=args.variant, date=str(datetime.date.today()), command=command,
        compile_s=compile_s, traced_step_s=step_s, **summary), indent=1))
    print(f"reproduce: {command}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
