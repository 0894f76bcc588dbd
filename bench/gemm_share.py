"""GEMM FLOPs a device of the compiled step against the model's own count (issue #50): the
PTD-P Table 1 row of 18.4B parameters (configs/megatron/gpt_18.4b.yaml: h 6144, 48 heads,
tensor 8, microbatches of 2, sequence parallelism, full recomputation) narrowed to 4
layers, data 1 and 2 microbatches, compiled for 8 A100s without a GPU, one variant a row.

    python -m bench.gemm_share [--target a100] [--only NAME ...] [--option NAME=VALUE ...]
        [--out FILE.json] [KEY=VALUE ...]

For each row: GEMM FLOPs a device (the static cost report of jaxptd/hlo/: every dot of
the compiled program, loop bodies times their trip count), over 6NT of the device's share
(N: the 12 h^2 of each layer and the h V of the logits, over tensor; T: the device's
tokens), and over PTD-P eq. (3) with the row's recomputation (jaxptd.train.metrics);
the static time of the step. --option NAME=VALUE sets one XLA option over the run's own
(jaxptd/runtime/target.py), e.g. `--option xla_gpu_enable_pipelined_all_gather=true` to
compile as the step did before issue #50's fix; KEY=VALUE overrides every row's config.
Needs the CUDA compile extra (`pip install -e '.[h100]'`); no GPU. Static figures:
nothing is autotuned or run.
"""
from __future__ import annotations

import argparse
import os
import sys

from bench.report import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "megatron", "gpt_18.4b.yaml")
NARROW = ["model.num_layers=4", "parallel.data=1", "parallel.microbatches=2",
          "train.global_batch=4"]
ROWS = {
    "SP, full recomputation": [],
    "SP, full, cuDNN attention": ["model.attention=cudnn"],
    "SP, no recomputation": ["model.remat=none"],
    "no SP, full recomputation": ["parallel.sequence_parallel=false"],
}


def option(text: str) -> tuple:
    name, value = text.split("=", 1)
    return name.removeprefix("--"), {"true": True, "false": False}.get(
        value, int(value) if value.isdigit() else value)


def compile_row(overrides: list, target_name: str, options: dict):
    """(config, compiled step, seconds): the layout on one host of the target's devices,
    with the run's XLA options and `options` over them."""
    import time

    import jax
    import jax.numpy as jnp

    from jaxptd.config import load_config
    from jaxptd.model import batch_width
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.runtime.target import TARGETS, compile_lowered, topology_devices
    from jaxptd.train.step import Setup, build_train_step

    config = load_config(CONFIG, [f"runtime.target={target_name}", *overrides])
    devices = topology_devices(TARGETS[target_name], 1, config.num_devices)
    setup = Setup(config, make_mesh(config.parallel, devices))
    batch = jax.ShapeDtypeStruct((config.train.global_batch, batch_width(config.model)),
                                 jnp.int32, sharding=setup.batch_sharding)
    began = time.perf_counter()
    lowered = build_train_step(setup).lower(setup.state_layout.abstract_state(), batch)
    compiled = compile_lowered(lowered, {**(setup.compiler_options() or {}), **options})
    return config, compiled, time.perf_counter() - began


def measure(config, compiled, target_name: str) -> dict:
    """GEMM FLOPs a device, their ratios to 6NT and eq. (3), and the static time."""
    from jaxptd import hlo
    from jaxptd.runtime.target import TARGETS
    from jaxptd.train.metrics import flops_per_iteration

    target, model, par = TARGETS[target_name], config.model, config.parallel
    kernels = hlo.cost(hlo.parse(compiled.as_text()), target.peak_bf16, target.hbm)
    gemm = sum(k.flops * k.count for k in kernels if k.category == "gemm")
    h, vocab = model.hidden_size, model.padded_vocab(par.tensor)
    params = (12 * h * h * model.num_layers + vocab * h) / par.tensor
    tokens = config.train.global_batch * model.seq_len / (config.num_devices / par.tensor)
    eq3 = flops_per_iteration(model, config.train.global_batch, vocab, model.remat)
    return {"gemm_flops": gemm, "per_6nt": gemm / (6 * params * tokens),
            "per_eq3": gemm / (eq3 / config.num_devices),
            "static_s": sum(k.seconds(target.peak_bf16, target.hbm) * k.count
                            for k in kernels)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="section.key=value, every row")
    parser.add_argument("--target", default="a100", help="a GPU record of runtime/target.py")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="these rows only")
    parser.add_argument("--option", action="append", default=[], type=option,
                        help="NAME=VALUE: an XLA option over the run's (repeatable)")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    options = dict(args.option)
    print(f"{'variant':<28} {'GEMM TFLOP':>10} {'/6NT':>6} {'/eq3':>6} {'ms':>8} "
          f"{'comp s':>7}")
    rows = []
    for name in args.only or list(ROWS):
        config, compiled, seconds = compile_row([*NARROW, *ROWS[name], *args.overrides],
                                                args.target, options)
        row = {"name": name, **measure(config, compiled, args.target), "compile_s": seconds}
        rows.append(row)
        print(f"{name:<28} {row['gemm_flops'] / 1e12:10.2f} {row['per_6nt']:6.2f} "
              f"{row['per_eq3']:6.2f} {row['static_s'] * 1e3:8.1f} {seconds:7.1f}",
              flush=True)
    print(f"\n{config.num_devices} x {args.target}, {CONFIG} with {' '.join(NARROW)}; "
          f"/6NT: over 6 N T of the device's share; /eq3: over PTD-P eq. (3) with the "
          f"row's recomputation; ms: the static cost report's step (jaxptd/hlo/).")
    print("reproduce: python -m bench.gemm_share " + " ".join(sys.argv[1:]))
    if args.out:
        write_rows(args.out, rows, target=args.target, options=options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
