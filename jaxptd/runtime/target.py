"""The hardware a run is for: one record per device kind, the one place its numbers live.

Owns `runtime.target` (auto | cpu | gpu | h100 | h200 | a100 | a100-40): what a device can
hold and do (usable memory, dense bf16/fp8 peak, HBM bandwidth, links), the XLA options a
GPU step is compiled with (`compiler_options`: the training run and the deviceless check
pass the same ones to the step's compile), and the description XLA's GPU compiler needs to
compile for that device on a machine without one (`topology_devices`). The planner's defaults, the step's GPU code paths (cuDNN
attention, the pipeline's round form, the Pallas backend) and the deviceless H100 check
read these records; nothing else writes a device number down.

`auto` is what the process sees: the record whose name appears in the first device's kind
(an unknown GPU gets `gpu`, with no peak or bandwidth), `cpu` on CPU devices. A named
target must match the devices the step runs on (`resolve` says so in one line), except that
`topology_devices` makes devices of any GPU target on any machine, to compile (never run).

Numbers are datasheet values for the SXM parts; `memory` is what XLA reports as the
device's size and `usable` the share a run may take (XLA_PYTHON_CLIENT_MEM_FRACTION, set by
the launcher: CUDA's context, cuDNN/cuBLAS workspaces and NCCL's buffers need the rest).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from jaxptd.units import MiB

MEM_FRACTION = 0.90  # of a GPU's memory that XLA may allocate (the launcher exports it)

# XLA options of a GPU training step (`compiler_options`; every one parses on jaxlib
# 0.10.2, tests/test_launch.py). From NVIDIA's JAX-Toolbox "Tips for High-Performance LLMs
# with JAX and XLA" and JAX's GPU performance tips.
GPU_XLA_FLAGS = (
    # The latency-hiding scheduler moves collectives' start and done apart so compute runs
    # between them: the pipeline's collective-permutes, tensor all-reduces, data-parallel
    # reductions.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # (Not --xla_gpu_enable_pipelined_p2p, which pipelines the stage-to-stage sends across
    # the round loop's iterations: XLA 0.10.2 aborts compiling an interleaved step with it
    # ("p2p_schedule_preparation.cc:365 Check failed: kind == kPipelined"), and a zb-h1
    # one at p = 8, m = 32; with loop double-buffering, scheduling fails instead
    # ("kExceedsOverlapLimit"). Seen compiling for H100. The executor sends a round's
    # input gradient at the start of the next round instead: jaxptd/pipeline/executor.py.)
    # Data parallelism: gradient reductions pipelined across loop iterations, and
    # collectives large enough to use the links' bandwidth (at least one layer's gradients
    # or weights per collective).
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # (Not --xla_gpu_enable_pipelined_all_gather: XLA's pass moves each all-gather of a
    # loop body to the iteration before, with every op it depends on back to the loop's
    # invariants and the iteration's slice of them, dots included. In the microbatch scan
    # of an unpipelined step (layers unrolled) every sequence-parallel gather, and FSDP's,
    # depends on nothing the loop carries, so each microbatch's layers ran twice, forward
    # and backward: issue #50, figures in BENCHMARKS.md. Pipelined steps compiled the same.)
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    # Unroll loops by two so the next iteration's collectives overlap this one's compute
    # (the round scans and the layer scan).
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
# Pipelined steps only: up to three collectives in flight at once (XLA's default: one). A
# round's input gradient travels beside its F slot and its output beside its B slot, and
# XLA had serialised them, the first done before the F slot began, so half of a steady
# round's permutes overlapped no GEMM. Two were enough for those; a mixture of experts' F
# slot has its all-to-alls in flight too. Unpipelined, it left fewer of FSDP's collectives
# beside a GEMM, hence pipelined steps only (figures: BENCHMARKS.md, the git log).
PIPELINE_XLA_FLAGS = ("--xla_gpu_experimental_parallel_collective_overlap_limit=3",)


@dataclass(frozen=True)
class Chip:
    """What XLA's GPU compiler needs to know of a device it cannot see (GpuTargetConfig)."""
    cores: int  # streaming multiprocessors
    clock_ghz: float
    l2_bytes: int
    shared_per_core: int
    shared_per_block_optin: int
    compute_capability: tuple[int, int]
    description: str  # the device kind the driver reports


@dataclass(frozen=True)
class Target:
    """One kind of device and the node it sits in. None: not known (CPU, an unknown GPU)."""
    name: str
    platform: str  # "cpu" | "gpu": which code paths the step takes
    memory: float | None = None  # bytes a device has (what XLA reports)
    peak_bf16: float | None = None  # dense FLOP/s
    peak_fp8: float | None = None
    hbm: float | None = None  # bytes/s
    intra: float | None = None  # bytes/s per direction per GPU inside a node (NVLink)
    inter: float | None = None  # bytes/s per GPU between nodes (InfiniBand)
    host_link: float | None = None  # bytes/s per direction host <-> device (PCIe)
    gpus_per_node: int = 8
    host_memory: float | None = None  # bytes per node
    chip: Chip | None = None  # None: no deviceless compile
    usable_memory: float | None = None  # bytes a run may allocate, where not MEM_FRACTION
    # of `memory` (the planner's --memory-gb)
    # What the planner's time model (jaxptd/plan/kernels.py) takes as reachable: the
    # fraction of peak_bf16 a large GEMM sustains (None: no kernel model, the planner's
    # flat rate), and the fractions of `intra` and `inter` NCCL's rings sustain.
    gemm_fraction: float | None = None
    intra_fraction: float = 1.0
    inter_fraction: float = 1.0

    @property
    def usable(self) -> float | None:
        """Bytes of a device a run may allocate (MEM_FRACTION of it on a GPU, unless
        usable_memory says)."""
        if self.usable_memory is not None:
            return self.usable_memory
        if self.memory is None:
            return None
        return self.memory * (MEM_FRACTION if self.platform == "gpu" else 1.0)


# Measured ceilings (the planner's kernel model): the maximum achievable matmul FLOP/s
# over a search of bf16 GEMM shapes (Bekman's ml-engineering MAMF table, CUDA 12.1): A100
# SXM 267.9 of 312 TFLOP/s, H100 SXM 792.1 of 989; NCCL's ring all-reduce bus bandwidth
# inside a DGX node, about 230 GB/s of the A100's 300 GB/s NVLink a direction (0.77;
# H100's NVLink taken alike), and across nodes about 0.92 of a NIC's line rate (HDR
# InfiniBand's 25 GB/s, NDR's 50).
_A100_MEASURED = {"gemm_fraction": 267.9 / 312, "intra_fraction": 0.77,
                  "inter_fraction": 0.92}
_H100_MEASURED = {**_A100_MEASURED, "gemm_fraction": 792.1 / 989}
_H100_CHIP = Chip(132, 1.98, 50 * MiB, 233472, 232448, (9, 0), "NVIDIA H100 80GB HBM3")
TARGETS = {
    "cpu": Target("cpu", "cpu"),
    "gpu": Target("gpu", "gpu"),  # a GPU of no known kind: code paths only
    "h100": Target("h100", "gpu", memory=84_929_347_584, peak_bf16=989e12, peak_fp8=1979e12,
                   hbm=3.35e12, intra=450e9, inter=50e9, host_link=64e9,
                   host_memory=2048e9, chip=_H100_CHIP, **_H100_MEASURED),
    "h200": Target("h200", "gpu", memory=150_754_820_096, peak_bf16=989e12, peak_fp8=1979e12,
                   hbm=4.8e12, intra=450e9, inter=50e9, host_link=64e9, host_memory=2048e9,
                   chip=Chip(132, 1.98, 60 * MiB, 233472, 232448, (9, 0), "NVIDIA H200"),
                   **_H100_MEASURED),
    "a100": Target("a100", "gpu", memory=85_198_045_184, peak_bf16=312e12, hbm=2.039e12,
                   intra=300e9, inter=25e9, host_link=25e9, host_memory=1024e9,
                   chip=Chip(108, 1.41, 40 * MiB, 167936, 166912, (8, 0),
                             "NVIDIA A100-SXM4-80GB"), **_A100_MEASURED),
    "a100-40": Target("a100-40", "gpu", memory=42_505_273_344, peak_bf16=312e12, hbm=1.555e12,
                      intra=300e9, inter=25e9, host_link=25e9, host_memory=1024e9,
                      chip=Chip(108, 1.41, 40 * MiB, 167936, 166912, (8, 0),
                                "NVIDIA A100-SXM4-40GB"), **_A100_MEASURED),
}
NAMES = ("auto", *TARGETS)
# device-kind substrings -> record, most specific first
_KINDS = (("H200", "h200"), ("H100", "h100"), ("A100-SXM4-40GB", "a100-40"),
          ("A100-PCIE-40GB", "a100-40"), ("A100", "a100"))


class TargetError(ValueError):
    """A target that does not match the devices; one line."""


def by_kind(device_kind: str, platform: str) -> Target:
    """The record of a device the process sees (auto)."""
    if platform == "cpu":
        return TARGETS["cpu"]
    kind = device_kind.upper()
    return TARGETS[next((name for key, name in _KINDS if key in kind), "gpu")]


def resolve(name: str, devices) -> Target:
    """runtime.target for the devices a step runs on: auto -> what they are; a named one
    must be of their platform (a GPU record on GPUs of another kind is allowed: its numbers
    are then what the planner uses, the devices' own memory still rules)."""
    seen = by_kind(devices[0].device_kind, devices[0].platform)
    if name == "auto":
        return seen
    target = TARGETS[name]
    if target.platform != seen.platform:
        raise TargetError(f"runtime.target={name}: this process's devices are "
                          f"{devices[0].platform} ({devices[0].device_kind}); use "
                          f"runtime.target=auto, or `python -m jaxptd.plan --verify "
                          f"--target {name}` to compile for it without one")
    return target


def gpu_target_config(target: Target) -> str:
    """The GpuTargetConfig text proto XLA compiles for when the device is absent."""
    chip = target.chip
    major, minor = chip.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: {chip.shared_per_core}
  threads_per_core_limit: 2048 core_count: {chip.cores} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(target.hbm)} l2_cache_size: {chip.l2_bytes}
  clock_rate_ghz: {chip.clock_ghz} device_memory_size: {int(target.memory)}
  shared_memory_per_block_optin: {chip.shared_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{chip.description}"
"""


def topology_devices(target: Target, hosts: int, per_host: int) -> list:
    """hosts x per_host devices of `target` for XLA's GPU compiler, on any machine (the
    CUDA plugin must be installed: `pip install -e .[h100]`). They compile, never run."""
    if target.chip is None:
        raise TargetError(f"--target {target.name}: no device description to compile for "
                          f"(known: {', '.join(n for n, t in TARGETS.items() if t.chip)})")
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(target),
            topology=f"1x{hosts}x{per_host}")
    except Exception as e:  # noqa: BLE001 -- no CUDA plugin, most likely
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TargetError(f"--target {target.name}: XLA's CUDA compiler is not installed "
                          f"here ({first}); `pip install -e '.[h100]'` adds it") from None
    return list(topology.devices)


def compiler_options(target: Target, pipelined: bool = False) -> dict | None:
    """The XLA options of a step compiled for `target` (name -> value, GPU_XLA_FLAGS, and
    PIPELINE_XLA_FLAGS for a pipelined step; None on CPU)."""
    if target.platform != "gpu":
        return None
    flags = GPU_XLA_FLAGS + (PIPELINE_XLA_FLAGS if pipelined else ())

    def value(text: str):
        return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)
    return {name: value(text) for name, text in (f[2:].split("=", 1) for f in flags)}


# XLA 0.10.2 compiling for a GPU it cannot see (and so cannot autotune on) gives some dots
# no Triton tiling: the attention's output projection at PTD-P's 1.7B and 3.6B rows (96
# wide heads, bf16[4096, 2304] out) fails with this message; with Triton's GEMMs off the
# step's dots become cuBLAS calls and it compiles.
TRITON_TILES = "Couldn't find output tile sizes"
TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def compile_lowered(lowered, options: dict | None, compile_fn=None):
    """`lowered.compile(options)` (or compile_fn(lowered, options)), leaving out the options
    the running XLA does not know.

    The flags above are checked against jaxlib 0.10.2; a newer XLA renames or retires some
    (0.11.2 on the H100: no xla_gpu_enable_pipelined_all_reduce/_all_gather). It refuses
    an unknown option before compiling, so each retry is cheap; each one left out is named
    on stderr. A step whose dot Triton cannot tile (TRITON_TILES) is compiled again with
    cuBLAS GEMMs, said on stderr."""
    import jax  # (this module is read by --help paths that never start a backend)

    options = dict(options or {})
    while True:
        try:
            if compile_fn is not None:
                return compile_fn(lowered, options)
            return lowered.compile(options or None)
        except jax.errors.JaxRuntimeError as e:
            if TRITON_TILES in str(e) and options.get(TRITON_GEMM, True):
                print(f"note: XLA's Triton GEMM tiling failed on a dot of this step "
                      f"({TRITON_TILES}): compiling its GEMMs with cuBLAS", file=sys.stderr)
                options[TRITON_GEMM] = False
                continue
            unknown = re.search(r"No such compile option: '(\w+)'", str(e))
            if not unknown or unknown.group(1) not in options:
                raise
            print(f"note: this XLA (jaxlib {jax.lib.__version__}) has no option "
                  f"{unknown.group(1)}: compiling without it", file=sys.stderr)
            del options[unknown.group(1)]
