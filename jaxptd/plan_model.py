"""The planner's analytical model: parameters, activations and memory. No JAX.

Owns the formulas `python -m jaxptd.plan` reports (time and communication are in
jaxptd/plan_time.py); jaxptd/plan.py owns the CLI, the real model's counts (jax.eval_shape)
and the check against XLA. Notation as in the PTD-P paper (seeds/000, §3.1): p pipeline,
t tensor, d data, v chunks, m microbatches per pipeline, b microbatch size, s sequence,
h hidden, a heads, l layers, V vocabulary, B global batch; g the FSDP group (data ranks
one parameter is sharded over), e the bytes of the compute dtype.

Memory per device (the empirical study's model, seeds/002 §4.5: (alpha + 2) w + a, with
our specifics): float32 master weights (4 bytes), float32 gradients (4), Adam mu and nu in
float32 (8): 16 bytes per local parameter (seeds/004's "N_d 16 Psi < GPU RAM" for ZeRO-3).
ZeRO-1 splits the moments over the data replicas; FSDP (ZeRO-3) splits all 16 over g and
adds the layers it gathers; offload.optimizer moves the masters and moments (12 bytes) to
host memory and keeps a compute-dtype copy (e bytes) on the device.

Activations per layer per microbatch are the tensors JAX's autodiff of our layer keeps for
the backward pass (checked against the compiled program by --verify):

    [b, s, h] (SP: [b, s/t, h]): per LayerNorm its float32 input, centred and normalised
                            values, and its output in the compute dtype (x 2 LayerNorms)
    [b, s, h], SP only:     the all-gathered inputs of the two column-parallel matmuls (f),
                            kept by autodiff for their weight gradients
    split [b, s, h/t]:      q, k, v and the attention context
    split [b, s, 4h/t]:     fc1 output and the tanh-GeLU's intermediates (6 tensors)
    split [b, a/t, s, s]:   softmax probabilities in float32 and in the compute dtype
                            (model.attention=cudnn: flash attention keeps only its float32
                            log-sum-exp [b, a/t, s] instead)

Megatron's fused 16-bit kernels keep fewer (Korthikanti et al. 2022, eqs. 1-2:
sbh (10 + 24/t + 5as/(ht)) without, sbh/t (34 + 5as/h) with sequence parallelism);
`korthikanti_layer_bytes` gives those for comparison.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def params_formula(l: int, h: int, V: int, s: int) -> float:
    """Equation (2): P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


# --------------------------------------------------------------------------- activations


def scores_bytes(b, s, a, t, e, flash: bool = False) -> float:
    """What one layer keeps of its attention core: the [b, a/t, s, s] probabilities in
    float32 and the compute dtype (what selective recomputation drops), or with flash
    attention only the float32 log-sum-exp [b, a/t, s]."""
    return 4 * b * a / t * s if flash else a * s * s * b / t * (4 + e)


def layer_activation_bytes(b, s, h, a, t, e, sp: bool = False, flash: bool = False) -> float:
    """Bytes one layer keeps for its backward pass, one microbatch (module docstring)."""
    sbh = s * b * h
    norms = sbh * 2 * (3 * 4 + e) / (t if sp else 1)  # two LayerNorms
    gathered = 2 * sbh * e if sp and t > 1 else 0.0  # f's all-gathered matmul inputs
    split = sbh / t * (4 + 6 * 4) * e  # q, k, v, context; 6 x [b, s, 4h/t]
    return norms + gathered + split + scores_bytes(b, s, a, t, e, flash)


def korthikanti_layer_bytes(b, s, h, a, t, sp: bool = False, remat: str = "none") -> float:
    """Megatron's fused 16-bit layer (Korthikanti et al. 2022, Table 2): no recomputation
    sbh (10 + 24/t + 5as/(ht)), with SP sbh/t (34 + 5as/h); selective recomputation drops
    the 5as/h term; full recomputation keeps the layer input, 2 sbh (2 sbh / t with SP)."""
    sbh = s * b * h
    if remat == "full":
        return 2 * sbh / (t if sp else 1)
    attention = 0 if remat == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


def dense_tap_bytes(b, s, h, t, e) -> float:
    """What a zero-bubble B keeps per layer for its W: each dense() matmul's input (the
    gathered [b, s, h] twice, the context [b, s, h/t], the GeLU output [b, s, 4h/t]) and its
    output gradient (qkv [b, s, 3h/t], the two row-parallel partial sums [b, s, h], fc1
    [b, s, 4h/t]), in the compute dtype: sbh (4 + 12/t) e."""
    return s * b * h * (4 + 12 / t) * e


def head_activation_bytes(b, s, h, vocab_local, e, t_sp: int = 1) -> float:
    """Final LayerNorm (3 float32 [b, s/t_sp, h]; with SP also its gathered output) and the
    float32 logits and exponentials [b, s, V/t]; t_sp = t with SP, else 1."""
    gathered = s * b * h * e if t_sp > 1 else 0.0
    return s * b * (3 * 4 * h / t_sp + 2 * 4 * vocab_local) + gathered


def activation_memory(*, b, s, h, a, t, e, layers_per_stage, vocab_local, remat, pipe,
                      slots=None, chunks=1, keep_activations=True, sp=False, flash=False,
                      offload=False) -> dict:
    """Activation bytes on the busiest device: one microbatch's working set, the pipeline's
    buffers (stash) and, with offload.activations, what waits in host memory.

    remat: "none", "selective" (each layer keeps all but its attention probabilities, which
    the layer being differentiated recomputes) or "full" (each layer keeps its input).
    pipe = 1: one microbatch through all layers (full remat: each layer's input, plus the
    one layer being recomputed). offload (pipe = 1): each layer's input waits in host
    memory and the layer is recomputed, whatever remat says. pipe > 1: the executor's
    buffers, `slots` = {stash, grad, w} (jaxptd/pipeline/lowering.py), each [b, s, h]
    ([b, s/t, h] with SP) in the compute dtype: a stash slot holds a stage input and, with
    parallel.stash = activations, what the chunk's backward keeps (remat full: each layer's
    input) and its output (zero-bubble kinds: the backward of everything but the dense()
    weights keeps about as much, its dense() inputs included); a grad slot an
    output gradient; a W slot (zero-bubble kinds) the chunk's dense_tap_bytes. The working
    set is one microbatch through one chunk. The backward transient is half a layer (the
    cotangents of the layer being differentiated), plus its recomputed probabilities with
    selective remat; with full remat it fits inside the recomputed layer.
    """
    layer = layer_activation_bytes(b, s, h, a, t, e, sp, flash)
    scores = scores_bytes(b, s, a, t, e, flash)
    stage_input = b * s * h * e / (t if sp else 1)
    chunk_layers = layers_per_stage // chunks
    if offload:
        remat = "full"
    # per layer, kept from forward to backward; and the transient of one layer's backward
    kept, transient = {"none": (layer, 0.5 * layer),
                       "selective": (layer - scores, 0.5 * layer + scores),
                       "full": (stage_input, layer)}[remat]
    span = chunk_layers if pipe > 1 else layers_per_stage
    head = head_activation_bytes(b, s, h, vocab_local, e, t if sp else 1)
    working = (0.0 if offload else span * kept) + transient + head
    stash = 0.0
    if pipe > 1:
        slots = slots or {}
        per_slot = stage_input + (chunk_layers * kept + stage_input
                                  if keep_activations else 0.0)
        stash = (slots.get("stash", 0) * per_slot + slots.get("grad", 0) * stage_input
                 + slots.get("w", 0) * chunk_layers * dense_tap_bytes(b, s, h, t, e))
    return {"per_layer": layer, "working": working, "stash": stash,
            "offloaded": span * stage_input if offload else 0.0}


# --------------------------------------------------------------------------- memory


def device_memory(*, counts: dict, activations: dict, microbatches: int, e: int,
                  gather_bytes: int = 4, fsdp: bool = False,
                  offload_optimizer: bool = False) -> tuple[dict, dict]:
    """(device bytes, host bytes) per device, by category.

    counts (local element counts, jaxptd.plan.real_counts): weight_params (the masters,
    after tensor, pipe and FSDP sharding), moment_params (Adam's two moments, also split by
    ZeRO-1), layer_params and ends_params (one layer and the embedding, tensor-local, not
    FSDP-split: what an FSDP gather materialises), largest_leaf.
    weights: float32 masters, or with offload_optimizer the compute-dtype copy the
    forward and backward read (the masters on the host). gradients: the float32
    accumulator. gradient_workspace: a second gradient-sized buffer the compiled step
    holds (each microbatch's gradient before it is added, m > 1, or the reduced copy the
    update reads); it overlaps the activations when m = 1, so the peak takes the larger
    phase. fsdp_gathered: FSDP's gathered parameters in optimizer.grad_reduce_dtype, two
    layers at a time (one in use, the next prefetched) or the embedding and a layer.
    offload_buffer: the leaf whose masters, moments and gradient the update streams in.
    """
    W, M = counts["weight_params"], counts["moment_params"]
    grads = 4.0 * W
    second = grads if microbatches > 1 else 0.0
    gathered = gather_bytes * max(2 * counts["layer_params"],
                                  counts["layer_params"] + counts["ends_params"]) if fsdp else 0.0
    acts = activations["working"] + activations["stash"] + gathered
    transient = max(second + acts, grads)
    device = {"weights": (e if offload_optimizer else 4.0) * W, "gradients": grads,
              "optimizer": 0.0 if offload_optimizer else 4.0 * M,
              "activations": activations["working"], "stash": activations["stash"],
              "fsdp_gathered": gathered, "gradient_workspace": transient - acts,
              "offload_buffer": 16.0 * counts["largest_leaf"] if offload_optimizer else 0.0}
    device["total"] = sum(device.values())
    host = {"weights": 4.0 * W if offload_optimizer else 0.0,
            "optimizer": 4.0 * M if offload_optimizer else 0.0,
            "activations": activations["offloaded"]}
    host["total"] = sum(host.values())
    return device, host


def slots_formula(kind: str, p: int, m: int, v: int) -> dict:
    """The executor's buffer slots per rank when lowering the schedule would take too long:
    GPipe m stash slots; 1F1B and ZB-H1 min(m, 2p - 1); the interleaved kinds min(vm,
    (v + 1) p); zero-bubble kinds as many W slots as stash slots; one grad slot. Exact for
    m a multiple of p (tests/test_plan.py checks it against the lowering), which Megatron's
    interleaved schedule requires; other m can need a few more (the planner lowers those)."""
    if kind == "gpipe":
        stash = m
    elif kind in ("1f1b", "zb-h1"):
        stash = min(m, 2 * p - 1)
    else:
        stash = min(v * m, (v + 1) * p)
    return {"stash": stash, "grad": 1, "w": stash if kind.startswith("zb") else 0}


def divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]
