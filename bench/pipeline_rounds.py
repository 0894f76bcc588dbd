"""What a conditional per slot costs a pipeline round on one GPU (issue 13 §4).

On XLA:GPU a `lax.cond` copies its predicate to the host and waits for it, draining the
GPU's queue. The executor's round forms differ exactly there (jaxptd/pipeline/executor.py):
`cond` puts a conditional around every slot, `steady` runs full rounds without one, `masked`
computes idle slots and discards them. This times, on one device, a loop of rounds of one
pipeline rank at GPT-1.3B layer-chunk shapes (bf16; F = the chunk's forward keeping its vjp
residuals in a stash slot, B = the backward from them): every slot valid, each way; and
half the slots idle (a warm-up or cool-down), skipped by a conditional or computed masked.
The model's own layers run (jaxptd.model.apply_layers). A profile of one loop counts the
device-to-host copies (the conditionals' predicates). With --command-buffers the run is
repeated in a child process with XLA_FLAGS recording conditionals into CUDA-graph command
buffers (graph conditional nodes: no host copy). jax 0.10.2's XLA has CONDITIONAL among its
default command types, but records a conditional only where the driver takes graph
conditionals and the run of commands around it is at least the minimum graph size, which
these flags set to 1 (COMMAND_BUFFER_FLAGS).

    python -m bench.pipeline_rounds [--json OUT.json] [--toy] [--command-buffers]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# XLA puts a conditional into a CUDA graph only where the driver takes graph conditionals
# and where the run of commands around it is at least the minimum graph size: a slot's
# conditional in the cond round form sits alone between two collective-permutes, below the
# default size, so these flags set it to 1 (what the default size recorded: the git log)
COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                        "CUDNN,COLLECTIVES,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1")
SHAPES = {  # layers of one chunk (GPT-1.3B: 24 layers, p = 4, v = 2), microbatch, sequence
    "gpt-1.3B": dict(layers=3, hidden=2048, heads=16, seq=2048, batch=1, dtype="bfloat16"),
    "toy": dict(layers=2, hidden=32, heads=4, seq=16, batch=1, dtype="float32"),
}
VARIANTS = {  # name: (round form, fraction of slots valid)
    "cond, all valid": ("cond", 1.0), "steady, all valid": ("steady", 1.0),
    "cond, half idle": ("cond", 0.5), "masked, half idle": ("masked", 0.5),
}


def build(shape: dict, rounds: int, form: str, valid_fraction: float):
    """A jitted loop of `rounds` rounds (F slot, B slot) over one layer chunk -> (fn, args)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxptd import model as models
    from jaxptd.config import load_config
    from jaxptd.model.tensor import Layout

    cfg = load_config(None, [f"model.num_layers={shape['layers']}",
                             f"model.hidden_size={shape['hidden']}",
                             f"model.num_heads={shape['heads']}",
                             f"model.seq_len={shape['seq']}", f"model.dtype={shape['dtype']}"
                             ]).model
    layout = Layout(cfg.padded_vocab(1))
    layers = jax.jit(lambda: models.get(cfg).init_params(cfg, layout.vocab,
                                                         jax.random.key(0))["layers"])()
    x = jnp.ones((shape["batch"], shape["seq"], shape["hidden"]), jnp.dtype(cfg.dtype))
    valid = (jnp.arange(2 * rounds) % int(round(1 / valid_fraction)) == 0).reshape(rounds, 2)

    def loop(layers, x):
        def chunk(w, x):
            return models.apply_layers(w, x, None, jax.random.key(0), cfg, layout, True)

        def kept():  # what the chunk's backward closes over (its residuals and weights)
            return jax.closure_convert(jax.vjp(chunk, layers, x)[1], x)

        backward, template = kept()  # the probe; XLA drops its compute

        def slot(kind, ok, stash, grads):
            if kind == "F":  # forward, keep the backward's values in the stash
                new = kept()[1]
                return [jnp.where(ok, n, s) for n, s in zip(new, stash)] \
                    if form == "masked" else new, grads
            g_w, _ = backward(x, *stash)  # backward from the stash
            if form == "masked":
                g_w = jax.tree.map(lambda g: jnp.where(ok, g, 0), g_w)
            return stash, jax.tree.map(jnp.add, grads, g_w)

        def run(kind, ok, stash, grads):
            if form == "cond" or (form == "steady" and valid_fraction < 1):
                return lax.cond(ok, lambda s, g: slot(kind, True, s, g), lambda s, g: (s, g),
                                stash, grads)
            return slot(kind, ok, stash, grads)

        def one_round(carry, ok):  # ok: [2] bool, this round's F and B slots
            stash, grads = run("F", ok[0], *carry)
            return run("B", ok[1], stash, grads), None

        start = ([jnp.zeros_like(t) for t in template], jax.tree.map(jnp.zeros_like, layers))
        return lax.scan(one_round, start, valid)[0][1]

    return jax.jit(loop), (layers, x)


def device_to_host_copies(fn, args) -> int:
    """Device-to-host memcpy events in a profile of one call (a GPU's conditionals)."""
    import tempfile
    import pathlib

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        (path,) = pathlib.Path(trace_dir).rglob("*.xplane.pb")
        profile = ProfileData.from_file(str(path))
    return sum(1 for plane in profile.planes if plane.name.startswith("/device:")
               for line in plane.lines for event in line.events
               if "dtoh" in event.name.lower() or "devicetohost" in event.name.lower())


def measure(shape: dict, rounds: int, repeats: int) -> list:
    import jax

    rows = []
    for name, (form, fraction) in VARIANTS.items():
        fn, args = build(shape, rounds, form, fraction)
        compiled = fn.lower(*args).compile()
        jax.block_until_ready(compiled(*args))  # warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
        rows.append({"variant": name, "form": form, "valid_fraction": fraction,
                     "ms_per_round": 1e3 * statistics.median(times) / rounds,
                     "dtoh_copies_per_round": device_to_host_copies(compiled, args) / rounds})
    return rows


def _with_command_buffers(args) -> dict:
    """The same measurement in a child process whose XLA records conditionals into CUDA
    graphs (its rows, or the error it ended with)."""
    import tempfile

    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                     f"{COMMAND_BUFFER_FLAGS}".strip())
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = [sys.executable, "-m", "bench.pipeline_rounds", "--json", out.name,
                 "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        done = subprocess.run(child + (["--toy"] if args.toy else []), env=env,
                              capture_output=True, text=True)
        if done.returncode:
            return {"error": done.stderr.strip()[-2000:]}
        return json.load(open(out.name))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--toy", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--command-buffers", action="store_true",
                        help="also run with CUDA-graph command buffers for conditionals")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.repeats < 1:
        print("error: --rounds must be >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    import jax

    shape = SHAPES["toy" if args.toy else "gpt-1.3B"]
    rows = measure(shape, args.rounds, args.repeats)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": "python -m bench.pipeline_rounds " + " ".join(sys.argv[1:]),
              "shape": shape, "rounds": args.rounds, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "rows": rows}
    print(f"{'variant':20s} {'ms/round':>9s} {'DtoH/round':>10s}")
    for row in rows:
        print(f"{row['variant']:20s} {row['ms_per_round']:9.3f} "
              f"{row['dtoh_copies_per_round']:10.2f}")
    print(f"reproduce: python -m bench.pipeline_rounds {' '.join(sys.argv[1:])}")
    if args.command_buffers:
        result["command_buffers"] = _with_command_buffers(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
