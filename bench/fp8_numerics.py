"""FP8 against bf16 on the default config: a tiny GPT and a tiny Llama trained the same
steps in bf16 and with model.fp8=tensorwise and delayed (the layers' linears in FP8), on
the default corpus and layout (data 2, tensor 4: the amax reductions across tensor ranks
run), and their last validation losses compared (issue 49: within 2%).

    python -m bench.fp8_numerics [--steps 300] [--fp8 tensorwise delayed] [--out FILE.json]

Each run is `python -m jaxptd.train --config configs/gpt_tiny.yaml model.dtype=bfloat16
[model.arch=llama] [model.fp8=KIND] train.steps=N` in its own process, its run directory
under a temporary directory; the table reads their metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.report import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = {"gpt": [], "llama": ["model.arch=llama"]}


def run(arch: str, fp8: str, steps: int, tmp: str) -> float:
    """The last validation loss of one run (NaN, and its last error line printed, for a
    run that failed)."""
    run_dir = os.path.join(tmp, f"{arch}-{fp8}")
    cmd = [sys.executable, "-m", "jaxptd.train", "--config", "configs/gpt_tiny.yaml",
           "model.dtype=bfloat16", f"model.fp8={fp8}", f"train.steps={steps}",
           f"train.eval_every={steps}", "checkpoint.every=0", f"train.run_dir={run_dir}",
           *ARCHS[arch]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        print(f"{arch} model.fp8={fp8}: exit {done.returncode}: "
              f"{(done.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
        return float("nan")
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fp8", nargs="+", default=["tensorwise", "delayed"],
                        choices=["tensorwise", "delayed"], help="the FP8 scalings to run")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    print(f"{'arch':<6} {'fp8':<10} {'bf16 val':>9} {'fp8 val':>9} {'fp8/bf16':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            bf16 = run(arch, "none", args.steps, tmp)
            for kind in args.fp8:
                fp8 = run(arch, kind, args.steps, tmp)
                rows.append({"arch": arch, "fp8_kind": kind, "steps": args.steps,
                             "bf16": bf16, "fp8": fp8})
                print(f"{arch:<6} {kind:<10} {bf16:9.4f} {fp8:9.4f} {fp8 / bf16:9.4f}",
                      flush=True)
    print(f"reproduce: python -m bench.fp8_numerics --steps {args.steps} --fp8 "
          f"{' '.join(args.fp8)}")
    if args.out:
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
