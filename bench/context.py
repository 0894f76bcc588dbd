"""Context parallelism on simulated CPU devices: the work and the memory of one training step
against the number of context ranks, by ring and all-gather.

One Llama-style model (grouped-query attention) and one global batch, split over
c = 1, 2, 4 context ranks (c devices, nothing else parallel). For each: the compiled step's
temporary memory per device (XLA's memory analysis: activations and attention's
transients) and the wall time of a step. The simulated devices share this machine's cores,
so the wall time is the total work of all ranks: a ratio near 1 means splitting the
sequence adds no work; the memory ratio is what one device saves. Ratios only (quote
absolute times from a GPU).

    python -m bench.context [--json OUT.json] [--seq 2048] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench.report import time_steps

MODEL = ["model.arch=llama", "model.num_layers=2", "model.hidden_size=128",
         "model.num_heads=8", "model.num_kv_heads=2", "model.vocab_size=512",
         "train.global_batch=2", "optimizer.warmup_steps=1"]
CASES = [(1, "ring"), (2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather")]


def measure(c: int, method: str, seq: int, reps: int) -> dict:
    import jax
    import numpy as np

    from jaxptd.config import load_config
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup, build_train_step

    config = load_config(None, [*MODEL, f"model.seq_len={seq}", f"parallel.context={c}",
                                f"parallel.context_attention={method}"])
    setup = Setup(config, make_mesh(config.parallel, jax.devices()[:c]))
    state = setup.state_layout.init_state(0)
    rows = np.random.default_rng(0).integers(0, 500, (2, seq + 1)).astype(np.int32)
    batch = jax.device_put(rows, setup.batch_sharding)
    compiled = build_train_step(setup).lower(state, batch).compile()  # (run: no recompile)
    _, seconds, metrics = time_steps(compiled, state, batch, warmup=1, reps=reps)
    return {"context": c, "method": method,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "step_s": seconds, "loss": float(metrics["loss"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    rows = [measure(c, method, args.seq, args.reps) for c, method in CASES]
    base = rows[0]
    print(f"context parallelism, Llama-style 2 layers h=128, seq {args.seq}, batch 2, "
          f"jax {jax.__version__}, {os.cpu_count()} CPU cores")
    print(f"{'c':>2} {'method':>10} {'temp MB/dev':>12} {'memory ratio':>13} "
          f"{'work ratio':>11} {'loss':>9}")
    for r in rows:
        r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
        r["work_ratio"] = r["step_s"] / base["step_s"]
        print(f"{r['context']:>2} {r['method'] if r['context'] > 1 else '-':>10} {r['temp_bytes'] / 2**20:>12.1f} "
              f"{r['memory_ratio']:>13.2f} {r['work_ratio']:>11.2f} {r['loss']:>9.5f}")
    print("reproduce: python -m bench.context " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "seq": args.seq, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
