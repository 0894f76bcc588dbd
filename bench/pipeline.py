"""Benchmark the pipeline executor against the unpipelined step on the same devices.

For each schedule at a few (p, v, m), on 8 simulated CPU devices and the same model and
global batch: step time as a ratio to the unpipelined step (data parallel over all 8
devices), the schedule's modelled bubble (uniform t_f = t_b = t_w), XLA's compiled
temporary memory per device, and the bytes the collective-permutes send per device per
step: in every round of a scan that has an F (B) slot, each link of the chain (the ring
when interleaved) carries one [b, s, h/t] message forwards (backwards), whether or not it
carries work; averaged over the p ranks, since the chain's end ranks send one way only.

Simulated devices share the machine's cores, so wall time tracks the total work of all
devices: the ratio shows that idle slots do no work (masked compute would multiply it),
not the bubble. Quote only ratios from one run on a shared CPU.

    python -m bench.pipeline [--steps 10] [--json bench/results/pipeline_cpu.json]
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxptd.config import load_config  # noqa: E402
from jaxptd.parallel.mesh import make_mesh  # noqa: E402
from jaxptd.pipeline.executor import rounds_for  # noqa: E402
from jaxptd.pipeline.scans import round_costs, round_form, segments  # noqa: E402
from jaxptd.pipeline.schedules import make_schedule  # noqa: E402
from jaxptd.pipeline.simulate import simulate  # noqa: E402
from jaxptd.train.step import Setup, build_train_step  # noqa: E402
from jaxptd.units import MB  # noqa: E402
from bench.report import time_steps  # noqa: E402

MODEL = ["model.num_layers=8", "model.hidden_size=256", "model.num_heads=8",
         "model.seq_len=128", "model.vocab_size=512", "train.global_batch=32"]
# (name, data, pipe, schedule, chunks, microbatches, stash, round form). Every pipelined
# case runs microbatches of b = 2 sequences; the baseline is data-parallel over the 8
# devices with the same b (m = 2), so the ratio isolates the pipeline from the microbatch
# size.
BASELINE = ("unpipelined", 8, 1, "1f1b", 1, 2, "activations", "auto")
CASES = [
    ("unpipelined b=4", 8, 1, "1f1b", 1, 1, "activations", "auto"),
    ("gpipe", 2, 4, "gpipe", 1, 8, "activations", "auto"),
    ("1f1b", 2, 4, "1f1b", 1, 8, "activations", "auto"),
    ("1f1b inputs", 2, 4, "1f1b", 1, 8, "inputs", "auto"),
    ("1f1b steady", 2, 4, "1f1b", 1, 8, "activations", "steady"),
    ("1f1b p2", 4, 2, "1f1b", 1, 4, "activations", "auto"),
    ("zb-h1", 2, 4, "zb-h1", 1, 8, "activations", "auto"),
    ("zb-h1 inputs", 2, 4, "zb-h1", 1, 8, "inputs", "auto"),
    ("zb-h1 steady", 2, 4, "zb-h1", 1, 8, "activations", "steady"),
    ("interleaved", 2, 4, "interleaved", 2, 8, "activations", "auto"),
    ("interleaved p2v4", 4, 2, "interleaved", 4, 4, "activations", "auto"),
    ("zb-interleaved", 2, 4, "zb-interleaved", 2, 8, "activations", "auto"),
]


def sent_messages(config) -> tuple:
    """(messages each device sends per step, those that carry a microbatch), averaged over
    the pipe ranks (see the module docstring)."""
    par = config.parallel
    p, v, m = par.pipe, par.chunks, par.microbatches
    form = round_form(config, jax.devices()[0].platform)
    rounds = rounds_for(par.schedule, p, m, v, form)
    links = p if v > 1 else p - 1  # per direction
    sent = sum((seg.stop - seg.start) * sum(mode != "off" for mode in seg.modes[:2])
               for seg in segments(rounds, form))
    return sent * links / p, 2 * m * (p * v - 1) / p


def measure(data, pipe, schedule, chunks, micro, stash, form, steps):
    config = load_config(None, MODEL + [
        f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.schedule={schedule}",
        f"parallel.chunks={chunks}", f"parallel.microbatches={micro}",
        f"parallel.stash={stash}", f"parallel.round_form={form}"])
    setup = Setup(config, make_mesh(config.parallel))
    state = setup.state_layout.init_state(0)
    rng = np.random.default_rng(0)
    batch = jax.device_put(rng.integers(0, 512, (32, 129)).astype(np.int32),
                           setup.batch_sharding)
    compiled = build_train_step(setup).lower(state, batch).compile()
    state, seconds, _ = time_steps(compiled, state, batch, warmup=2, reps=steps)
    row = {"step_s": seconds,
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
           "bubble": 0.0, "sent_bytes": 0}
    if pipe > 1:
        b = 32 // (data * micro)
        message = b * config.model.seq_len * config.model.hidden_size * 4  # f32, t = 1
        sent, useful = sent_messages(config)
        row["sent_bytes"], row["useful_bytes"] = sent * message, useful * message
        costs = round_costs(round_form(config, jax.devices()[0].platform))
        row["bubble"] = simulate(make_schedule(schedule, pipe, micro, chunks, costs),
                                 costs).bubble_fraction
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="bench/results/pipeline_cpu.json")
    args = parser.parse_args(argv)
    baseline_before = measure(*BASELINE[1:], args.steps)["step_s"]
    rows = []
    for name, data, pipe, schedule, chunks, micro, stash, form in CASES:
        row = measure(data, pipe, schedule, chunks, micro, stash, form, args.steps)
        row.update(name=name, pipe=pipe, chunks=chunks, microbatches=micro, stash=stash,
                   form=form)
        rows.append(row)
    # The baseline again at the end: the spread of the two is this machine's noise.
    baseline_after = measure(*BASELINE[1:], args.steps)["step_s"]
    baseline = (baseline_before + baseline_after) / 2
    print(f"{'case':17s} {'p':>2s} {'v':>2s} {'m':>3s} {'ratio':>6s} {'bubble':>7s} "
          f"{'temp MB':>8s} {'sent MB':>8s} {'useful MB':>9s}")
    for row in rows:
        row["ratio"] = row["step_s"] / baseline
        print(f"{row['name']:17s} {row['pipe']:2d} {row['chunks']:2d} {row['microbatches']:3d} "
              f"{row['ratio']:6.2f} {row['bubble']:7.3f} {row['temp_bytes'] / MB:8.2f} "
              f"{row['sent_bytes'] / MB:8.2f} {row.get('useful_bytes', 0) / MB:9.2f}")
    print(f"\nratio: median step time / the unpipelined step (data 8, m = 2, the same b = 2),"
          f" measured before and after the cases: {baseline_before:.3f} s and "
          f"{baseline_after:.3f} s.\nreproduce: python -m bench.pipeline --steps {args.steps}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "date": time.strftime("%Y-%m-%d"), "command": "python -m bench.pipeline " + " ".join(sys.argv[1:]),
                   "model": MODEL, "baseline_step_s": [baseline_before, baseline_after],
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
