"""Metrics: FLOPs per iteration (PTD-P eq. 3), throughput, MFU, step timing.

Owns the numbers the logs report; where they go (console, metrics.jsonl, TensorBoard) is
jaxptd/runtime/runlog.py's.

FLOPs count matrix multiplications only, as the paper does. One forward pass of a GPT layer
costs 24 B s h^2 + 4 B s^2 h, and the logit layer 2 B s h V (other architectures: their
`forward_flops`, e.g. SwiGLU and grouped-query attention for Llama). The backward pass costs
twice the forward; full recomputation adds one more forward of the layers (not the logit
layer). With recomputation this is equation (3):
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)),
and without it 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)). Selective recomputation
(the attention core only) adds the core's 4 B s^2 h per layer to the latter. `flops_6n`
is the other common count, 6N + attention, for comparison with what others report. A
mixture of experts counts its active parameters (model/moe.py's `active_mlp_flops`).

`moe_record` turns a step's mixture-of-experts statistics into the record's entries.
"""
from __future__ import annotations

import time

from jaxptd.config import ModelConfig
from jaxptd.runtime.target import by_kind


def flops_per_iteration(model: ModelConfig, batch: int, vocab: int,
                        recompute: str = "none") -> float:
    """Matmul FLOPs of one training iteration over `batch` sequences (eq. 3 of PTD-P for
    the GPT; the architecture's `forward_flops` per token for any).

    recompute: model.remat's policy (`recomputed_flops`), "full" equation (3) itself.
    """
    from jaxptd.model import get  # JAX, Flax: the planner imports this module JAX-free
    per_token = get(model).forward_flops(model, vocab)
    layers = model.num_layers * per_token["layer"]
    again = model.num_layers * recomputed_flops(model, per_token, recompute)
    return batch * model.seq_len * (3 * (layers + per_token["head"]) + again)


def recomputed_flops(model: ModelConfig, per_token: dict, recompute: str) -> float:
    """Matmul FLOPs per token that a layer's backward runs again, of the architecture's
    `forward_flops` (per_token): "none" nothing, "selective" the attention core, "full" the
    layer's forward; "minimal" keeps the matmul outputs, so with cuDNN's attention nothing
    and with XLA's or Pallas's attention its core's two matmuls; "minimal_mlp" also the
    q, k, v projection."""
    core = 0 if model.attention == "cudnn" else per_token["core"]
    return {"none": 0, "selective": per_token["core"], "full": per_token["layer"],
            "minimal": core, "minimal_mlp": core + per_token["qkv"]}[recompute]


def flops_6n(params: float, model: ModelConfig, batch: int) -> float:
    """FLOPs of one training iteration over `batch` sequences as 6N + attention.

    The model-FLOPs count of PaLM (Chowdhery et al. 2022, appendix B) and nanoGPT: per
    token 6 N for the weights (forward 2N, backward 4N) plus 12 l h s for the attention
    scores and their product with the values (the full s x s, no causal halving). N is the
    model's parameter count (the tied embedding once; position embeddings, biases and
    LayerNorm included), so this is equation (3) without recomputation up to 6 B s times
    the parameters that are not matmul weights. Recomputation is never counted.
    """
    l, h, s = model.num_layers, model.hidden_size, model.seq_len
    return batch * s * (6 * params + 12 * l * h * s)


def peak_flops(device) -> float | None:
    """Peak dense bf16 FLOP/s of a device (its target record), None when unknown (CPU)."""
    return by_kind(device.device_kind, device.platform).peak_bf16


def throughput(flops: float, tokens: int, step_time: float, devices: int, peak: float | None):
    """tokens/s, TFLOP/s per device and MFU (None without a known peak)."""
    per_device = flops / step_time / devices
    return {
        "tokens_per_s": tokens / step_time,
        "tflops_per_device": per_device / 1e12,
        "mfu": per_device / peak if peak else None,
    }


class StepTimer:
    """Wall time per step between two synchronised points, compile time kept apart."""

    def __init__(self):
        self.start = time.perf_counter()

    def lap(self, steps: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.start) / max(steps, 1)
        self.start = now
        return per_step


def moe_record(stats: dict, model: ModelConfig, batch: int) -> dict:
    """A step's mixture-of-experts statistics (the step's metrics['moe'], numpy, each
    leaf laid out as the layer stack: [units, ...] or pipelined [v, p, Uc, ...], whose
    flattening is model order) -> the log record's entries: per MoE layer (lists, model
    order; with model.moe_every = k entry i is layer (i + 1) k - 1) and their summary
    (scalars). moe_aux: the load-balancing loss a sequence (1 when balanced);
    moe_z: the z-loss a token; moe_load: the busiest expert's rows over the mean (1 when
    balanced); moe_dropped: the share of routed rows dropped (capacity; 0 dropless)."""
    import numpy as np

    load = np.asarray(stats["load"], np.float64)
    load = load.reshape(-1, load.shape[-1])  # [MoE layers, E]

    def layers(name):  # [MoE layers]
        return np.asarray(stats[name], np.float64).reshape(-1)
    routed = batch * model.seq_len * model.moe_top_k
    per_layer = {"moe_aux": layers("aux") / batch,
                 "moe_z": layers("z") / (batch * model.seq_len),
                 "moe_load": load.max(-1) / load.mean(-1),
                 "moe_dropped": layers("dropped") / routed}
    record = {f"{name}_layers": [round(float(x), 6) for x in values]
              for name, values in per_layer.items()}
    record.update({"moe_aux": float(per_layer["moe_aux"].mean()),
                   "moe_z": float(per_layer["moe_z"].mean()),
                   "moe_load": float(per_layer["moe_load"].max()),
                   "moe_dropped": float(per_layer["moe_dropped"].mean())})
    return record
