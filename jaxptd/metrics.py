"""Metrics: FLOPs per iteration (PTD-P eq. 3), throughput, MFU, and the writers.

Owns the numbers the logs report and where they go: a line on stdout (a progress bar when
stdout is a terminal), a JSON object per line in <run_dir>/metrics.jsonl, and TensorBoard
event files when `tensorboardX` is installed.

FLOPs count matrix multiplications only, as the paper does. One forward pass of a GPT layer
costs 24 B s h^2 + 4 B s^2 h, and the logit layer 2 B s h V (other architectures: their
`forward_flops`, e.g. SwiGLU and grouped-query attention for Llama). The backward pass costs
twice the forward; full recomputation adds one more forward of the layers (not the logit
layer). With recomputation this is equation (3):
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)),
and without it 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)). Selective recomputation
(the attention core only) adds the core's 4 B s^2 h per layer to the latter.
"""
from __future__ import annotations

import json
import os
import sys
import time

from jaxptd.config import ModelConfig

# Dense bf16 tensor-core peak FLOP/s by device kind (datasheet values).
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}


def flops_per_iteration(model: ModelConfig, batch: int, vocab: int,
                        recompute: str = "none") -> float:
    """Matmul FLOPs of one training iteration over `batch` sequences (eq. 3 of PTD-P for
    the GPT; the architecture's `forward_flops` per token for any).

    recompute: "none", "selective" (the attention core again) or "full" (every layer's
    forward again: equation (3) itself).
    """
    from jaxptd.model import get
    per_token = get(model).forward_flops(model, vocab)
    layers = model.num_layers * per_token["layer"]
    extra = {"none": 0, "selective": model.num_layers * per_token["core"], "full": layers}
    return batch * model.seq_len * (3 * (layers + per_token["head"]) + extra[recompute])


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device, or None when unknown (e.g. CPU)."""
    for name, flops in PEAK_FLOPS.items():
        if name in device_kind.upper():
            return flops
    return None


def throughput(flops: float, tokens: int, step_time: float, devices: int, peak: float | None):
    """tokens/s, TFLOP/s per device and MFU (None without a known peak)."""
    per_device = flops / step_time / devices
    return {
        "tokens_per_s": tokens / step_time,
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak if peak else None,
    }


class Writer:
    """Writes metrics records; only the process that owns logging should create one."""

    def __init__(self, run_dir: str, total_steps: int):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.tty = sys.stdout.isatty()
        self.tensorboard = None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            pass
        else:
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, record["step"])
        line = " ".join(_fmt(k, v) for k, v in record.items() if v is not None)
        if self.tty:
            done = int(30 * record["step"] / max(self.total_steps, 1))
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}\033[K")
            if record["step"] >= self.total_steps or "val_loss" in record:
                sys.stdout.write("\n")
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"


class StepTimer:
    """Wall time per step between two synchronised points, compile time kept apart."""

    def __init__(self):
        self.start = time.perf_counter()

    def lap(self, steps: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.start) / max(steps, 1)
        self.start = now
        return per_step
