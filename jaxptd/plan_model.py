"""The planner's analytical model: parameters, memory, communication and time. No JAX.

Owns the formulas `python -m jaxptd.plan` reports; jaxptd/plan.py owns the CLI, the real
model's counts (jax.eval_shape) and the check against XLA. Notation as in the PTD-P paper
(seeds/000, §3.1): p pipeline, t tensor, d data, v chunks, m microbatches per pipeline,
b microbatch size, s sequence, h hidden, a heads, l layers, V vocabulary, B global batch.

Memory per device (the empirical study's model, seeds/002 §4.5: (alpha + 2) w + a, with
our specifics): float32 master weights (4 bytes), float32 gradients (4), Adam mu and nu in
float32 (8; ZeRO-1 splits them over d), and activations in model.dtype except LayerNorm and
softmax, which run in float32. Activations per layer per microbatch are the tensors JAX's
autodiff of our layer keeps for the backward pass (counted in the compiled program):

    replicated [b, s, h]:   per LayerNorm its float32 input, centred and normalised values,
                            and its output in the compute dtype (x 2 LayerNorms)
    split [b, s, h/t]:      q, k, v and the attention context
    split [b, s, 4h/t]:     fc1 output and the tanh-GeLU's intermediates (6 tensors)
    split [b, a/t, s, s]:   softmax probabilities in float32 and in the compute dtype

Megatron's fused kernels keep fewer (10 sbh + 24 sbh/t + 5 a s^2 b/t bytes in 16 bits,
Korthikanti et al. 2022); `megatron_layer_activation_bytes` gives that for comparison.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DAY = 86400.0


def params_formula(l: int, h: int, V: int, s: int) -> float:
    """Equation (2): P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def scores_bytes(b, s, a, t, e) -> float:
    """The attention probabilities one layer keeps, in float32 and the compute dtype: what
    selective recomputation drops."""
    return a * s * s * b / t * (4 + e)


def layer_activation_bytes(b, s, h, a, t, e) -> float:
    """Bytes one layer keeps for its backward pass, one microbatch (module docstring)."""
    sbh = s * b * h
    replicated = sbh * 2 * (3 * 4 + e)  # two LayerNorms: 3 float32 tensors + output
    split = sbh / t * (4 + 6 * 4) * e  # q, k, v, context; 6 x [b, s, 4h/t]
    return replicated + split + scores_bytes(b, s, a, t, e)


def megatron_layer_activation_bytes(b, s, h, a, t) -> float:
    """Megatron's fused 16-bit layer: sbh (10 + 24/t) + 5 a s^2 b / t bytes."""
    return s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t


def head_activation_bytes(b, s, h, vocab_local) -> float:
    """Final LayerNorm (3 float32 [b, s, h]) and float32 logits and exponentials."""
    return s * b * (3 * 4 * h + 2 * 4 * vocab_local)


def activation_memory(*, b, s, h, a, t, e, layers_per_stage, vocab_local, remat,
                      pipe, peak_stash, chunks=1, keep_activations=True) -> dict:
    """Activation bytes on the busiest device: the stash and one microbatch's working set.

    remat: "none", "selective" (each layer keeps all but its attention probabilities,
    which the layer being differentiated recomputes) or "full" (each layer keeps its input).
    pipe = 1: one microbatch through all layers (with full remat: each layer's input, plus
    the one layer being recomputed). pipe > 1, parallel.stash = inputs: the executor stashes
    each in-flight (microbatch, chunk)'s stage input (peak_stash of the schedule
    simulator) and recomputes the stage under jax.vjp, so the working set is one
    microbatch through one chunk. parallel.stash = activations: each stash slot keeps the
    chunk's backward residuals (with full remat: each layer's input), its input and its
    output; the working set is the same (a forward materialises one chunk's residuals
    before they are stored). The backward transient is half a layer (the cotangents of the
    layer being differentiated), plus its recomputed probabilities with selective remat;
    with full remat it fits inside the recomputed layer.
    """
    layer = layer_activation_bytes(b, s, h, a, t, e)
    scores = scores_bytes(b, s, a, t, e)
    stage_input = b * s * h * e
    chunk_layers = layers_per_stage // chunks
    # per layer, kept from forward to backward; and the transient of one layer's backward
    kept, transient = {"none": (layer, 0.5 * layer),
                       "selective": (layer - scores, 0.5 * layer + scores),
                       "full": (stage_input, layer)}[remat]
    span = chunk_layers if pipe > 1 else layers_per_stage
    working = span * kept + transient + head_activation_bytes(b, s, h, vocab_local)
    stash = 0.0
    if pipe > 1:
        stash = peak_stash * (chunk_layers * kept + 2 * stage_input if keep_activations
                              else stage_input)
    return {"per_layer": layer, "working": working, "stash": stash,
            "total": working + stash}


def device_memory(*, weight_params, moment_params, activations, microbatches) -> dict:
    """Per-device bytes. weight_params, moment_params: local element counts (float32).

    gradients: the float32 accumulator. gradient_workspace: the compiled step holds a
    second gradient-sized buffer: each microbatch's gradient before it is added to the
    accumulator (m > 1), or the reduced copy the optimizer update reads. It overlaps the
    activations when m = 1, so the peak takes the larger of the two phases.
    """
    weights, grads = 4.0 * weight_params, 4.0 * weight_params
    optimizer = 4.0 * moment_params
    second = grads if microbatches > 1 else 0.0
    transient = max(second + activations["total"], grads)
    total = weights + grads + optimizer + transient
    return {"weights": weights, "gradients": grads, "optimizer": optimizer,
            "activations": activations["total"], "stash": activations["stash"],
            "gradient_workspace": transient - activations["total"], "total": total}


def bubble_formula(p: int, v: int, m: int, zero_bubble: bool = False) -> float:
    """§2.2: (p - 1) / (v m) for 1F1B and interleaved; GPipe has the same bubble. Zero-bubble
    kinds (uniform t_f = t_b = t_w, lockstep): (p - 1 + max(0, 2p - 2 - m)) / (3 v m), the
    ZB-H1 paper's (p-1)/(3vm) from m >= 2p - 2 (jaxptd/pipeline/schedules.py)."""
    if zero_bubble:
        return (p - 1 + max(0, 2 * p - 2 - m)) / (3 * v * m)
    return (p - 1) / (v * m)


def comm_volumes(*, b, s, h, t, d, e, layers_per_stage, grad_bytes) -> dict:
    """Bytes per device. §3.2: point-to-point b s h per microbatch between consecutive
    stages (b s h / t with scatter/gather, §4.1); tensor 8 b s h (t - 1) / t per layer
    per microbatch (forward + backward); data: ring all-reduce 2 (d - 1) / d of the
    float32 gradients once per step (§3.3.1)."""
    return {
        "p2p_per_microbatch": b * s * h * e / t,
        "tensor_per_microbatch": layers_per_stage * 8 * b * s * h * (t - 1) / t * e,
        "data_per_step": 2 * (d - 1) / d * grad_bytes if d > 1 else 0.0,
    }


def step_time(*, flops_device, bubble, comm, m, v, p, t, d, gpus_per_node, device_flops,
              hbm_bytes_per_s, weight_bytes_per_microbatch, intra_bw, inter_bw) -> dict:
    """Seconds per iteration: compute (roofline per microbatch: its FLOPs at device_flops
    or its weight reads from memory, whichever is slower) stretched by the bubble, plus
    communication that is not overlapped: tensor (intra-node when t <= gpus_per_node),
    point-to-point forward and backward (inter-node when a stage spans beyond a node),
    and the data-parallel all-reduce (inter-node unless the whole job fits in one node).
    """
    per_microbatch = max(flops_device / m / device_flops,
                         weight_bytes_per_microbatch / hbm_bytes_per_s)
    compute = m * per_microbatch * (1 + bubble)
    tensor_bw = intra_bw if t <= gpus_per_node else inter_bw
    p2p_bw = intra_bw if t * p <= gpus_per_node else inter_bw
    data_bw = intra_bw if t * p * d <= gpus_per_node else inter_bw
    tensor = m * comm["tensor_per_microbatch"] / tensor_bw
    p2p = 2 * m * v * comm["p2p_per_microbatch"] / p2p_bw if p > 1 else 0.0
    data = comm["data_per_step"] / data_bw
    return {"compute": compute, "tensor": tensor, "p2p": p2p, "data": data,
            "total": compute + tensor + p2p + data}


def days_to_train(tokens: float, flops_per_token: float, n: int, tflops: float) -> float:
    """§5.1: iterations T / (B s) times F at n X FLOP/s; F / (B s) is per token."""
    return tokens * flops_per_token / (n * tflops * 1e12) / DAY


def days_eq4(tokens: float, params: float, n: int, tflops: float) -> float:
    """Equation (4): end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * params / (n * tflops * 1e12) / DAY


def divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]
