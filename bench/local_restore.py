"""The local checkpoint tier against the persistent one: the time to save and to restore
the train state of a small model, several processes on CPU devices.

N processes (2 CPU devices each, joined by jax.distributed on this machine) hold the train
state of one model at data N, tensor 2. Each case is timed on process 0 between barriers,
--reps times (the first, compiles included as in a restart, and the median of the rest):
the persistent tier (jaxptd/checkpoint/store.py, Orbax, a synchronous save into
--persistent) and the local tier (jaxptd/checkpoint/local.py into --local, one directory
per process standing for a node): the part of a local save the training thread waits for
(the blocks to the host, the peer's over to this process), the whole local save (the
files written too), a restore from the processes' own copies and one with process 1's
directory deleted (its blocks from its peer's copy). Restores read into the same layout
and compare bitwise with the saved state. The processes share this machine's cores and
both tiers sit on its disks (page cache included), so the ratios to the persistent tier
are the result; absolute times only from real nodes.

    python -m bench.local_restore [--processes 2] [--reps 3] [--layers 4] [--hidden 256]
                                  [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_LOCAL = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
CASES = ("persistent save", "local save (training waits)", "local save (files written)",
         "persistent restore", "local restore", "local restore (a node's copy lost)")


def model_args(args, processes: int) -> list[str]:
    return [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            "model.num_heads=8", "model.seq_len=64", "model.vocab_size=2048",
            f"train.global_batch={2 * processes}", f"parallel.data={processes}",
            "parallel.tensor=2", "runtime.cpu_devices=2"]


def timed(fn, barrier) -> float:
    """Seconds of fn() on this process, every process starting together."""
    barrier()
    began = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - began


def worker(args) -> None:
    """One process of the measurement; process 0 prints the JSON result."""
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"localhost:{args.port}", args.processes, args.worker)
    from jax.experimental import multihost_utils

    from jaxptd.checkpoint.files import layout_metadata
    from jaxptd.checkpoint.local import LocalTier
    from jaxptd.checkpoint.store import Checkpointer
    from jaxptd.config import load_config
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup

    config = load_config(None, model_args(args, args.processes))
    setup = Setup(config, make_mesh(config.parallel))
    state = setup.state_layout.init_state(0)
    abstract = setup.state_layout.abstract_state(logical=True)
    vocab = config.model.vocab_size
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    count = iter(range(1, 10**6))
    barrier = lambda: multihost_utils.sync_global_devices(f"bench-{next(count)}")  # noqa: E731
    times = {case: [] for case in CASES}
    persistent = os.path.join(args.persistent, "persistent")
    template = os.path.join(args.local, "local-{process}")
    for rep in range(args.reps):
        ckpt = Checkpointer(persistent, 1, 1, async_save=False,
                            metadata=layout_metadata(config, args.processes))
        tier = LocalTier(template, 1, 1, persistent)
        step = rep + 1
        times["persistent save"].append(timed(lambda: ckpt.save(step, state), barrier))
        times["local save (training waits)"].append(
            timed(lambda: tier.save(step, state), barrier))
        tier.wait()
        times["local save (files written)"].append(
            timed(lambda: (tier.save(step, state), tier.wait()), barrier))
        restored = {}
        times["persistent restore"].append(timed(lambda: restored.update(
            p=jax.block_until_ready(ckpt.restore_latest(abstract, vocab)[0])), barrier))
        times["local restore"].append(timed(lambda: restored.update(
            l=jax.block_until_ready(tier.restore_newer(abstract, vocab, 0)[0])), barrier))
        same = all(bool((a == b).all()) for a, b in zip(
            jax.tree.leaves(restored["p"]), jax.tree.leaves(restored["l"])))
        if args.worker == 1:
            shutil.rmtree(tier.root(1))
        times["local restore (a node's copy lost)"].append(timed(lambda: jax.block_until_ready(
            LocalTier(template, 1, 1, persistent).restore_newer(abstract, vocab, 0)), barrier))
        assert same, "the local tier restored another state than the persistent one"
        ckpt.close()
        barrier()
        if args.worker == 0:
            for path in [persistent] + [os.path.join(args.local, f"local-{p}")
                                        for p in range(args.processes)]:
                shutil.rmtree(path, ignore_errors=True)
        barrier()
    if args.worker == 0:
        print(json.dumps({"jax": jax.__version__, "state_bytes": nbytes, "seconds": times}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--local", default=DEFAULT_LOCAL, help="the local tier's disk")
    parser.add_argument("--persistent", default=tempfile.gettempdir(),
                        help="the persistent tier's disk")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker >= 0:
        worker(args)
        return 0
    base = sys.argv[1:] if argv is None else list(argv)
    local = tempfile.mkdtemp(prefix="bench-local-", dir=args.local)
    persistent = tempfile.mkdtemp(prefix="bench-persistent-", dir=args.persistent)
    port, env = free_port(), {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "bench.local_restore", *base, "--worker", str(i), "--port",
         str(port), "--local", local, "--persistent", persistent],
        stdout=subprocess.PIPE, text=True, env=env) for i in range(args.processes)]
    outs = [p.communicate()[0] for p in procs]
    shutil.rmtree(local, ignore_errors=True)
    shutil.rmtree(persistent, ignore_errors=True)
    if any(p.returncode for p in procs):
        print(f"error: a process of the measurement failed: {[p.returncode for p in procs]}",
              file=sys.stderr)
        return 1
    result = json.loads(outs[0].strip().splitlines()[-1])
    report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "processes": args.processes, "layers": args.layers,
                       "hidden": args.hidden}, f, indent=1)
    return 0


def report(result: dict, args) -> None:
    """Each case's time over the persistent tier's: the first of the processes (what a
    restart pays: compiles included) and the median of the repetitions after it."""
    times = result["seconds"]
    print(f"local vs persistent checkpoint tier: {args.processes} processes x 2 CPU devices,"
          f" {args.layers} layers h={args.hidden}, state {result['state_bytes'] / 2**20:.1f} "
          f"MiB, jax {result['jax']}, {os.cpu_count()} CPU cores; local tier in {args.local}, "
          f"persistent in {args.persistent}; {args.reps} repetitions")
    print(f"{'case':<36} {'first':>7} {'again':>7}   (time over the persistent tier's)")
    for case in CASES:
        against = times["persistent save" if "save" in case else "persistent restore"]
        again = [statistics.median(t[1:]) if len(t) > 1 else float("nan")
                 for t in (times[case], against)]
        print(f"{case:<36} {times[case][0] / against[0]:>7.2f} {again[0] / again[1]:>7.2f}")
    print("reproduce: python -m bench.local_restore " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
