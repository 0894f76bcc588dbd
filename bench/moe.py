"""A mixture of experts against the dense model of the same active FLOPs, on simulated CPU
devices: the work and the memory of one training step, and what expert parallelism and a
capacity change.

One Llama-style model and one global batch on 8 devices (data 8). Dense: a SwiGLU MLP of
width F. MoE: E = 8 experts of width F / 2, top 2, so a token's MLP FLOPs are the dense
model's (plus the router's 2 h E) while the MLP holds 4 x its parameters; dropless or with
a capacity, the experts on every rank (e = 1) or split over e = 8 (all-to-all). For each:
parameters, a token's forward FLOPs (the model's forward_flops), the compiled step's
temporary memory per device and the wall time of a step as a ratio to the dense model's.
The simulated devices share this machine's cores, so the wall time is the total work; ratios
only (quote absolute times from a GPU). On CPU, XLA computes `lax.ragged_dot` as a product
over every expert and the all-to-all of a dropless exchange moves blocks padded to the
worst routing (model/moe.py), so the MoE rows here cost more than a GPU's grouped GEMMs
would: the work ratio is an upper bound of the routing's overhead, not the GPU's.

    python -m bench.moe [--json OUT.json] [--seq 256] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench.report import time_steps

MODEL = ["model.arch=llama", "model.num_layers=2", "model.hidden_size=128",
         "model.num_heads=8", "model.num_kv_heads=2", "model.vocab_size=512",
         "model.ffn_size=512", "train.global_batch=16", "optimizer.warmup_steps=1",
         "parallel.data=8"]
MOE = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn=256"]
CASES = [("dense", []), ("moe dropless e=1", MOE),
         ("moe dropless e=8", [*MOE, "parallel.expert=8"]),
         ("moe capacity 1.25 e=1", [*MOE, "model.moe_capacity=1.25"]),
         ("moe capacity 1.25 e=8", [*MOE, "model.moe_capacity=1.25", "parallel.expert=8"])]


def measure(name: str, extra: list, seq: int, reps: int) -> dict:
    import jax
    import numpy as np

    from jaxptd import model as models
    from jaxptd.config import load_config
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup, build_train_step

    config = load_config(None, [*MODEL, *extra, f"model.seq_len={seq}"])
    setup = Setup(config, make_mesh(config.parallel, jax.devices()[:8]))
    state = setup.state_layout.init_state(0)
    rows = np.random.default_rng(0).integers(0, 500, (16, seq + 1)).astype(np.int32)
    batch = jax.device_put(rows, setup.batch_sharding)
    compiled = build_train_step(setup).lower(state, batch).compile()  # (run: no recompile)
    params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        lambda: models.get(config.model).init_params(config.model, setup.vocab,
                                                     jax.random.key(0)))))
    _, seconds, metrics = time_steps(compiled, state, batch, warmup=1, reps=reps)
    flops = models.get(config.model).forward_flops(config.model, setup.vocab)["layer"]
    return {"name": name, "params": params, "layer_flops_token": flops,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "step_s": seconds, "loss": float(metrics["loss"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    rows = [measure(name, extra, args.seq, args.reps) for name, extra in CASES]
    base = rows[0]
    print(f"mixture of experts vs dense at equal active FLOPs, Llama-style 2 layers h=128, "
          f"seq {args.seq}, batch 16 on 8 devices, jax {jax.__version__}, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'model':>22} {'params M':>9} {'layer FLOPs/tok':>16} {'temp MB/dev':>12} "
          f"{'memory ratio':>13} {'work ratio':>11} {'loss':>8}")
    for r in rows:
        r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
        r["work_ratio"] = r["step_s"] / base["step_s"]
        print(f"{r['name']:>22} {r['params'] / 1e6:>9.3f} {r['layer_flops_token']:>16,} "
              f"{r['temp_bytes'] / 2**20:>12.1f} {r['memory_ratio']:>13.2f} "
              f"{r['work_ratio']:>11.2f} {r['loss']:>8.4f}")
    print("reproduce: python -m bench.moe " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "seq": args.seq, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
