"""The H100 issue's table: GPT-1.3B (and Llama, BERT of its size) compiled for 8 H100s
without a GPU, one layout a row: memory a device, the planner's ratio to it, overlap of the
collectives, conditionals in loops and the static cost report's MFU ceiling.

    python -m bench.h100_compile [--out FILE.json] [--only NAME ...] [--schedules]

Each row is `python -m jaxptd.plan --config configs/gpu/gpt_1.3b.yaml --verify --target
h100 --json KEY=VALUE ...` in its own process (XLA dumps each step's memory report at
start-up), microbatches of 4 sequences (the 32-layer rows: 2). Needs the CUDA compile
extra (`pip install -e '.[h100]'`); no GPU. The figures are static (nothing autotuned,
nothing run): structure and memory, and a roofline ceiling, not speed.

Each row with a one-device row of its model and microbatch size (data, pipe, tensor and
microbatches 1, no recomputation whatever the row's model.remat; "1 device L32 b2" for
the 32-layer rows: a matching one-device program compiled, not one scaled per layer) gets
issue 48's ideal: the one-device program's time for the row's tokens / (data x pipe x
tensor) x (1 + the schedule's paper bubble, `simulate.paper_bubble` at uniform costs),
and its efficiency, ideal / static time. That time is the reference's forward and
backward phases times the row's global batch over its own, plus its update phase once
(the optimizer runs once a step at any batch). Issue 48's reference for the 32-layer rows
ran the 32 microbatches of 2 on one device with gradient accumulation, whose float32 adds
outside the GEMMs made its ideal larger. `--only` adds the one-device rows the named rows
need. rounds: the cost report's rounds phase and its share of the step.

`--schedules`: every schedule, with and without minimal recomputation, at issue 48's three
layouts (SCHEDULES), written to bench/results/h100_schedules.json unless --out: the
compiled order the planner's time model is held to (tests/test_plan_kernels.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from bench.report import write_rows
from jaxptd.config import load_config
from jaxptd.pipeline.schedules import Costs
from jaxptd.pipeline.simulate import paper_bubble
from jaxptd.units import GiB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gpu", "gpt_1.3b.yaml")
B = 4  # sequences a microbatch
# name -> overrides of configs/gpu/gpt_1.3b.yaml (data x pipe x tensor, microbatches m)


def layout(d: int, p: int, t: int, m: int, *more: str) -> list:
    return [f"parallel.data={d}", f"parallel.pipe={p}", f"parallel.tensor={t}",
            f"parallel.microbatches={m}", f"train.global_batch={d * m * B}", *more]


# the papers' depth (issue 48): 32 layers over 8 stages, 32 microbatches of 2 sequences
DEEP = ["parallel.data=1", "parallel.pipe=8", "parallel.tensor=1", "parallel.microbatches=32",
        "train.global_batch=64", "model.num_layers=32"]
LLAMA = ["model.arch=llama", "model.num_kv_heads=4", "model.ffn_size=5632"]
BERT = ["model.arch=bert", "model.vocab_size=30528"]
ROWS = {
    "1 device": layout(1, 1, 1, 1),
    # the DEEP rows' reference: their layers and microbatch
    "1 device L32 b2": [*layout(1, 1, 1, 1)[:4], "train.global_batch=2", "model.num_layers=32"],
    "(2,1,4) SP": layout(2, 1, 4, 1, "parallel.sequence_parallel=true"),
    "FSDP 8": layout(8, 1, 1, 1, "parallel.fsdp=true"),
    "(2,2,2) 1f1b cudnn act": layout(2, 2, 2, 4),
    "(2,2,2) 1f1b cudnn inputs": layout(2, 2, 2, 4, "parallel.stash=inputs"),
    "(2,2,2) 1f1b xla act": layout(2, 2, 2, 4, "model.attention=xla"),
    "(2,2,2) 1f1b xla inputs": layout(2, 2, 2, 4, "model.attention=xla",
                                      "parallel.stash=inputs"),
    "(2,2,2) 1f1b m8": layout(2, 2, 2, 8),
    "(2,2,2) 1f1b m8 SP": layout(2, 2, 2, 8, "parallel.sequence_parallel=true"),
    "(2,2,2) 1f1b m8 SP min zero1": layout(2, 2, 2, 8, "parallel.sequence_parallel=true",
                                           "model.remat=minimal", "optimizer.zero1=true"),
    "(2,2,2) 1f1b m8 SP min-mlp zero1": layout(
        2, 2, 2, 8, "parallel.sequence_parallel=true", "model.remat=minimal_mlp",
        "optimizer.zero1=true"),
    "(2,2,2) 1f1b m8 SP full zero1": layout(2, 2, 2, 8, "parallel.sequence_parallel=true",
                                            "model.remat=full", "optimizer.zero1=true"),
    "(1,4,2) 1f1b m16": layout(1, 4, 2, 16),
    # issue 48's 1F1B rows with model.remat=minimal (the ideal: the one-device program
    # without recomputation)
    "(2,2,2) 1f1b m8 min": layout(2, 2, 2, 8, "model.remat=minimal"),
    "(1,4,2) 1f1b m16 min": layout(1, 4, 2, 16, "model.remat=minimal"),
    # and with sequence parallelism, the config issue 48 recommends where tensor > 1
    "(1,4,2) 1f1b m16 SP min": layout(1, 4, 2, 16, "parallel.sequence_parallel=true",
                                      "model.remat=minimal"),
    "(1,4,2) interleaved": layout(1, 4, 2, 8, "parallel.schedule=interleaved",
                                  "parallel.chunks=2"),
    # every kind at issue 48's other two layouts (the planner's ranking against the compile)
    "(2,2,2) interleaved m8": layout(2, 2, 2, 8, "parallel.schedule=interleaved",
                                     "parallel.chunks=2"),
    "(2,2,2) zb-v m8": layout(2, 2, 2, 8, "parallel.schedule=zb-v", "parallel.chunks=2"),
    "(1,4,2) zb-h1 m16": layout(1, 4, 2, 16, "parallel.schedule=zb-h1"),
    "(1,4,2) interleaved m16": layout(1, 4, 2, 16, "parallel.schedule=interleaved",
                                      "parallel.chunks=2"),
    "(1,4,2) zb-v m16": layout(1, 4, 2, 16, "parallel.schedule=zb-v", "parallel.chunks=2"),
    "(2,2,2) zb-h1": layout(2, 2, 2, 4, "parallel.schedule=zb-h1"),
    "(2,2,2) zb-h1 m8": layout(2, 2, 2, 8, "parallel.schedule=zb-h1"),
    "(2,2,2) zb-interleaved": layout(2, 2, 2, 4, "parallel.schedule=zb-interleaved",
                                     "parallel.chunks=2"),
    "offload (8,1,1)": layout(8, 1, 1, 1, "offload.optimizer=true",
                              "offload.activations=true"),
    "llama (2,1,4)": layout(2, 1, 4, 1, *LLAMA),
    "bert (2,1,4)": layout(2, 1, 4, 1, *BERT),
    "(1,8,1) 1f1b m32 b2 L32": DEEP,
    "(1,8,1) 1f1b m32 b2 L32 min": [*DEEP, "model.remat=minimal"],
    "(1,8,1) zb-h1 m32 b2 L32": [*DEEP, "parallel.schedule=zb-h1"],
    "(1,8,1) zb-v m32 b2 L32": [*DEEP, "parallel.schedule=zb-v", "parallel.chunks=2"],
    "(1,8,1) interleaved m32 b2 L32": [*DEEP, "parallel.schedule=interleaved",
                                       "parallel.chunks=2"],
    "(1,8,1) zb-interleaved m32 b2 L32": [*DEEP, "parallel.schedule=zb-interleaved",
                                          "parallel.chunks=2"],
    # the other kinds with model.remat=minimal (the 1F1B row's "min" above)
    "(1,8,1) zb-h1 m32 b2 L32 min": [*DEEP, "parallel.schedule=zb-h1", "model.remat=minimal"],
    "(1,8,1) interleaved m32 b2 L32 min": [*DEEP, "parallel.schedule=interleaved",
                                           "parallel.chunks=2", "model.remat=minimal"],
    "(1,8,1) zb-v m32 b2 L32 min": [*DEEP, "parallel.schedule=zb-v", "parallel.chunks=2",
                                    "model.remat=minimal"],
    # model.fp8 (issue 49): beside their bf16 rows above
    "1 device fp8": layout(1, 1, 1, 1, "model.fp8=tensorwise"),
    "(2,1,4) SP fp8": layout(2, 1, 4, 1, "parallel.sequence_parallel=true",
                             "model.fp8=tensorwise"),
    "(2,2,2) 1f1b m8 fp8": layout(2, 2, 2, 8, "model.fp8=tensorwise"),
    "llama (2,1,4) fp8": layout(2, 1, 4, 1, *LLAMA, "model.fp8=tensorwise"),
    # delayed scaling: each operand's cast and amax in one pass
    "1 device fp8 delayed": layout(1, 1, 1, 1, "model.fp8=delayed"),
    "(2,1,4) SP fp8 delayed": layout(2, 1, 4, 1, "parallel.sequence_parallel=true",
                                     "model.fp8=delayed"),
    "(2,2,2) 1f1b m8 fp8 delayed": layout(2, 2, 2, 8, "model.fp8=delayed"),
    "llama (2,1,4) fp8 delayed": layout(2, 1, 4, 1, *LLAMA, "model.fp8=delayed"),
    # FSDP a matmul at a time: delayed scaling gathers the shards in FP8
    "FSDP 8 matmul": layout(8, 1, 1, 1, "parallel.fsdp=true", "parallel.fsdp_unit=matmul"),
    "FSDP 8 matmul fp8": layout(8, 1, 1, 1, "parallel.fsdp=true", "parallel.fsdp_unit=matmul",
                                "model.fp8=tensorwise"),
    "FSDP 8 matmul fp8 delayed": layout(8, 1, 1, 1, "parallel.fsdp=true",
                                        "parallel.fsdp_unit=matmul", "model.fp8=delayed"),
}


# issue 48's layouts, every kind: the planner's ranking is tested against these compiles
SCHEDULES = [
    *(f"(1,8,1) {k} m32 b2 L32{r}" for k in ("1f1b", "zb-h1", "interleaved", "zb-v")
      for r in ("", " min")), "(1,8,1) zb-interleaved m32 b2 L32",
    *(f"{layout_} {k} {m}{r}" for layout_, m in (("(2,2,2)", "m8"), ("(1,4,2)", "m16"))
      for k, r in (("1f1b", ""), ("1f1b", " min"), ("zb-h1", ""), ("interleaved", ""),
                   ("zb-v", "")))]
SCHEDULES_OUT = os.path.join(ROOT, "bench", "results", "h100_schedules.json")


def run(name: str) -> dict:
    cmd = [sys.executable, "-m", "jaxptd.plan", "--config", CONFIG, "--verify", "--target",
           "h100", "--json", *ROWS[name]]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        error = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
        return {"name": name, "error": (error or done.stderr.splitlines()[-1:] or ["?"])[0]}
    report = json.loads(lines[-1])
    report.pop("plan", None)
    return {"name": name, "overrides": ROWS[name], **report}


def config_of(name: str):
    return load_config(CONFIG, ROWS[name])


def one_device(name: str) -> bool:
    """Whether row `name` is a one-device row: data, pipe, tensor and microbatches 1, and
    otherwise model overrides and a batch of its own."""
    return all(o in layout(1, 1, 1, 1)[:4] or o.startswith(("model.", "train.global_batch="))
               for o in ROWS[name])


def reference_of(name: str) -> str | None:
    """The one-device row with row `name`'s model config but no recomputation (model.remat
    none) and its microbatch size (None: no such row)."""
    config = config_of(name)
    model = dataclasses.replace(config.model, remat="none")
    return next((n for n in ROWS if n != name and one_device(n)
                 and config_of(n).model == model
                 and config_of(n).microbatch_size == config.microbatch_size), None)


def ideal(name: str, one_device: dict) -> dict:
    """Issue 48's ideal for row `name` from its one-device row's report (module docstring):
    ms, and the one-device program's ms for the row's tokens."""
    config, ref = config_of(name), config_of(reference_of(name))
    par, cost = config.parallel, one_device["cost"]
    update = cost["phase"].get("update", {}).get("seconds", 0.0)
    tokens = config.train.global_batch / ref.train.global_batch
    whole = (cost["seconds"] - update) * tokens + update
    bubble = paper_bubble(par.schedule, par.pipe, par.microbatches, par.chunks, Costs()) \
        if par.pipe > 1 else 0.0
    return {"one_device_s": whole,
            "ideal_s": whole / (par.data * par.pipe * par.tensor) * (1 + bubble)}


def row_text(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<28} {r['error'][:100]}"
    cost = r["cost"]
    kinds = r["collectives"]["by_kind"]
    overlap = sum(k.get("overlapped", 0) for k in kinds.values())
    launches = sum(k.get("launches", 0) for k in kinds.values())
    conds = max((lp["conditionals"] for lp in r["loops"]), default=0)
    gemms = cost.get("layer_gemms", {})
    rounds = cost["phase"].get("rounds", {}).get("seconds", 0.0)
    ideal_ms = f"{r['ideal_s'] * 1e3:7.1f} {r['ideal_s'] / cost['seconds']:5.2f}" \
        if "ideal_s" in r else f"{'':7} {'':5}"
    return (f"{r['name']:<28} {r['memory']['total'] / GiB:7.1f} "
            f"{'yes' if r['fits'] else 'NO':>4} {r['planned_ratio'] or 0:6.2f} "
            f"{overlap:5.0f}/{launches:<5.0f} {conds:5d} {cost['seconds'] * 1e3:8.1f} "
            f"{cost['mfu_ceiling']:6.3f} {gemms.get('fp8', 0):3.0f}/{gemms.get('other', 0):<3.0f}"
            f" {ideal_ms} {rounds * 1e3:6.1f} {rounds / cost['seconds']:4.0%}"
            f" {r['compile_s']:6.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write every row's full report as JSON")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="these rows only")
    parser.add_argument("--schedules", action="store_true",
                        help=f"the SCHEDULES rows, written to {SCHEDULES_OUT} unless --out")
    args = parser.parse_args()
    if args.schedules:
        args.only, args.out = SCHEDULES, args.out or SCHEDULES_OUT
    names = list(args.only or ROWS)
    needed = [reference_of(n) for n in names]
    names = [n for n in ROWS if n in needed and n not in names] + names
    print(f"{'layout':<28} {'GiB':>7} {'fits':>4} {'plan/x':>6} {'overlap':>11} "
          f"{'conds':>5} {'ms':>8} {'MFU<=':>6} {'fp8/16':>7} {'ideal':>7} {'eff':>5} "
          f"{'rounds':>11} {'comp s':>6}")
    rows, done = [], {}
    for name in names:
        rows.append(run(name))
        done[name] = rows[-1]
        reference = done.get(reference_of(name), {})
        if "cost" in rows[-1] and "cost" in reference:
            rows[-1].update(ideal(name, reference))
        print(row_text(rows[-1]), flush=True)
    print("\nGiB: compiled memory a device; plan/x: the planner's bytes over it; overlap: "
          "collective launches a step with a GEMM, attention or loop in flight / all; conds: "
          "most conditionals in one loop body; ms and MFU<=: the static cost report "
          "(jaxptd/hlo/; FP8 GEMMs at the FP8 peak, MFU against bf16's); fp8/16: a layer's "
          "GEMMs a pass with 8-bit operands / with 16-bit ones; ideal and eff: issue 48's "
          "ideal ms and ideal / ms (module docstring); rounds: the rounds phase's ms and "
          "share of the step.")
    print("reproduce: python -m bench.h100_compile" + (" --schedules" if args.schedules else (
        " --only " + " ".join(repr(n) for n in args.only) if args.only else "")))
    if args.out:
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
