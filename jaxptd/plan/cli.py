"""`python -m jaxptd.plan`'s command line: its flags, what it prints, its exit status.

Owns turning the flags into the library's typed input once (`_plan_inputs`: the target's
record with the flags' numbers in it, jaxptd/plan/inputs.py) and the three ways a run goes:
a plan (or --search's table), printed as text or --json; --verify on simulated CPU
devices (jaxptd/plan/verify.py); and --verify for a GPU --target, the step compiled for it
without one (jaxptd/plan/compile_check.py), alone or for the best --verify-top rows of
--search. Exit status: 0 fits, 1 does not fit (or no layout does), 2 bad input
('error: ...', one line on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from jaxptd.config import Config, ConfigError, load_config
from jaxptd.plan import compile_check, stand_in
from jaxptd.plan import report as plan_report
from jaxptd.plan.inputs import PlanInputs
from jaxptd.plan.kernels import compiled_step_time
from jaxptd.plan.planner import plan, schedule_stats
from jaxptd.plan.search import search
from jaxptd.plan.verify import cpu_backend, dump_dir, start_cpu_compiler, verify
from jaxptd.runtime.target import TARGETS, Target
from jaxptd.units import GB

DESCRIPTION = """Plan a PTD-P run before it runs, and check the plan against XLA: the real
model's parameter count and per-device shards from `jax.eval_shape` of the initialiser and
the logical sharding rules (no mesh, no memory, so a 3072-GPU config plans on a laptop),
the schedule's bubble and buffers from the simulator and the lowering, memory, time and
communication; `--search` ranks the layouts that fit; `--verify` compiles (never runs) the
real training step on simulated CPU devices, or for a GPU --target without one, and
prints XLA's analyses beside the plan. Device memory is --memory-gb per device, host
memory --host-memory-gb per node shared by --gpus-per-node devices (offloading puts
optimizer state and layer inputs there); a plan fits when both do."""


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxptd.plan", description=DESCRIPTION)
    parser.add_argument("--config", help="YAML file (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="memory bars and schedule timeline")
    parser.add_argument("--tokens", type=float, help="tokens to train on (e.g. 300e9)")
    parser.add_argument("--tflops", type=float, help="achieved TFLOP/s per device (Table 1)")
    parser.add_argument("--target", choices=[n for n, t in TARGETS.items() if t.memory],
                        help="the hardware (jaxptd/runtime/target.py): the defaults of the numbers "
                             "below, and what --verify compiles for (a GPU: XLA's GPU "
                             "compiler, no GPU needed). Default: runtime.target, or a100 "
                             "(the PTD-P paper's) when that is auto")
    parser.add_argument("--memory-gb", type=float,
                        help="usable device memory per device (default: the target's)")
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory per node, shared by its --gpus-per-node devices "
                             "(default: the target's node; DGX A100: 1024)")
    parser.add_argument("--device-tflops", type=float,
                        help="sustained matmul TFLOP/s per device: a flat time model "
                             "(default: the kernel model, jaxptd/plan/kernels.py, on a "
                             "target with a measured GEMM ceiling; else half the peak)")
    parser.add_argument("--hbm-gbs", type=float, help="device memory GB/s")
    parser.add_argument("--intra-gbs", type=float,
                        help="intra-node GB/s per direction (NVLink)")
    parser.add_argument("--inter-gbs", type=float,
                        help="inter-node GB/s per GPU (InfiniBand)")
    parser.add_argument("--host-gbs", type=float,
                        help="host <-> device GB/s per device (PCIe)")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--search", type=int, metavar="N_GPUS",
                        help="rank the layouts (p, t, d, v, m, b, schedule) and memory options "
                             "(SP, ZeRO-1, FSDP/HSDP, offload) that fit on N_GPUS")
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument("--verify-top", type=int, default=3, metavar="K",
                        help="with --search, --verify and a GPU --target: compile the best K "
                             "layouts for it and say whether they fit")
    parser.add_argument("--verify", action="store_true",
                        help="compile the real step, compare: for the GPU --target without a "
                             "GPU (memory, buffers, overlap, cost), else on simulated CPU "
                             "devices")
    parser.error = _fail
    args = parser.parse_args(argv)
    positive = {"--memory-gb": args.memory_gb, "--host-memory-gb": args.host_memory_gb,
                "--host-gbs": args.host_gbs, "--device-tflops": args.device_tflops,
                "--hbm-gbs": args.hbm_gbs, "--intra-gbs": args.intra_gbs,
                "--inter-gbs": args.inter_gbs, "--gpus-per-node": args.gpus_per_node,
                "--top": args.top, "--tokens": args.tokens, "--tflops": args.tflops,
                "--search": args.search}
    for flag, value in positive.items():
        if value is not None and not 0 < value < math.inf:  # nan fails too
            _fail(f"{flag}={value}: must be a positive finite number")
    if (args.tokens is None) != (args.tflops is None):
        _fail("--tokens and --tflops go together (time to train needs both)")
    return args


def _target(args, config: Config) -> Target:
    """The record of the hardware the plan is for: --target, else runtime.target, or a100
    (the PTD-P paper's) when that is auto or has no memory (cpu, gpu)."""
    name = args.target or (config.runtime.target if config.runtime.target in TARGETS
                           and TARGETS[config.runtime.target].memory else "a100")
    return TARGETS[name]


def _plan_inputs(args, target: Target, platform: str) -> PlanInputs:
    """The plan's typed input: target's record with the numbers the flags set in it (GB ->
    bytes), the time model's sustained FLOP/s (default: None, the calibrated kernel model,
    where the target has one; else half the dense bf16 peak), and
    `platform`, the program the plan is for."""
    given = {"usable_memory": args.memory_gb, "host_memory": args.host_memory_gb,
             "hbm": args.hbm_gbs, "intra": args.intra_gbs, "inter": args.inter_gbs,
             "host_link": args.host_gbs}
    hardware = dataclasses.replace(
        target, gpus_per_node=args.gpus_per_node or target.gpus_per_node,
        **{key: value * GB for key, value in given.items() if value is not None})
    flops = args.device_tflops * 1e12 if args.device_tflops is not None else \
        None if target.gemm_fraction and target.chip else 0.5 * target.peak_bf16
    return PlanInputs(hardware, flops, platform, args.tokens, args.tflops)


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    """CLI entry: bad input -> 'error: ...' on stderr, exit 2."""
    args = _parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        named = args.target or config.runtime.target != "auto"
        target = _target(args, config)
        on_gpu = args.verify and named and target.chip is not None  # compiled for it
        # what the plan is for: the target, or the CPU program --verify compiles
        given = _plan_inputs(args, target,
                             "cpu" if args.verify and not on_gpu else target.platform)
        if on_gpu:
            return _search_and_compile(config, args, given, target) if args.search else \
                _verify_gpu(config, args, given, target)
        dump = cpu_backend(config) if args.verify else None  # before anything starts JAX
        if args.search:
            rows = search(config, given, args.search)
            print(json.dumps(rows[: args.top]) if args.json else plan_report.format_search(
                rows, given.hardware, args.search, args.top))
            return 0 if rows else 1
        report = plan(config, given)
        report["memory_limit_gb"] = given.hardware.usable / GB
        if args.verify:
            report["verify"] = verify(config, report, dump)
        if args.png:
            plan_report.draw(report, args.png, schedule_stats(config, given.platform)[2])
    except ConfigError as e:
        _fail(str(e))
    print(json.dumps(report) if args.json else plan_report.format_report(report,
                                                                         given.hardware))
    return 0 if report["fits"] else 1  # scripts: 1 = the plan does not fit


def _search_and_compile(config: Config, args, given: PlanInputs, target: Target) -> int:
    """--search with --verify for a GPU target: the ranked layouts, the best --verify-top
    of them compiled for the target (no GPU), each row saying what the compiled step
    needs, whether it fits and, with the calibrated time model, its step from the compiled
    kernels (`step_s`, kernels.compiled_step_time), by which those compiled rows are
    ranked again, the ones that fit first; a layout the planner let through that does not
    fit when compiled is said so (exit 1 if none of those compiled fits)."""
    start_cpu_compiler(None)
    rows = search(config, given, args.search)
    for row in rows[: args.verify_top]:
        candidate = load_config(args.config, [*args.overrides, *row["overrides"],
                                              f"runtime.target={target.name}"])
        compiled, seconds = compile_check.compile_step(candidate, target,
                                                       given.hardware.gpus_per_node)
        report = compile_check.analyse(candidate, compiled, target, seconds)
        row["compiled"] = {k: report[k] for k in ("fits", "margin_bytes", "compile_s")}
        row["compiled"].update(gb=report["memory"]["total"] / GB,
                               mfu_ceiling=report["cost"]["mfu_ceiling"])
        planned = plan(candidate, given)
        if planned["kernels"]:
            row["compiled"]["step_s"] = compiled_step_time(planned, report,
                                                           given.hardware)["total"]
    rows[: args.verify_top] = sorted(rows[: args.verify_top], key=lambda r: (
        not r["compiled"]["fits"], r["compiled"].get("step_s", 0.0)))
    print(json.dumps(rows[: args.top]) if args.json else plan_report.format_search(
        rows, given.hardware, args.search, args.top))
    checked = [r["compiled"]["fits"] for r in rows[: args.verify_top]]
    return 0 if any(checked) else 1


def _one_pool_bytes(planned: dict) -> float:
    """The plan's device and host bytes as one memory: XLA's topology devices have no host
    memory, so what a run offloads is compiled into device memory. The two pools peak at
    different times: the offloaded layer inputs are all there when the backward starts
    (the head's transient, no gradient yet) and read as it goes, the host's gradients are
    whole when the update runs. So: what lives throughout, plus the larger of the
    backward phase with the offloaded inputs and the update phase with the gradients."""
    device, host = planned["memory_bytes_per_device"], planned["host_memory_bytes_per_device"]
    throughout = sum(device[k] + host[k] for k in ("weights", "gradients", "optimizer")) \
        - host["gradients"]
    return throughout + max(device["backward_phase"] + host["activations"],
                            device["update_phase"] + host["gradients"])


def _verify_gpu(config: Config, args, given: PlanInputs, target: Target) -> int:
    """--verify for a GPU target: the step compiled for it without one (compile_check),
    checked against the plan. `target` is the record as it is (the flags change the plan's
    numbers, not what XLA compiles for)."""
    # XLA dumps the step's memory report where the process tells it, at start (a process
    # whose JAX already runs: nowhere, and no largest buffers)
    dump = dump_dir()
    offloads = config.offload.optimizer or config.offload.activations
    start_cpu_compiler(dump, config.num_devices if offloads else 1)  # (stand_in.py)
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime,
                                                                     target=target.name))
    planned = plan(config, given)
    compiled, seconds = compile_check.compile_step(config, target,
                                                   given.hardware.gpus_per_node)
    one_pool = offloads and not isinstance(compiled, stand_in.Compiled)
    expected = _one_pool_bytes(planned) if one_pool else \
        planned["memory_bytes_per_device"]["total"]
    report = compile_check.analyse(config, compiled, target, seconds, expected, dump)
    report["offloaded_state_on_device"] = one_pool
    report["plan"] = planned
    if planned["kernels"]:  # the calibrated time model, fed the compiled kernels
        report["kernel_time_s"] = compiled_step_time(planned, report, given.hardware)
    print(json.dumps(report) if args.json else compile_check.format_report(report))
    return 0 if report["fits"] else 1
