"""The planner's analytical model of a step's activations: parameters (equation 2), what
a layer, the head and the pipeline's buffers keep, a mixture of experts' rows. No JAX.

Owns those formulas of `python -m jaxptd.plan` (the device and host totals they go into are
jaxptd/plan/memory.py's, time and communication jaxptd/plan/timing.py's);
jaxptd/plan/counts.py counts the real model (jax.eval_shape), jaxptd/plan/planner.py feeds
these formulas, jaxptd/plan/verify.py checks them against XLA. Notation as in the PTD-P
paper (Narayanan et al. 2021, §3.1): p pipeline, t tensor, d data, v chunks, m microbatches
per pipeline, b microbatch size, s sequence, h hidden, a heads, l layers, V vocabulary, B
global batch; g the FSDP group (data ranks one parameter is sharded over), e the bytes of
the compute dtype.

Activations per layer per microbatch are what the compiled step keeps for the backward
pass, in the compute dtype (measured per layer on the H100 compile and the CPU one:
--verify, tests/test_plan.py, tests/test_h100_memory.py). The norms and the GeLU keep only
their inputs (jaxptd/model/fused.py), so a layer without recomputation keeps

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
kernels do (model.kernels=pallas on a decoder's unpacked rows: program.flash_attention).

A mixture of experts (jaxptd/plan/experts.py's Moe) replaces the MLP's term by
moe_mlp_bytes: the router's, the experts' input rows (moe_rows) and intermediates, their
outputs brought back, and the shared expert's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from jaxptd.plan.buffers import dense_tap_bytes, stash_bytes, taped_not_in_slot, v_slots
from jaxptd.plan.experts import Moe, moe_rows

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def params_formula(l: int, h: int, V: int, s: int) -> float:
    """Equation (2): P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


# --------------------------------------------------------------------------- activations


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
# (read off the H100 compile of configs/gpu/llama3_8b_32k.yaml with the ring: XLA's blocks
# over Pallas's flash blocks)
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


def head_activation_bytes(b, s, h, vocab_local, e, t_sp: int = 1, gpu: bool = False) -> float:
    """Final LayerNorm (3 float32 [b, s/t_sp, h]; with SP also its gathered output) and the
    float32 logits and exponentials [b, s, V/t] (the CPU program); t_sp = t with SP, else
    1. On a GPU XLA fuses the loss into reductions over the logits in the compute dtype,
    whose gradient then takes their buffer: one [b, s, V/t] in e bytes (the H100 compile
    of GPT-1.3B with offload.activations and of the PyTorch FSDP 1T run, buffer by buffer)."""
    gathered = s * b * h * e if t_sp > 1 else 0.0
    logits = e * vocab_local if gpu else 2 * 4 * vocab_local
    return s * b * (3 * 4 * h / t_sp + logits) + gathered


@dataclass(frozen=True)
class StepActivations:
    """What activation_memory counts the activations of (its keyword arguments): one
    microbatch of b rows of s tokens (h hidden, a heads, t tensor ranks, e bytes of the
    compute dtype) through a stage of `layers_per_stage` layers and the head (vocab_local:
    V/t), on `pipe` pipeline ranks.

    remat: "none", "minimal", "minimal_mlp" (module docstring), "selective" (each layer
    keeps all but its attention probabilities, which the layer being differentiated
    recomputes) or "full" (each layer keeps its input). pipe = 1: one microbatch through
    all layers; offload (pipe = 1): each layer's input waits in host memory and the layer
    is recomputed, whatever remat says. (FSDP gathers a layer's weights again for its
    backward: a layer keeps none.) pipe > 1: one microbatch through one of the stage's
    `chunks`, plus the executor's buffers, `slots` = {stash, grad, w, tape} counts
    (jaxptd/pipeline/lowering.py; their bytes: jaxptd/plan/buffers.py), a stage input each
    [b, s, h] ([b, s/t, h] with SP) in the compute dtype; keep_activations: parallel.stash
    = activations (zero-bubble kinds: a stash slot keeps the backward of everything but the
    dense() weights, less the dense() inputs a tape slot holds). sp: sequence parallelism.
    ffn, kv_heads, gated: the layer's shape (layer_activation_bytes). c, method: context
    parallelism; every [b, s, ...] above is [b, s/c, ...] (s stays the whole sequence) and
    the attention core's terms are attention_terms'; flash: the ring's blocks are Pallas's
    flash kernels (else XLA's), for c = 1 and allgather cuDNN's flash attention. The ring
    recomputes nothing of its own (selective recomputation leaves it alone); its XLA blocks
    add RING_UNITS of its unit to a layer's backward. moe: a layer's MLP is this mixture of
    experts (layer_activation_bytes), in one layer of every moe.every: the layers are then
    recomputed a unit of moe.every at a time (the stack's element), so full and minimal
    recomputation's transient is a unit's; the others' is the unit's largest layer's.
    regathered: the layers run under sharding.regather's jax.checkpoint policy (FSDP, or
    offload.optimizer's streamed masters), which keeps what the MLP's fused activation
    returns for the second matmul's weight gradient (without it XLA keeps only its input);
    GPT-1.3B's GPU program at FSDP 8, buffer by buffer. gpu: the program is XLA's for
    a GPU (head_activation_bytes). layer_weights: a layer's weights cast to the compute
    dtype (0 for float32), which an unpipelined layer with SP keeps where it keeps what it
    computes (remat none or selective): tensor.entered's jax.checkpoint takes them cast
    (the GPU program, 8 layers against 4 at (2,1,4): a layer's kept values, gradients and
    these; a pipeline passes its cast weights in again). combined_wgrad: FSDP on a GPU a
    matmul at a time (memory.py's _combined_layer_bytes): a scanned layer recomputed whole
    holds one layer's values at its backward's peak, not 1.5 (its weight-gradient matmuls
    run last: the fsdp_1t compile of bench/table1.py). unrolled: the layers run unrolled
    (model.scan_layers), so that with parallel.stash=activations, no zero-bubble split and
    sequence parallelism (or t = 1) the executor keeps and reads a stash slot a layer at a
    time (pipeline/training.py, kept_by_layer: `by_layer`). xla_gpu: XLA's attention core
    (not flash) compiled for a GPU, which holds a layer's [b, a/t, s, s] twice where
    nothing recomputes it: where a layer's forward and backward are one program
    (unpipelined, or parallel.stash=inputs) XLA's fusion recomputes the probabilities in
    the softmax's backward from the scores, which it keeps beside them; from a stash, the B
    slot reads a layer's out twice, as stored and transposed for the values' gradient (the
    GPU program of GPT-1.3B, buffer by buffer: one device, and 1F1B at (2,2,2) with each
    stash; a layer at a time since the stash buffers are row-major, the chunk's at once
    before)."""
    b: int
    s: int
    h: int
    a: int
    t: int
    e: int
    layers_per_stage: int
    vocab_local: float
    remat: str
    pipe: int
    slots: dict | None = None
    chunks: int = 1
    keep_activations: bool = True
    sp: bool = False
    flash: bool = False
    offload: bool = False
    ffn: int = 0
    kv_heads: int = 0
    gated: bool = False
    c: int = 1
    method: str = "ring"
    moe: Moe | None = None
    xla_gpu: bool = False
    gpu: bool = False
    regathered: bool = False
    combined_wgrad: bool = False
    unrolled: bool = False
    layer_weights: float = 0.0

    @property
    def n(self) -> int:
        """The tokens of a rank."""
        return self.s // self.c

    @property
    def stage_input(self) -> float:
        """A stage's input [b, n, h] ([b, n/t, h] with SP), bytes."""
        return self.b * self.n * self.h * self.e / (self.t if self.sp else 1)

    @property
    def chunk_layers(self) -> int:
        return self.layers_per_stage // self.chunks

    @property
    def by_layer(self) -> bool:
        """The executor keeps and reads a stash slot a layer at a time (`unrolled`): an F
        slot's values in flight are one layer's, not the chunk's, and a B slot copies out
        one layer's kept values at a time."""
        return self.pipe > 1 and self.keep_activations and self.unrolled \
            and not (self.slots or {}).get("w") and (self.sp or self.t == 1)

    def layer(self, remat: str = "none", **changed) -> float:
        """layer_activation_bytes of one of these layers (changed: its shape's fields)."""
        shape = dict(ffn=self.ffn, kv_heads=self.kv_heads, gated=self.gated, c=self.c,
                     method=self.method, moe=self.moe)
        return layer_activation_bytes(self.b, self.s, self.h, self.a, self.t, self.e,
                                      self.sp, self.flash, remat, **{**shape, **changed})


def activation_memory(**inputs) -> dict:
    """Activation bytes on the busiest device, in the pieces device_memory puts together:
    kept (what the layers keep from forward to backward), the transients of a layer's
    backward and of the head's (they do not overlap: the head's backward ends before the
    layers' begins), the pipeline's buffers (stash) and what offload.activations puts in
    host memory. inputs: StepActivations' fields (what each means: there)."""
    x = StepActivations(**inputs)
    if x.offload:
        x = replace(x, remat="full")
    layer = x.layer()
    attention = attention_terms(x.b, x.s, x.h, x.a, x.t, x.e, x.c, x.method, x.flash,
                                x.kv_heads)
    kept = x.layer(x.remat)  # per layer, from forward to backward
    if x.regathered and x.remat == "none":  # the GeLU's (SwiGLU's) output too: [b, s, ffn/t]
        kept += x.b * x.n * x.h * x.e / x.t * ((x.ffn or 4 * x.h) / x.h)
    elif x.sp and x.pipe == 1 and not x.offload and x.remat in ("none", "selective"):
        kept += x.layer_weights
    transient = _layer_transient(x, layer, kept, attention["unit"])
    twice = attention["kept"] if x.xla_gpu and x.remat == "none" else 0.0
    stash = _pipeline_buffers(x, kept, twice)
    if not (x.pipe > 1 and x.keep_activations):
        kept += twice  # the scores beside the probabilities
    # in flight: a layer's kept values, not the chunk's, where they are stored a layer at a
    # time (by_layer), or on a GPU as XLA schedules the chunk's vjp with row-major stash
    # buffers (pipeline/buffers.py, row_major): with XLA's attention a compiled pipelined
    # 1F1B step stores each layer's probabilities as the layers go (the git log's figures)
    span = x.chunk_layers if x.pipe > 1 else x.layers_per_stage
    span = 1 if x.by_layer or (x.gpu and x.pipe > 1 and x.keep_activations) else span
    return {"per_layer": layer, "kept": 0.0 if x.offload else span * kept,
            "layer_transient": transient,
            "head_transient": head_activation_bytes(x.b, x.n, x.h, x.vocab_local, x.e,
                                                    x.t if x.sp else 1, x.gpu),
            "stash": stash, "offloaded": span * x.stage_input if x.offload else 0.0}


def _layer_transient(x: StepActivations, layer: float, kept: float, scores: float) -> float:
    """A layer's backward beside what the layers keep: half a layer without recomputation
    (the cotangents of the layer being differentiated), plus what it recomputes: its
    probabilities (selective, and minimal with XLA attention), the rest of the layer
    (minimal, minimal_mlp), the whole layer (full), a unit of moe.every at a time; with XLA
    attention also the softmax backward's float32 gradients of the probabilities and the
    scores (`scores`: attention_terms' unit)."""
    ring = x.c > 1 and x.method == "ring"
    unit = x.moe.every if x.moe else 1  # the largest of a unit's layers, for its own part:
    largest = layer if unit == 1 else max(x.layer(moe=m)
                                          for m in (replace(x.moe, every=1), None))
    full = 1.0 if x.combined_wgrad and not x.unrolled else 1.5
    transient = {"none": 0.5 * largest, "minimal": (1.5 * layer - kept) * unit,
                 "selective": 0.5 * largest + (0.0 if ring else scores),
                 "full": full * layer * unit}[x.remat.removesuffix("_mlp")]
    if not x.flash:  # the softmax's backward: the probabilities' and the scores' gradients
        transient += (RING_UNITS if ring else 2) * scores
    return transient


def _pipeline_buffers(x: StepActivations, kept: float, twice: float) -> float:
    """The executor's buffers (StepActivations' `slots`) and what a GPU program's slots
    read out of them at once; kept: a layer's, twice: XLA's second copy of its
    probabilities on a GPU (xla_gpu)."""
    if x.pipe == 1:
        return 0.0
    slots, n = x.slots or {}, x.n
    # what a stash slot keeps of a layer: a zero-bubble F tapes the dense() inputs for its W
    # (a tape slot), and the vjp of the rest, the B's, keeps the two norm outputs and the
    # context (as the output projection's input) nowhere: with remat none or selective
    # they are the kept dense() inputs (minimal and full keep none of them; the context
    # cuDNN keeps is its own residual). The H100 compile of GPT-1.3B, zb-h1 at (2,2,2),
    # buffer by buffer: a stash slot is the full layer's kept values less these.
    taped = x.keep_activations and slots.get("tape", 0) > 0
    slot_kept = kept - (taped_not_in_slot(x.remat, x.b, n, x.h, x.t, x.e, x.sp) if taped
                        else 0.0)
    stash = stash_bytes(slots, x.stage_input, x.chunk_layers, slot_kept, x.keep_activations,
                        x.b, n, x.h, x.t, x.e, x.sp)
    if x.keep_activations:
        stash += 2 * twice  # read out of the stash twice, a layer's at a time
        if x.gpu and not x.by_layer:  # a B slot's read of a slot's other kept values:
            # copies of the chunk's at once, but the stream's
            stash += x.chunk_layers * max(0.0, slot_kept - twice - 2 * x.stage_input)
    if x.gpu and slots.get("w"):  # a W slot's reads of the output gradients, a layer at a
        # time but all ahead of the layers' GEMMs (XLA's schedule): the H100 compile of
        # GPT-1.3B, (2,2,2) zb-h1 m8 SP, buffer by buffer
        stash += x.chunk_layers * dense_tap_bytes(x.b, n, x.h, x.t, x.e)
    return stash


def slots_formula(kind: str, p: int, m: int, v: int, masked: bool = False) -> dict:
    """The executor's buffer slots per rank when lowering the schedule would take too long:
    GPipe m stash slots; 1F1B and ZB-H1 min(m, 2p - 1); the interleaved kinds min(vm,
    (v + 1) p); zero-bubble kinds as many W slots as stash slots, but for ZB-H1 at m < 2p - 2
    (one action a round: min(m, p)), and as many tape slots as stash slots; one grad slot;
    zb-v buffers.v_slots. Packed for masked rounds (a GPU's round forms: every rank runs its
    W's in the same rounds, a B's own W in its round or that B run again: lowering.py) they
    need no W slot but min(m, p - 1) grad slots (zb-interleaved one more: b_stores), a tape
    slot more where an idle F finds none free (ZB-H1 at m <= 2p - 2, zb-interleaved below
    m = 2p; from 2p one fewer). Exact for m a multiple of p and ZB-H1's every m; else more."""
    if kind == "zb-v":
        return v_slots(p, m, masked)
    if kind == "gpipe":
        stash = m
    elif kind in ("1f1b", "zb-h1"):
        stash = min(m, 2 * p - 1)
    else:
        stash = min(v * m, (v + 1) * p)
    w = min(m, p) if kind == "zb-h1" and m < 2 * p - 2 else stash
    tape = stash
    zb, grad = kind.startswith("zb"), 1
    if masked and zb:
        w, grad = 0, max(1, min(m, p - 1)) + (kind == "zb-interleaved")
        tape = stash + (m <= 2 * p - 2 if kind == "zb-h1" else 1 - 2 * (m >= 2 * p))
    return {"stash": stash, "grad": grad, "w": w if zb else 0, "tape": tape if zb else 0}
