"""The planner's time model: pipeline bubble, communication volumes, step time, training
days. No JAX. Notation as in jaxptd/plan/model.py (the PTD-P paper's, seeds/000 §3.1).
"""
from __future__ import annotations

DAY = 86400.0


def bubble_formula(p: int, v: int, m: int, zero_bubble: bool = False) -> float:
    """§2.2: (p - 1) / (v m) for 1F1B and interleaved; GPipe has the same bubble. Zero-bubble
    kinds (uniform t_f = t_b = t_w, lockstep; jaxptd/pipeline/schedules/make.py): the ZB-H1
    paper's (p - 1) / (3 m) for v = 1 from m >= p, (p - 1 + p - m) / (3 m) below;
    (p - 1 + max(0, 2p - 2 - m)) / (3 v m) for v > 1 and m >= p."""
    if zero_bubble and v == 1:
        return (p - 1 + max(0, p - m)) / (3 * m)
    if zero_bubble:
        return (p - 1 + max(0, 2 * p - 2 - m)) / (3 * v * m)
    return (p - 1) / (v * m)


def comm_volumes(*, b, s, h, t, e, layers_per_stage, grad_bytes, replicas, fsdp_group=1,
                 stage_params=0.0, gather_bytes=4, tied_grad_bytes=0.0, host_per_step=0.0,
                 host_per_microbatch=0.0) -> dict:
    """Bytes per device. §3.2: point-to-point b s h per microbatch between consecutive
    stages (b s h / t with scatter/gather, §4.1, or sequence parallelism); tensor
    8 b s h (t - 1) / t per layer per microbatch (forward + backward; sequence parallelism's
    all-gathers and reduce-scatters move the same, Korthikanti et al. §4.2.2); data: ring
    all-reduce 2 (r - 1) / r of the float32 gradients over the r data replicas once per
    step (§3.3.1; ZeRO-1's reduce-scatter and all-gather move the same). FSDP over g ranks:
    per microbatch each layer is gathered for the forward and again for the backward and
    its gradient reduce-scattered, 3 (g - 1) / g of the stage's parameters. Embedding
    (pipelined, tied): the first and last stage send each other their gradient of it
    once per step (§3.3.1's embedding group of two; jaxptd/step.py). Host: what
    offloading moves over PCIe (the optimizer state per step, layer inputs per microbatch).
    """
    return {
        "p2p_per_microbatch": b * s * h * e / t,
        "tensor_per_microbatch": layers_per_stage * 8 * b * s * h * (t - 1) / t * e,
        "fsdp_per_microbatch": 3 * (fsdp_group - 1) / fsdp_group * stage_params * gather_bytes,
        "data_per_step": 2 * (replicas - 1) / replicas * grad_bytes if replicas > 1 else 0.0,
        "tied_per_step": tied_grad_bytes,
        "host_per_step": host_per_step, "host_per_microbatch": host_per_microbatch,
    }


def step_time(*, flops_device, bubble, comm, m, v, p, t, d, fsdp_group=1, gpus_per_node,
              device_flops, hbm_bytes_per_s, weight_bytes_per_microbatch, intra_bw, inter_bw,
              host_bw=25e9) -> dict:
    """Seconds per iteration: compute (roofline per microbatch: its FLOPs at device_flops
    or its weight reads from memory, whichever is slower) stretched by the bubble, plus
    communication that is not overlapped: tensor (intra-node when t <= gpus_per_node),
    point-to-point forward and backward (inter-node when a stage spans beyond a node)
    and the tied embedding's exchange between the first and last stage,
    FSDP's gathers (intra-node when a group's g p t devices fit in a node), the data-
    parallel reduction (inter-node unless the whole job fits in one node) and host
    transfers at host_bw.
    """
    per_microbatch = max(flops_device / m / device_flops,
                         weight_bytes_per_microbatch / hbm_bytes_per_s)
    compute = m * per_microbatch * (1 + bubble)
    tensor_bw = intra_bw if t <= gpus_per_node else inter_bw
    p2p_bw = intra_bw if t * p <= gpus_per_node else inter_bw
    fsdp_bw = intra_bw if fsdp_group * p * t <= gpus_per_node else inter_bw
    data_bw = intra_bw if t * p * d <= gpus_per_node else inter_bw
    parts = {
        "compute": compute,
        "tensor": m * comm["tensor_per_microbatch"] / tensor_bw,
        "p2p": (2 * m * v * comm["p2p_per_microbatch"] + comm["tied_per_step"]) / p2p_bw
        if p > 1 else 0.0,
        "fsdp": m * comm["fsdp_per_microbatch"] / fsdp_bw,
        "data": comm["data_per_step"] / data_bw,
        "host": (comm["host_per_step"] + m * comm["host_per_microbatch"]) / host_bw,
    }
    parts["total"] = sum(parts.values())
    return parts


def days_to_train(tokens: float, flops_per_token: float, n: int, tflops: float) -> float:
    """§5.1: iterations T / (B s) times F at n X FLOP/s; F / (B s) is per token."""
    return tokens * flops_per_token / (n * tflops * 1e12) / DAY


def days_eq4(tokens: float, params: float, n: int, tflops: float) -> float:
    """Equation (4): end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * params / (n * tflops * 1e12) / DAY
