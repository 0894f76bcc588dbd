"""Where a phase of the compiled step goes: the static cost report's kernels of one phase
(jaxptd/hlo/: forward, backward, rounds or update, from each op's jax name) grouped by
category, the jax op that made them and their output type, costliest first. What issue
48's readings of the rounds phase were made with (a dynamic-update-slice of a stash slot,
a select between two chunks' weights, an add to the gradient sums at a run-time chunk).

    python -m bench.phase_kernels [--config FILE] [--target h100] [--phase rounds]
        [--top N] [KEY=VALUE ...]

The config (default configs/gpu/gpt_1.3b.yaml) with the overrides is compiled for its
devices of the target on one host, without a GPU, as `python -m jaxptd.plan --verify`
does. Needs the CUDA compile extra (`pip install -e '.[h100]'`). Static figures: nothing
is autotuned or run.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gpu", "gpt_1.3b.yaml")
PHASES = ("forward", "backward", "rounds", "update", "all")


def grouped(module, kernels, target, phase: str) -> list:
    """[(ms a step, launches a step, category, op, output type)] of the phase's kernels
    (every phase: 'all'), costliest first. op: the last two parts of the jax op's name;
    output type without layouts."""
    types = {(comp, i.name): re.sub(r"\{[^}]*\}", "", i.type)
             for comp in module.computations for i in module[comp].instrs}
    ms, launches = collections.Counter(), collections.Counter()
    for k in kernels:
        if phase in ("all", k.phase):
            key = (k.category, "/".join(k.op_name.split("/")[-2:]),
                   types.get((k.computation, k.name), "?"))
            ms[key] += k.seconds(target.peak_bf16, target.hbm) * k.count * 1e3
            launches[key] += k.count
    return [(t, launches[key], *key) for key, t in ms.most_common()]


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = _fail
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--target", default="h100", help="a GPU record of runtime/target.py")
    parser.add_argument("--phase", default="rounds", choices=PHASES)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxptd import hlo
    from jaxptd.config import ConfigError, load_config
    from jaxptd.plan import compile_check
    from jaxptd.runtime.target import TARGETS

    if args.target not in TARGETS:
        _fail(f"--target {args.target}: unknown (known: {', '.join(TARGETS)})")
    if args.top <= 0:
        _fail(f"--top {args.top}: must be positive")
    target = TARGETS[args.target]
    try:
        config = load_config(args.config, [*args.overrides, f"runtime.target={args.target}"])
    except (ConfigError, OSError) as e:
        _fail(str(e))
    step, _ = compile_check.compile_step(config, target, config.num_devices)
    module = hlo.parse(step.as_text())
    kernels = hlo.cost(module, target.peak_bf16, target.hbm)
    phases = collections.Counter()
    for k in kernels:
        phases[k.phase] += k.seconds(target.peak_bf16, target.hbm) * k.count * 1e3
    print(f"step {sum(phases.values()):.2f} ms static: " +
          ", ".join(f"{p} {t:.2f}" for p, t in phases.most_common()))
    print(f"{'ms':>8} {'launches':>8}  {'category':<12} {'op':<48} output")
    for ms, launches, category, op, out in grouped(module, kernels, target,
                                                   args.phase)[:args.top]:
        print(f"{ms:8.3f} {launches:8.0f}  {category:<12} {op[:48]:<48} {out[:70]}")
    print("reproduce: python -m bench.phase_kernels " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
