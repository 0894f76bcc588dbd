"""The planner's analytical model: parameters, activations and memory. No JAX.

Owns the formulas `python -m jaxptd.plan` reports (time and communication are in
jaxptd/plan/timing.py); jaxptd/plan/counts.py counts the real model (jax.eval_shape),
jaxptd/plan/planner.py feeds these formulas, jaxptd/plan/verify.py checks them against
XLA. Notation as in the PTD-P paper (seeds/000, §3.1): p pipeline, t tensor, d data, v
chunks, m microbatches per pipeline, b microbatch size, s sequence, h hidden, a heads, l
layers, V vocabulary, B global batch; g the FSDP group (data ranks one parameter is
sharded over), e the bytes of the compute dtype.

Memory per device (the empirical study's model, seeds/002 §4.5: (alpha + 2) w + a, with
our specifics): float32 master weights (4 bytes), float32 gradients (4), the optimizer's
float32 moments (Adam's mu and nu 8, SGD's momentum 4): 16 bytes per local parameter with
Adam (seeds/004's "N_d 16 Psi < GPU RAM" for ZeRO-3). ZeRO-1 splits the moments over the
data replicas; FSDP (ZeRO-3) splits all of them over g and adds the one matmul weight it
gathers at a time; offload.optimizer keeps the masters and moments, and unpipelined the
gradients too, in host memory for the whole step, the device holding one layer's at a
time (see device_memory).

Activations per layer per microbatch are what the compiled step keeps for the backward
pass, in the compute dtype (measured per layer on the H100 compile and the CPU one:
--verify, tests/test_plan.py, tests/test_h100_memory.py). The norms and the GeLU keep only their
inputs (jaxptd/model/fused.py), so a layer without recomputation keeps

    [b, s, h] (SP: [b, s/t, h]): its input x and the residual after attention
    [b, s, h] (SP: [b, s/t, h]): the two norm outputs, the column-parallel matmuls' inputs
                                 (SP: gathered again in the backward, tensor.entered)
    split [b, s, h/t]:           q, k, v (grouped-query: fewer k, v), the attention
                                 context and one more copy of it
    split [b, s, ffn/t]:         the first MLP matmul's output (SwiGLU: gate and up); the
                                 GeLU's output is recomputed from it
    split [b, a/t, s, s]:        XLA attention only: the probabilities in the compute
                                 dtype (flash attention: a float32 [b, a/t, s])

model.remat=minimal keeps x, the residual and the column-parallel matmul outputs and the
attention's own outputs (norm outputs and an XLA attention core recomputed); minimal_mlp
the same but q, k, v; full keeps x.
Megatron's fused 16-bit layer (Korthikanti et al. 2022, eqs. 1-2: sbh (10 + 24/t +
5as/(ht)) without, sbh/t (34 + 5as/h) with sequence parallelism) is
`korthikanti_layer_bytes`, for comparison: ours keeps no dropout masks (none without
dropout) nor the GeLU output.

Context parallelism (c ranks, jaxptd/model/context.py) splits every [b, s, ...] above to
[b, n, ...], n = s/c (with SP [b, n/t, h]); attention is what `attention_terms` says of
the method: allgather keeps the gathered keys and values [b, s, k/t, d] twice and the
[b, a/t, n, s] probabilities; the ring (its own flash-attention backward) keeps beside
the layer's q, k, v and context (its output O) only its float32 log-sum-exp [b, n, a/t],
and holds one block part's float32 scores [b, a/t, n/2, n] at a time (with their
probabilities and gradients) where XLA computes its blocks, none where Pallas's flash
kernels do (model.kernels=pallas on a decoder's unpacked rows: planner.flash_attention).

A mixture of experts (Moe) replaces the MLP's term by moe_mlp_bytes: the router's, the
experts' input rows and intermediates, their outputs brought back, and the shared
expert's. Shapes being static, a dropless layer with expert parallelism sizes its rows
for the worst routing, all of an expert group's rows arriving at one rank (moe_rows); what
that takes over balanced routing is what the planner reports as the imbalance headroom.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def params_formula(l: int, h: int, V: int, s: int) -> float:
    """Equation (2): P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


# --------------------------------------------------------------------------- mixture of experts


@dataclass(frozen=True)
class Moe:
    """A mixture of experts' shape as the formulas read it (jaxptd/model/moe.py): E routed
    experts of hidden width fe (model.expert_ffn), top_k of them a token, a shared expert
    of width fs (0: none), ep expert-parallel ranks (parallel.expert), capacity factor cf
    (model.moe_capacity, 0: dropless), in one layer of every `every` (model.moe_every; the
    others dense). balanced: the experts' rows as balanced routing would need them, not as
    the layer allocates them (moe_rows)."""
    experts: int
    top_k: int
    ffn: int
    shared_ffn: int = 0
    ep: int = 1
    capacity: float = 0.0
    balanced: bool = False
    every: int = 1


def moe_rows(tokens: float, moe: Moe) -> dict:
    """Rows of one MoE layer on a rank, one microbatch of `tokens` tokens (T = b s / c: with
    sequence parallelism still the microbatch's, the MLP sees them gathered). routed: A = T
    top_k (token, expert) pairs, what dispatch sends and combine brings back. balanced:
    the rows the rank's experts take when routing is balanced, A (each of the e ranks
    receives A / e rows from each of e ranks). allocated: the rows the layer's buffers
    hold, shapes being static: dropless with e > 1 the receive buffer and every expert
    matmul after it are sized for the worst case, all e A rows of the group at one rank
    (rows past those received are zeros); capacity mode (cf > 0) E x ceil(cf A / E) slots
    (an expert's overflow dropped), balanced or not."""
    routed = tokens * moe.top_k
    if moe.capacity:
        slots = moe.experts * max(1, math.ceil(moe.capacity * routed / moe.experts))
        return {"routed": routed, "balanced": slots, "allocated": slots}
    return {"routed": routed, "balanced": routed, "allocated": moe.ep * routed}


def moe_mlp_bytes(tokens: float, h: int, t: int, e: int, moe: Moe, gated: bool) -> float:
    """Bytes one MoE layer's MLP keeps for its backward, one microbatch (in place of the
    dense MLP's first-matmul outputs, layer_activation_bytes), as jaxptd/model/moe.py
    computes: the router's float32 logits and scores [T, E] and its float32 input [T, h]
    (a copy of the norm output unless the compute dtype is float32); the experts' input
    rows [R, h] (R: moe_rows' allocated rows, or balanced with moe.balanced) and their
    intermediates [R, fe/t], SwiGLU gate, up and their product (the down matmul's input)
    in the compute dtype, GeLU the float32 fc1 output with its bias and the GeLU's in the
    compute dtype; the expert outputs back at their choices [A, h], what the combine's
    weighted sum differentiates; the shared expert as the dense MLP keeps it ([T, fs/t],
    SwiGLU x 2). e: the compute dtype's bytes."""
    rows = moe_rows(tokens, moe)
    r = rows["balanced" if moe.balanced else "allocated"]
    router = 4 * tokens * (2 * moe.experts + (h if e != 4 else 0))
    inner = r * moe.ffn / t * (3 * e if gated else 4 + e)
    return (router + r * h * e + inner + rows["routed"] * h * e
            + tokens * moe.shared_ffn / t * (2 if gated else 1) * e)


# --------------------------------------------------------------------------- activations


def scores_bytes(b, s, a, t, e, flash: bool = False, keys: int = 0) -> float:
    """What one layer keeps of its attention core: the [b, a/t, s, keys] probabilities
    (keys: 0 = s) in the compute dtype (what selective recomputation drops; the softmax
    keeps only its output: jaxptd/model/fused.py), or with flash attention only the float32
    log-sum-exp [b, a/t, s]."""
    return 4 * b * a / t * s if flash else a * s * (keys or s) * b / t * e


def attention_terms(b, s, h, a, t, e, c: int = 1, method: str = "ring",
                    flash: bool = False, kv_heads: int = 0) -> dict:
    """One layer's attention core by what its memory needs, bytes, one microbatch of b
    rows of s tokens over c context ranks (n = s/c queries a rank):
    kept: the probabilities (or flash statistics) a layer without recomputation keeps
    (what selective recomputation drops); unit: one score tensor of the softmax backward
    (it makes two: the probabilities' and the scores' gradients); keys: what the context
    keeps for the backward beside the layer's q, k, v and context (allgather: the gathered
    [b, s, k/t, d] keys and values; ring: its float32 log-sum-exp [b, n, a/t], its output
    O being the layer's context). The ring's unit is the largest block part's float32
    [b, a/t, n/2, n] (the own block's second query half over all its keys;
    jaxptd/model/context.py), with flash blocks (`flash`: Pallas's kernels) none."""
    n = s // c
    if c == 1:
        scores = scores_bytes(b, s, a, t, e, flash)
        return {"kept": scores, "unit": scores, "keys": 0.0}
    if method == "allgather":
        gathered = 2 * b * s * h * (kv_heads or a) / a / t * e  # k and v [b, s, kv/t, d]
        scores = scores_bytes(b, n, a, t, e, flash, keys=s)
        return {"kept": scores, "unit": scores, "keys": gathered}
    return {"kept": 0.0, "unit": 0.0 if flash else scores_bytes(b, n // 2, a, t, 4, keys=n),
            "keys": scores_bytes(b, n, a, t, 4, flash=True)}


# What the ring's XLA blocks hold at once in a layer's backward, in units of its largest
# block part's float32 scores [b, a/t, n/2, n]: its probabilities and their gradients
# (the H100 compile of configs/gpu/llama3_8b_32k.yaml with the ring: XLA's blocks 9.1 GiB
# over Pallas's flash blocks, 2.1 units of 4 GiB)
RING_UNITS = 2


def layer_activation_bytes(b, s, h, a, t, e, sp: bool = False, flash: bool = False,
                           remat: str = "none", ffn: int = 0, kv_heads: int = 0,
                           gated: bool = False, c: int = 1, method: str = "ring",
                           moe: Moe | None = None) -> float:
    """Bytes one layer keeps for its backward pass, one microbatch (module docstring).
    ffn: the MLP width (0: 4h); kv_heads: key/value heads (0: a); gated: SwiGLU's two
    first matmuls; c, method: context parallelism (attention_terms); s is the whole
    sequence, of which a rank holds s/c tokens. moe: the MLP is a mixture of experts
    (moe_mlp_bytes in place of the dense MLP's term; model.remat=minimal keeps it whole,
    an assumption: not measured against the compiled step), in one layer of every
    moe.every: the mean over the layers (full recomputation keeps a unit's input)."""
    n = s // c
    sbh, ffn, kv_heads = n * b * h, ffn or 4 * h, kv_heads or a
    stream = 2 * sbh * e / (t if sp else 1)  # x and the residual after attention
    every = moe.every if moe else 1
    if remat == "full":
        return stream / 2 / every
    qkv = sbh * (1 + 2 * kv_heads / a) * e / t
    mlp = sbh * ffn / h * (2 if gated else 1) * e / t
    if moe:
        mlp = (moe_mlp_bytes(b * n, h, t, e, moe, gated) + (every - 1) * mlp) / every
    context = sbh * e / t
    attention = attention_terms(b, s, h, a, t, e, c, method, flash, kv_heads)
    if remat in ("minimal", "minimal_mlp"):  # + the attention's statistics (flash) or
        # nothing (recomputed; so are the context's gathered keys and the ring's
        # log-sum-exp: no matmul outputs); minimal_mlp recomputes q, k, v too
        return stream + (qkv if remat == "minimal" else 0.0) + context + mlp + \
            (attention["kept"] if flash else 0.0)
    norms = 2 * sbh * e / (t if sp else 1)  # the two norm outputs (SP: before f)
    kept = stream + norms + qkv + 2 * context + mlp + attention["keys"]
    return kept + (attention["kept"] if remat != "selective" or flash else 0.0)


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
    """Each dense() matmul's output gradient, a layer's, which a zero-bubble B keeps for
    its W (qkv [b, s, 3h/t], the two row-parallel partial sums [b, s, h], fc1 [b, s, 4h/t]),
    in the compute dtype: sbh (2 + 7/t) e."""
    return s * b * h * (2 + 7 / t) * e


def dense_input_bytes(b, s, h, t, e, sp: bool = False) -> float:
    """Each dense() matmul's input, a layer's: the two norm outputs [b, s, h] (with sequence
    parallelism as they were before the all-gather, [b, s/t, h]: W gathers them again,
    model.layer_dense_weight_grads), the context [b, s, h/t], the GeLU output [b, s, 4h/t]:
    sbh (2 + 5/t) e, with SP 7 sbh e / t. A zero-bubble schedule's W reads them: taped by
    the F (stash=activations) or the B's recomputation (inputs)."""
    return s * b * h * (2 / (t if sp else 1) + 5 / t) * e


def head_activation_bytes(b, s, h, vocab_local, e, t_sp: int = 1, gpu: bool = False) -> float:
    """Final LayerNorm (3 float32 [b, s/t_sp, h]; with SP also its gathered output) and the
    float32 logits and exponentials [b, s, V/t] (the CPU program); t_sp = t with SP, else
    1. On a GPU XLA fuses the loss into reductions over the logits in the compute dtype,
    whose gradient then takes their buffer: one [b, s, V/t] in e bytes (the H100 compile
    of GPT-1.3B with offload.activations and of seeds/003's FSDP run, buffer by buffer)."""
    gathered = s * b * h * e if t_sp > 1 else 0.0
    logits = e * vocab_local if gpu else 2 * 4 * vocab_local
    return s * b * (3 * 4 * h / t_sp + logits) + gathered


def _stash_bytes(slots, stage_input, chunk_layers, kept, keep_activations, b, n, h, t, e,
                 sp):
    """The pipeline executor's buffers (activation_memory's `slots`)."""
    per_slot = stage_input + (chunk_layers * kept + stage_input if keep_activations else 0.0)
    inputs = chunk_layers * dense_input_bytes(b, n, h, t, e, sp)  # in tape or W slots
    return (slots.get("stash", 0) * per_slot + (slots.get("grad", 0) + 1) * stage_input
            + slots.get("w", 0) * (chunk_layers * dense_tap_bytes(b, n, h, t, e)
                                   + (0.0 if keep_activations else inputs))
            + (slots.get("tape", 0) * inputs if keep_activations else 0.0))


def activation_memory(*, b, s, h, a, t, e, layers_per_stage, vocab_local, remat, pipe,
                      slots=None, chunks=1, keep_activations=True, sp=False, flash=False,
                      offload=False, ffn=0, kv_heads=0, gated=False, c=1,
                      method="ring", moe=None, xla_gpu=False, gpu=False,
                      regathered=False, unrolled=False, layer_weights=0.0) -> dict:
    """Activation bytes on the busiest device, in the pieces device_memory puts together:
    kept (what the layers keep from forward to backward), the transients of a layer's
    backward and of the head's (they do not overlap: the head's backward ends before the
    layers' begins), the pipeline's buffers (stash) and what offload.activations puts in
    host memory.

    remat: "none", "minimal", "minimal_mlp" (module docstring), "selective" (each layer
    keeps all but its attention probabilities, which the layer being differentiated
    recomputes) or "full" (each layer keeps its input). The backward transient of a layer
    is half a layer without recomputation (the cotangents of the layer being
    differentiated), plus what it recomputes: its probabilities (selective, and minimal
    with XLA attention), the rest of the layer (minimal, minimal_mlp), the whole layer
    (full); with XLA attention also the softmax backward's float32 gradients of the
    probabilities and the scores. pipe = 1: one microbatch through all layers. offload (pipe = 1): each layer's input waits in host
    memory and the layer is recomputed, whatever remat says. (FSDP gathers a layer's
    weights again for its backward: a layer keeps none.) pipe > 1: one microbatch through
    one chunk, plus the executor's buffers, `slots`
    = {stash, grad, w, tape} (jaxptd/pipeline/lowering.py), each [b, s, h] ([b, s/t, h] with SP)
    in the compute dtype, and the input gradient a round carries to the next, which sends
    it (jaxptd/pipeline/executor.py): a stash slot holds a stage input and, with
    parallel.stash = activations, what the chunk's backward keeps and its output
    (zero-bubble kinds: the backward of everything but the dense() weights, which keeps
    the same less the dense() inputs a tape slot holds); a grad slot an output gradient;
    a W slot (zero-bubble kinds) the chunk's dense_tap_bytes, with stash = inputs also its
    dense_input_bytes, which with activations a tape slot holds from F to W.
    c, method: context parallelism; every [b, s, ...] above is [b, s/c, ...] (s stays the
    whole sequence) and the attention core's terms are attention_terms'; flash: the ring's
    blocks are Pallas's flash kernels (else XLA's), for c = 1 and allgather cuDNN's flash
    attention. The ring recomputes nothing of its own (selective recomputation leaves it
    alone); its XLA blocks add RING_UNITS of its unit to a layer's backward.
    moe: a layer's MLP is this mixture of experts (layer_activation_bytes), in one layer of
    every moe.every: the layers are then recomputed a unit of moe.every at a time (the
    stack's element), so full and minimal recomputation's transient is a unit's; the
    others' is the unit's largest layer's.
    regathered: the layers run under sharding.regather's jax.checkpoint policy (FSDP, or
    offload.optimizer's streamed masters), which keeps what the MLP's fused activation
    returns for the second matmul's weight gradient (without it XLA keeps only its input);
    the H100 compile of GPT-1.3B at FSDP 8, buffer by buffer. gpu: the program is XLA's
    for a GPU (head_activation_bytes). layer_weights: a layer's weights cast to the
    compute dtype (0 for float32), which an unpipelined layer with SP keeps where it keeps
    what it computes (remat none or selective): tensor.entered's jax.checkpoint takes
    them cast (the H100 compile, 8 layers against 4 at (2,1,4), h 1024: 46.19 MB a
    layer, kept + gradients + these 46.17; a pipeline passes its cast weights in again).
    unrolled: the layers run unrolled (model.scan_layers), so that with
    parallel.stash=activations, no zero-bubble split and sequence parallelism (or t = 1)
    the executor keeps and reads a stash slot a layer
    at a time (pipeline/training.py, kept_by_layer): an F slot's values in flight are one
    layer's, not the chunk's, and a B slot copies out one layer's kept values at a time.
    xla_gpu: XLA's attention core (not flash) compiled for a GPU, which holds a layer's
    [b, a/t, s, s] twice where nothing recomputes it: where a layer's forward and backward
    are one program (unpipelined, or parallel.stash=inputs) XLA's fusion recomputes the
    probabilities in the softmax's backward from the scores, which it keeps beside them;
    from a stash, the B slot reads a layer's out twice, as stored and transposed for the
    values' gradient (the H100 compile of GPT-1.3B, buffer by buffer: one device, and
    1F1B at (2,2,2) with each stash; a layer at a time since the stash buffers are
    row-major, the chunk's at once before).
    """
    ring = c > 1 and method == "ring"
    shape = dict(ffn=ffn, kv_heads=kv_heads, gated=gated, c=c, method=method, moe=moe)
    layer = layer_activation_bytes(b, s, h, a, t, e, sp, flash, **shape)
    attention = attention_terms(b, s, h, a, t, e, c, method, flash, kv_heads)
    scores = attention["unit"]
    n = s // c  # the tokens of a rank
    stage_input = b * n * h * e / (t if sp else 1)
    chunk_layers = layers_per_stage // chunks
    if offload:
        remat = "full"
    # per layer, kept from forward to backward; and the transient of one layer's backward
    kept = layer_activation_bytes(b, s, h, a, t, e, sp, flash, remat, **shape)
    if regathered and remat == "none":  # the GeLU's (SwiGLU's) output too: [b, s, ffn/t]
        kept += b * n * h * e / t * ((ffn or 4 * h) / h)
    elif sp and pipe == 1 and not offload and remat in ("none", "selective"):
        kept += layer_weights
    unit = moe.every if moe else 1  # the largest of a unit's layers, for its own part:
    largest = layer if unit == 1 else max(layer_activation_bytes(
        b, s, h, a, t, e, sp, flash, **{**shape, "moe": m}) for m in (replace(moe, every=1), None))
    transient = {"none": 0.5 * largest, "minimal": (1.5 * layer - kept) * unit,
                 "minimal_mlp": (1.5 * layer - kept) * unit,
                 "selective": 0.5 * largest + (0.0 if ring else scores),
                 "full": 1.5 * layer * unit}[remat]
    if not flash:  # the softmax's backward: the probabilities' and the scores' gradients
        transient += (RING_UNITS if ring else 2) * scores
    span = chunk_layers if pipe > 1 else layers_per_stage
    # what a stash slot keeps of a layer: a zero-bubble F tapes the dense() inputs for its W
    # (a tape slot), and the vjp of the rest, the B's, keeps the two norm outputs and the
    # context (as the output projection's input) nowhere: with remat none or selective
    # they are the kept dense() inputs (minimal and full keep none of them; the context
    # cuDNN keeps is its own residual). The H100 compile of GPT-1.3B, zb-h1 at (2,2,2):
    # 2.48 GB a stash slot, the full layer's kept values less these, buffer by buffer.
    taped = keep_activations and (slots or {}).get("tape", 0) > 0
    slot_kept = kept - (n * b * h * (2 / (t if sp else 1) + 1 / t) * e
                        if taped and remat in ("none", "selective") else 0.0)
    stash = 0.0 if pipe == 1 else _stash_bytes(slots or {}, stage_input, chunk_layers,
                                               slot_kept, keep_activations, b, n, h, t, e, sp)
    twice = attention["kept"] if xla_gpu and remat == "none" else 0.0
    by_layer = pipe > 1 and keep_activations and unrolled and not (slots or {}).get("w") \
        and (sp or t == 1)
    if pipe > 1 and keep_activations:
        stash += 2 * twice  # read out of the stash twice, a layer's at a time
        if gpu and not by_layer:  # a B slot's read of a slot's other kept values: copies of
            # the chunk's at once, but the stream's
            stash += chunk_layers * max(0.0, slot_kept - twice - 2 * stage_input)
    else:
        kept += twice  # the scores beside the probabilities
    if gpu and pipe > 1 and (slots or {}).get("w"):  # a W slot's reads of the output
        # gradients, a layer at a time but all ahead of the layers' GEMMs (XLA's schedule):
        # the H100 compile of GPT-1.3B, (2,2,2) zb-h1 m8 SP, buffer by buffer
        stash += chunk_layers * dense_tap_bytes(b, n, h, t, e)
    # in flight: a layer's kept values, not the chunk's, where they are stored a layer at a
    # time (by_layer), or on a GPU as XLA schedules the chunk's vjp with row-major stash
    # buffers (pipeline/buffers.py, _row_major): the H100 compile of (2,2,2) 1F1B with XLA
    # attention stores each layer's probabilities as the layers go, from the fifth on
    span = 1 if by_layer or (gpu and pipe > 1 and keep_activations) else span
    return {"per_layer": layer, "kept": 0.0 if offload else span * kept,
            "layer_transient": transient,
            "head_transient": head_activation_bytes(b, n, h, vocab_local, e, t if sp else 1,
                                                    gpu),
            "stash": stash, "offloaded": span * stage_input if offload else 0.0}


# --------------------------------------------------------------------------- memory


def fsdp_gathered_bytes(counts: dict, gather_dtype: str, dtype: str,
                        whole_layer: bool = True, recomputed: bool = False,
                        gpu: bool = False) -> dict:
    """What FSDP holds gathered on a device, {"layer": in a layer's backward, "head": in
    the head's} (jaxptd/train/step.py): the unit it gathers, in gather_dtype
    (optimizer.grad_reduce_dtype), cast to the compute dtype when that differs, and the
    unit's gradient in the compute dtype before its reduce-scatter; the unit is a whole
    layer (parallel.fsdp_unit=layer: counts["layer_gathered_params"]) or the largest
    dense() weight of a layer (matmul: one matmul's, counts["dense_unit_params"], 4 h^2
    for GPT's MLP, beside the rest of the layer, biases and norms, gathered with it); and
    a tied embedding's float32 gradient, which the head's backward begins and the
    embedding's ends (its reduce-scatter waits for both); the ends (embedding, positions,
    final norm) gathered and cast back to the masters' float32. A whole layer recomputed
    from its input (`recomputed`, model.remat=full) has no gradient of it held beside it:
    each weight's is reduce-scattered as it is made (measured on the CPU compile,
    tests/test_plan.py). gpu: the head's backward holds the ends gathered in the compute
    dtype alone (XLA's GPU program casts before gathering, and the tied embedding's
    float32 gradient comes after: the H100 compile of seeds/003's FSDP run)."""
    gather_bytes, e = DTYPE_BYTES[gather_dtype], DTYPE_BYTES[dtype]
    unit = gather_bytes + (e if dtype != gather_dtype else 0) + e  # a gathered element
    layer_unit = unit - (e if recomputed else 0)
    rest = counts["layer_gathered_params"] * (layer_unit if whole_layer else gather_bytes)
    return {"layer": unit * counts["dense_unit_params"] + rest
            + 4 * counts["shared_ends_params"],
            "head": (e if gpu else gather_bytes + 4) * counts["ends_params"]}


def offloaded_state_bytes(counts: dict, streams: bool) -> dict:
    """offload.optimizer (jaxptd/train/offload.py): {"device": what the device holds of the
    masters (and as much of their gradients) in the forward and backward: one layer's and
    the ends' with `streams`, fetched for their use and sent back, pipelined all of them;
    "update": the update's working set, one unit (a layer, or the ends) of masters,
    gradients and moments brought and written back}. Bytes."""
    W, M = counts["weight_params"], counts["moment_params"]
    unit = max(counts["layer_weight_params"], counts["ends_weight_params"]) / W if W else 0.0
    held = 4.0 * (counts["layer_weight_params"] + counts["ends_weight_params"]) if streams \
        else 4.0 * W
    return {"device": held, "update": 2 * unit * (8.0 * W + 4.0 * M)}


def device_memory(*, counts: dict, activations: dict, microbatches: int,
                  gathered: dict | None = None, offload_optimizer: bool = False,
                  streams: bool = False, peeled: int = 0, zero1_hook: bool = False,
                  early_reduced: float = 0.0, reduced_copy: float = 0.0
                  ) -> tuple[dict, dict]:
    """(device bytes, host bytes) per device, by category. The device total is its peak:
    what stays for the whole step plus the larger of two phases.

    counts (local element counts, jaxptd.plan.real_counts): weight_params (the masters,
    after tensor, pipe and FSDP sharding), moment_params (the optimizer's moments, also
    split by ZeRO-1), and what one layer and the ends are of them.
    For the whole step: weights (float32 masters), gradients (the float32 accumulator) and
    optimizer (the moments). Forward and backward phase: `_backward_phase` (its arguments
    are the rest of this function's). Update phase: the reduced gradient the update reads.
    offload.optimizer (jaxptd/train/offload.py): masters and moments live in host memory, and
    with `streams` (unpipelined) the gradients too: the device holds one layer's masters
    and gradients in the backward (and the ends'), and in the update one unit's state
    (offloaded_state_bytes); pipelined, the masters and gradients whole on the device.
    """
    W, M = counts["weight_params"], counts["moment_params"]
    grads, moments = 4.0 * W, 4.0 * M
    on_host = offload_optimizer and streams  # the gradients' sums, too
    offloaded = offloaded_state_bytes(counts, streams) if offload_optimizer else None
    device = {"weights": offloaded["device"] if on_host else 4.0 * W,
              "gradients": offloaded["device"] if on_host else grads,
              "optimizer": 0.0 if offload_optimizer else moments,
              **_backward_phase(activations, grads, microbatches=microbatches,
                                gathered=gathered, on_host=on_host, peeled=peeled,
                                zero1_hook=zero1_hook, early_reduced=early_reduced,
                                reduced_copy=reduced_copy)}
    device["backward_phase"] = sum(device[k] for k in BACKWARD_PHASE)
    device["update_phase"] = offloaded["update"] if offload_optimizer else grads
    device["peak_phase"] = "backward" if device["backward_phase"] >= device["update_phase"] \
        else "update"
    device["total"] = device["weights"] + device["gradients"] + device["optimizer"] \
        + device[f"{device['peak_phase']}_phase"]
    host = {"weights": 4.0 * W if offload_optimizer else 0.0,
            "gradients": grads * (2 if microbatches > 1 else 1) if on_host else 0.0,
            "optimizer": moments if offload_optimizer else 0.0,
            "activations": activations["offloaded"]}
    host["total"] = sum(host.values())
    return device, host


def _backward_phase(activations: dict, grads: float, *, microbatches: int,
                    gathered: dict | None, on_host: bool, peeled: int, zero1_hook: bool,
                    early_reduced: float, reduced_copy: float) -> dict:
    """The device bytes of the forward and backward phase, by category (BACKWARD_PHASE):
    activations (kept, plus the larger of a layer's and the head's transient), what FSDP
    has gathered for them (`gathered`: fsdp_gathered_bytes, None without FSDP), the stash,
    and with m > 1 gradient_workspace, each microbatch's gradient (`grads` bytes) before it
    is added to the accumulator (none when the gradients stream to the host: `on_host`).
    peeled (unpipelined, jaxptd/train/step.py: microbatches, or 0 when pipelined): the step runs
    the last microbatch outside the scan over the others, and XLA gives the two their own
    buffers: with m >= 2 the layers' kept activations twice; with m >= 3, where the scan
    stays a loop, also the gathered layer and the workspace.
    (Measured on the compiled step, tests/test_plan.py; a step that ran every microbatch
    in one loop would not pay it.) zero1_hook (ZeRO-1 without FSDP, reduced inside the
    backward: Config.overlaps_grad_reduce): the reduce-scatter hook places each rank's
    part in a zero gradient of the full shape, one more gradient-sized buffer.
    reduced_copy: the gradients are summed over microbatches in a loop's carry (the
    pipeline's, or the microbatch scan's) and then reduced over the data replicas, which
    writes the reduced gradient beside the sum: this fraction of a gradient more (1, with
    ZeRO-1 the replica's part), in the compiled program on CPU and H100 alike.
    early_reduced (bytes; pipelined, Config.reduces_chunks_early): the reduced gradients of
    the chunks done before the last round, held beside the accumulator until the end.
    """
    gathered = gathered or {"layer": 0.0, "head": 0.0}
    phase = max(("layer", "head"), key=lambda k: activations[f"{k}_transient"] + gathered[k])
    looped = 2 if peeled > 2 else 1  # the loop body's buffers and the peeled microbatch's
    return {"activations": activations["kept"] * (2 if peeled > 1 else 1)
            + activations[f"{phase}_transient"],
            "stash": activations["stash"], "fsdp_gathered": gathered[phase] * looped,
            "gradient_workspace": (grads * looped if microbatches > 1 and not on_host
                                   else 0.0)
            + (grads if zero1_hook else 0.0) + early_reduced
            + (0.0 if early_reduced else reduced_copy * grads)}


BACKWARD_PHASE = ("activations", "stash", "fsdp_gathered", "gradient_workspace")


def slots_formula(kind: str, p: int, m: int, v: int, masked: bool = False) -> dict:
    """The executor's buffer slots per rank when lowering the schedule would take too long:
    GPipe m stash slots; 1F1B and ZB-H1 min(m, 2p - 1); the interleaved kinds min(vm,
    (v + 1) p); zero-bubble kinds as many W slots as stash slots, but for ZB-H1 at
    m < 2p - 2 (one action a round: min(m, p)), and as many tape slots as stash slots;
    one grad slot. Packed for masked rounds (a GPU's round forms: every rank runs its W's
    in the same rounds, schedules/packing.py) zero-bubble kinds need min(m, p) W slots, and
    zb-interleaved one tape slot fewer than stash slots from m = 2p on. Exact for m a
    multiple of p, which Megatron's interleaved schedule requires, and for ZB-H1 at every m
    (tests/test_plan_formulas.py checks both against the lowering); other m can need a
    few more (the planner lowers those)."""
    if kind == "gpipe":
        stash = m
    elif kind in ("1f1b", "zb-h1"):
        stash = min(m, 2 * p - 1)
    else:
        stash = min(v * m, (v + 1) * p)
    w = min(m, p) if kind == "zb-h1" and m < 2 * p - 2 else stash
    tape = stash
    if masked:
        w = min(m, p)
        tape = stash - (kind == "zb-interleaved" and m >= 2 * p)
    zb = kind.startswith("zb")
    return {"stash": stash, "grad": 1, "w": w if zb else 0, "tape": tape if zb else 0}


def divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]
