"""Training throughput of GPT models on one device (or the few a pipelined or
context-parallel variant names), jaxptd against a PyTorch baseline.

Each (model, variant) is built through the training code path (`load_config` of
configs/gpu/<model>.yaml with overrides, `make_mesh`, `Setup`, `jaxptd.train.loop.compile_step`)
and measured in its own process, so peak device memory is that run's and a crash, an
out-of-memory or a Triton compile error becomes an `error` in its row instead of ending
the benchmark. Per run: the median step time of --steps steps after --warmup, each waited
on (compile time reported apart), tokens/s, TFLOP/s per device and MFU by PTD-P equation
(3) as the training log counts them (recomputation included when there is some; MFU
against the device's dense bf16 peak), the same by 6N + attention (model FLOPs only,
`jaxptd.train.metrics.flops_6n`), peak device memory (`peak_bytes_in_use`; none on CPU) and the
first and last loss. The PyTorch baseline (bench/torch_gpt.py, its own process too) runs
each model's base variant when torch is importable.

Models: gpt-125M, gpt-350M, gpt-1.3B (GPT-3's shapes, seq 2048, vocab 50257, bf16 with
fp32 masters, AdamW), llama-<size> (the same sizes with model.arch=llama: skipped with a
note until that key exists), and <arch>-toy (a 2-layer stand-in for CI). Variants: "base"
(the config as written) or comma-separated changes of attention (xla, cudnn), kernels
(xla, pallas), remat (none, minimal, selective, full), scan (auto, true, false: the layers
scanned or unrolled), b (microbatch size; the global batch stays --global-batch
sequences), layers, and the layout's pipe, schedule, chunks and context (a run takes the
first data x pipe x context x tensor devices; TFLOP/s and MFU are per device, peak memory
the device's that used most), e.g. "attention=xla,remat=selective,b=2" or
"pipe=8,layers=32,b=2,schedule=zb-v,chunks=2".

    python -m bench.gpu_train --models gpt-1.3B --variants base kernels=pallas

Results are merged into <--out-dir>/gpu_train_<device>.json (bench/gpu_results.py: rows
replace those of the same model and variant), written after every run; `models` holds
each model's base run beside its baseline. The table printed at the end shows this
invocation's runs; `python -m bench.gpu_results FILE` prints the whole file's.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import gpu_results
from jaxptd.config import ConfigError, load_config
from bench.report import result_path

ROOT = pathlib.Path(__file__).resolve().parents[1]

SIZES = {"125M": "gpt_125m.yaml", "350M": "gpt_350m.yaml", "1.3B": "gpt_1.3b.yaml",
         "toy": "gpt_125m.yaml"}
TOY = ("model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
       "model.seq_len=32", "model.vocab_size=500")
ARCHS = {"gpt": (), "llama": ("model.arch=llama",)}
VARIANT_KEYS = {"attention": "model.attention", "kernels": "model.kernels",
                "remat": "model.remat", "scan": "model.scan_layers", "seq": "model.seq_len",
                "pack": "model.document_end", "context": "parallel.context",
                "experts": "model.moe_experts", "topk": "model.moe_top_k",
                "expert_ffn": "model.moe_ffn", "capacity": "model.moe_capacity",
                "fp8": "model.fp8", "pipe": "parallel.pipe", "schedule": "parallel.schedule",
                "chunks": "parallel.chunks", "layers": "model.num_layers"}
RUN_TIMEOUT_S = 300


class BenchError(ValueError):
    """A user error on the command line: printed as one `error:` line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One (model, variant): its config file and overrides, or why it cannot run here."""
    model: str
    variant: str
    path: str  # relative to the repository root
    overrides: tuple
    skipped: str | None = None

    def config(self):
        return load_config(str(ROOT / self.path), list(self.overrides))


def model_source(name: str):
    """'gpt-1.3B' -> (config path, overrides, why this JAX stack cannot build it or None).

    Architectures other than the GPT are selected by their overrides (model.arch); a
    config that refuses those (the key or its value does not exist yet) makes the model
    skipped, with the config's own message, instead of an error.
    """
    arch, _, size = name.partition("-")
    if arch not in ARCHS or size not in SIZES:
        known = [f"{a}-{s}" for a in ARCHS for s in SIZES]
        raise BenchError(f"--models {name}: unknown model (known: {', '.join(known)})")
    path = f"configs/gpu/{SIZES[size]}"
    overrides = (*ARCHS[arch], *(TOY if size == "toy" else ()))
    try:
        Job(name, "base", path, overrides).config()
    except ConfigError as e:
        if not ARCHS[arch] or not str(e).startswith("model.arch"):
            raise
        return path, overrides, f"not built yet: {str(e).split(' (known')[0]}"
    return path, overrides, None


def make_job(model: str, variant: str, global_batch: int) -> Job:
    """Validates the model name, the variant and the resulting config (no device work)."""
    try:
        path, overrides, skipped = model_source(model)
    except ConfigError as e:
        raise BenchError(f"{model}: {e}") from None
    if skipped:
        return Job(model, variant, path, overrides, skipped)
    changes, b = [], None
    for item in [] if variant == "base" else variant.split(","):
        key, _, value = item.partition("=")
        if key == "b" and value.isdigit() and int(value) > 0:
            b = int(value)
        elif key in VARIANT_KEYS and value:
            changes.append(f"{VARIANT_KEYS[key]}={value}")
        else:
            raise BenchError(f"--variants {variant}: {item!r} is not one of "
                             f"{', '.join(VARIANT_KEYS)}=VALUE or b=N (or 'base')")
    try:
        b = b or Job(model, variant, path, overrides).config().microbatch_size
        if global_batch % b:
            raise BenchError(f"--variants {variant}: microbatch size {b} must divide "
                             f"--global-batch {global_batch}")
        job = Job(model, variant, path, (*overrides, *changes, f"train.global_batch={global_batch}",
                                         f"parallel.microbatches={global_batch // b}"))
        job.config()
    except ConfigError as e:
        raise BenchError(f"{model} {variant}: {e}") from None
    return job


# ---- one run, in the worker process -------------------------------------------------

def compile_for(config):
    """(setup, state, batch, compiled step, FLOPs per iteration, compile seconds): the
    training step of `config` on the first devices its layout needs (data x pipe x context
    x tensor; one for most rows), with a fixed batch of random tokens."""
    import jax
    import numpy as np

    from jaxptd.train import metrics
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup
    from jaxptd.train.loop import compile_step

    devices = jax.devices()[:config.num_devices]
    if len(devices) < config.num_devices:
        raise RuntimeError(f"the layout needs {config.num_devices} devices, this machine has "
                           f"{len(devices)}")
    setup = Setup(config, make_mesh(config.parallel, devices))
    state = setup.state_layout.init_state(config.train.seed)
    shape = (config.train.global_batch, config.model.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, shape)
    batch = jax.device_put(tokens.astype(np.int32), setup.batch_sharding)
    start = time.perf_counter()
    step, flops = compile_step(setup, state, batch, metrics.StepTimer(), None)
    return setup, state, batch, step, flops, time.perf_counter() - start


def run_steps(step, state, batch, n: int):
    """n steps, each waited on: (state, seconds of each, loss arrays)."""
    import jax

    times, losses = [], []
    for _ in range(n):
        start = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
        losses.append(out["loss"])
    return state, times, losses


def measure(config, steps: int, warmup: int) -> dict:
    """Compiles and times the training step of `config` on the first devices it needs:
    throughput per device, and the peak memory of the device that used most."""
    import jax

    from jaxptd.train import metrics

    setup, state, batch, step, flops, compile_s = compile_for(config)
    state, times, losses = run_steps(step, state, batch, warmup + steps)
    step_s = statistics.median(times[warmup:])
    B, s = config.train.global_batch, config.model.seq_len
    # (the checkpoint's logical layout: a pipelined state also holds the ends a stage)
    logical = setup.state_layout.abstract_state(logical=True)["params"]
    params = sum(x.size for x in jax.tree.leaves(logical))
    devices = list(setup.mesh.devices.flat)
    device, n = devices[0], len(devices)
    peak = metrics.peak_flops(device)
    model_flops = metrics.throughput(metrics.flops_6n(params, config.model, B), B * s,
                                     step_s, n, peak)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    return {**metrics.throughput(flops, B * s, step_s, n, peak),
            "tflops_6n": model_flops["tflops_per_device"], "mfu_6n": model_flops["mfu"],
            "step_time_s": step_s, "step_times_s": times[warmup:], "compile_s": compile_s,
            "params": params, "flops_per_iteration": flops,
            "peak_memory_bytes": max(peaks) if None not in peaks else None, "devices": n,
            "temp_bytes": step.memory_analysis().temp_size_in_bytes,
            "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
            "device": device.device_kind, "platform": device.platform}


def describe(config) -> dict:
    m = config.model
    return {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
            "seq": m.seq_len, "dtype": m.dtype, "attention": m.attention,
            "kernels": m.kernels, "remat": m.remat, "global_batch": config.train.global_batch,
            "microbatch_size": config.microbatch_size,
            "microbatches": config.parallel.microbatches, "pipe": config.parallel.pipe,
            "schedule": config.parallel.schedule, "chunks": config.parallel.chunks}


# ---- the orchestrating process: it never starts a JAX backend (that would hold memory) --

def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # JAX's default keeps 25% back
    return env


def failure(output: str, returncode: int) -> str:
    """One line saying why a run failed, from its output. Out of memory is what XLA
    (RESOURCE_EXHAUSTED) or PyTorch (OutOfMemoryError) raise, not the allocator's warning
    that it ran out of memory, which successful runs print too."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    oom = [line for line in lines if "RESOURCE_EXHAUSTED" in line or "OutOfMemoryError" in line]
    if oom:
        return "out of memory: " + oom[-1][:240]
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (raised or lines or [f"exit status {returncode}"])[-1][:300]


def run_child(cmd: list, timeout: float, log_path: pathlib.Path) -> dict:
    """Runs `cmd --result FILE` in its own session: the dict it wrote, or {"error": ...}.
    Its output is appended to log_path; on timeout its whole process group is killed."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        cmd = [*map(str, cmd), "--result", str(result)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=child_env(), cwd=ROOT,
                                start_new_session=True)
        try:
            output, timed_out = proc.communicate(timeout=timeout)[0], False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, timed_out = proc.communicate()[0], True
        finally:
            if proc.poll() is None:  # this process is being ended: leave no orphan on the GPU
                os.killpg(proc.pid, signal.SIGKILL)
        with open(log_path, "a") as log:
            log.write(f"==== {shlex.join(cmd[1:])}\n{output}\n")
        if timed_out:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode == 0 and result.exists():
            return json.loads(result.read_text())
    return {"error": failure(output, proc.returncode)}


def probe_device() -> tuple[str, str]:
    """(device kind, platform) of the first device, asked in a short-lived process."""
    env = {**child_env(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    code = "import jax; d = jax.devices()[0]; print(d.device_kind); print(d.platform)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"JAX could not start: {failure(proc.stderr, proc.returncode)}")
    kind, platform = proc.stdout.splitlines()[-2:]
    return kind, platform


def version(package: str) -> str | None:
    return importlib.metadata.version(package) if importlib.util.find_spec(package) else None


def run_budgeted(cmd: list, deadline: float, args, log_path: pathlib.Path) -> dict:
    remaining = deadline - time.monotonic()
    if remaining < 30:
        return {"skipped": f"not started: --budget-s {args.budget_s:g} spent"}
    return run_child(cmd, min(args.run_timeout_s, remaining), log_path)


def measure_job(job: Job, args, deadline: float, log_path: pathlib.Path) -> dict:
    """The run row of one job (measured in a worker process, or why not)."""
    flags = ["--models", job.model, "--variants", job.variant, "--global-batch",
             args.global_batch, "--steps", args.steps, "--warmup", args.warmup]
    row = {"model": job.model, "variant": job.variant, "date": str(datetime.date.today()),
           "command": "python -m bench.gpu_train " + shlex.join(map(str, flags))}
    if job.skipped:
        return {**row, "skipped": job.skipped}
    cmd = [sys.executable, "-m", "bench.gpu_train", "--worker", *flags]
    return {**row, **describe(job.config()), "steps": args.steps,
            **run_budgeted(cmd, deadline, args, log_path)}


def measure_baseline(job: Job, args, deadline: float, log_path: pathlib.Path) -> dict:
    """The PyTorch row of a model's base variant (or why there is none)."""
    row = {"model": job.model, "microbatch_size": job.config().microbatch_size,
           "date": str(datetime.date.today())}
    if not version("torch"):
        return {**row, "skipped": "torch is not importable"}
    if not job.model.startswith("gpt-"):
        return {**row, "skipped": "bench/torch_gpt.py has the GPT only"}
    cmd = [sys.executable, "-m", "bench.torch_gpt", "--config", job.path, *job.overrides,
           "--steps", args.steps, "--warmup", args.warmup]
    row["command"] = "PYTHONPATH=. python " + shlex.join(map(str, cmd[1:]))
    return {**row, **run_budgeted(cmd, deadline, args, log_path)}


def orchestrate(args, jobs: list, command: str) -> pathlib.Path:
    """Runs every job, and each model's baseline after its base run, merging each row
    into the results file as it comes."""
    device, platform = probe_device()
    path = result_path(args.out_dir, "gpu_train", device)
    previous = result_path(args.previous, "gpu_train", device) if args.previous else None
    doc = gpu_results.load(path, previous)
    doc.update(device=device, platform=platform, date=str(datetime.date.today()),
               jax=version("jax"), torch=version("torch"), global_batch=args.global_batch,
               steps=args.steps, warmup=args.warmup, command=[*doc["command"], command],
               compilation_cache=os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    log = pathlib.Path(args.out_dir) / "gpu_train_runs.log"
    deadline = time.monotonic() + (args.budget_s or float("inf"))
    for job in jobs:
        gpu_results.upsert(doc["runs"], measure_job(job, args, deadline, log),
                           ("model", "variant"))
        if job.variant == "base" and not job.skipped and not args.no_torch:
            gpu_results.upsert(doc["baselines"], measure_baseline(job, args, deadline, log),
                               ("model", "microbatch_size"))
        gpu_results.save(path, doc)
    print(gpu_results.table(doc, [(job.model, job.variant) for job in jobs]))
    return path


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-125M,gpt-350M,gpt-1.3B",
                        help="comma-separated, e.g. gpt-1.3B,llama-1.3B")
    parser.add_argument("--variants", nargs="+", default=["base"],
                        help="'base' or e.g. attention=xla,kernels=pallas,remat=full,b=2")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--previous", metavar="DIR",
                        help="start from DIR's results file when --out-dir has none")
    parser.add_argument("--budget-s", type=float,
                        help="start no run after this many seconds; runs end by then")
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.error = _fail
    args = parser.parse_args(argv)
    for flag in ("global_batch", "steps", "budget_s", "run_timeout_s"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            _fail(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be positive")
    if args.warmup < 0:
        _fail(f"--warmup={args.warmup}: must be >= 0")
    return args


def check_out_dir(out_dir: str) -> None:
    try:
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"--out-dir {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise BenchError(f"--out-dir {out_dir}: not writable")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        pairs = dict.fromkeys((model, variant) for model in args.models.split(",")
                              for variant in args.variants)  # in order, once each
        jobs = [make_job(model, variant, args.global_batch) for model, variant in pairs]
        if not args.worker:
            check_out_dir(args.out_dir)
    except BenchError as e:
        _fail(str(e))
    if args.worker:  # one run, in this process
        (job,) = jobs
        pathlib.Path(args.result).write_text(json.dumps(
            measure(job.config(), args.steps, args.warmup)))
        return 0
    command = "python -m bench.gpu_train " + shlex.join(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run finally:
    path = orchestrate(args, jobs, command)
    print(f"reproduce: {command}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
