"""What a plan is made for besides the config: the typed input of the planner's functions.

Owns `PlanInputs`, built once from the command line (jaxptd/plan/cli.py) or by a caller
of the library. The hardware is jaxptd/runtime/target.py's record, the flags' numbers already in
it (bytes, bytes/s: --memory-gb is `usable_memory`, --host-memory-gb `host_memory`,
--hbm-gbs `hbm`, --intra-gbs / --inter-gbs `intra` / `inter`, --host-gbs `host_link`).
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxptd.runtime.target import Target


@dataclass(frozen=True)
class PlanInputs:
    hardware: Target  # a device, its node and links; `usable` is the memory a plan may fill
    device_flops: float | None  # sustained matmul FLOP/s per device the time model
    # assumes; None: the calibrated kernel model of jaxptd/plan/kernels.py
    platform: str  # "gpu" | "cpu": the program a plan counts activations for (--verify on
    # simulated CPU devices plans the CPU program: XLA attention, not flash)
    tokens: float | None = None  # tokens to train on and the achieved TFLOP/s per device:
    tflops: float | None = None  # the time to train (both or neither)
