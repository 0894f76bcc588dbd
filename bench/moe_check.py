"""Expert parallelism's exchange on the devices at hand: a small float32 mixture of experts'
loss and gradients at expert 2 (and 4 with 4+ devices) against the same program on one
device. On GPUs this is the first run of the ragged all-to-all path (`lax.ragged_all_to_all`,
model/moe.py), which XLA's CPU cannot run and the test suite therefore never executes; on
CPU devices it checks the padded path the suite checks too. Prints a table (max relative
difference of the loss and of every gradient) and the command; exit status 1 if any is over
the tolerance.

    python -m bench.moe_check [--json OUT.json] [--rtol 1e-4]
"""
from __future__ import annotations

import argparse
import json
import sys

MODEL = ["model.arch=llama", "model.num_layers=2", "model.hidden_size=64",
         "model.num_heads=4", "model.num_kv_heads=2", "model.seq_len=128",
         "model.vocab_size=512", "model.moe_experts=8", "model.moe_top_k=2",
         "model.moe_ffn=64", "model.moe_shared_ffn=64", "model.moe_z_loss=0.001",
         "model.dtype=float32", "train.global_batch=8"]


def grads_at(expert: int, devices, batch):
    """(loss + balance terms, logical gradients) of one step's program at (data = expert)."""
    import jax
    import jax.numpy as jnp

    from jaxptd.config import load_config
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.model import moe
    from jaxptd.train.step import Setup, build_grads

    config = load_config(None, [*MODEL, f"parallel.data={expert}", f"parallel.expert={expert}"])
    setup = Setup(config, make_mesh(config.parallel, devices[:expert]))
    state = setup.state_layout.init_state(0)
    grads, loss, stats = jax.jit(build_grads(setup, True))(
        state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    objective = loss + moe.objective(stats, config.model) * setup.policy.token_norm
    return float(objective), jax.device_get(setup.state_layout.to_logical(grads))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    import jax
    import numpy as np

    devices = jax.devices()
    if len(devices) < 2:
        print(f"one {devices[0].platform} device: no expert-parallel check")
        return 0
    batch = np.random.default_rng(0).integers(0, 500, (8, 129)).astype(np.int32)
    loss1, grads1 = grads_at(1, devices, batch)
    rows = []
    for e in (2, 4):
        if e > len(devices):
            continue
        loss, grads = grads_at(e, devices, batch)
        worst = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
                    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)))
        rows.append({"expert": e, "loss_rel": abs(loss - loss1) / abs(loss1),
                     "grads_rel": worst, "platform": devices[0].platform})
    print(f"expert parallelism vs one device, float32, {devices[0].device_kind} x "
          f"{len(devices)}, jax {jax.__version__}")
    print(f"{'expert':>6} {'loss rel diff':>14} {'worst gradient rel diff':>24}")
    for r in rows:
        print(f"{r['expert']:>6} {r['loss_rel']:>14.2e} {r['grads_rel']:>24.2e}")
    print("reproduce: python -m bench.moe_check " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    bad = [r for r in rows if max(r["loss_rel"], r["grads_rel"]) > args.rtol]
    if bad:
        print(f"error: expert parallelism differs from one device beyond rtol {args.rtol}: "
              f"{bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
