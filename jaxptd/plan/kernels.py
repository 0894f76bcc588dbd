"""The planner's compute model on a GPU target: what a step's kernels take, from their
shapes (`compute`, no compile), or from a compiled step's static kernel costs
(`compiled_step_time`, jaxptd/plan/compile_check.py's report). No JAX.

A GEMM runs at the target's achievable fraction of its dense peak (Target.gemm_fraction:
the maximum a matmul reaches over a search of shapes) times its wave quantization: XLA's
cuBLAS and Triton GEMMs cut the [M, N] output into tiles of TILE (either orientation, the
better one), one tile per streaming multiprocessor at a time, so ceil(tiles / cores) waves
run where tiles / cores of work are (`wave_efficiency`). A layer's linears run forward
(`forwards` times), and backward as the data gradient ([M, N] x [N, K], an
[M, K] output) and the weight gradient ([K, M] x [M, N]); their FLOPs weigh the layer's
efficiency (`layer_gemm_efficiency`), the head's likewise. Every other kernel streams its
bytes at HBM_FRACTION of the HBM bandwidth; each kernel launched adds KERNEL_S.

What `compute` counts besides GEMMs, a layer and microbatch (n = s / c tokens a rank, e
bytes an element; `forwards`, the times the layer runs forward: 1, 2 under full
recomputation, 3 when a pipelined stage is also recomputed from its stashed input):
without flash attention, XLA's attention moves the score tensor [b, a/t, n, s]
SCORE_PASSES times a forward and a backward outside its GEMMs (a float32 softmax; from a
layer's difference between compiles of one and three layers, the commit that set it),
and 2 a forward, 4 a backward in its GEMMs (q k^T writes
it, p v reads it; dP written, P read for dV, dS read for dQ and dK), those at max(FLOPs,
bytes) with the core's matmuls; activations outside GEMMs (LayerNorms, residual adds, the
MLP's activation) 10 h / t_sp + 2 ffn / t elements a token a forward (3 ffn / t gated;
t_sp = t with sequence parallelism, else 1), twice that a backward; the optimizer's
update UPDATE_BYTES a parameter (Adam: float32 master, gradient and two moments read,
master and moments written, the 16-bit copy written). KERNELS_PER_LAYER kernels a layer
a forward pass's worth (counted in the compiled unpipelined Table 1 rows).

A pipelined rank also runs the executor's rounds (`executor_bytes`, at the HBM rate, each
round that runs an F and a B, the bubble's idle rounds with the rest of compute).
"""
from __future__ import annotations

import math

TILE = (256, 128)  # the output tile of the A100's and H100's large 16-bit cuBLAS GEMMs
HBM_FRACTION = 0.85  # of the datasheet HBM bandwidth a streaming kernel sustains (copies
# reach 85-90% of it on A100 and H100)
KERNEL_S = 3e-6  # a kernel's launch and tail between two dependent kernels on one stream
KERNELS_PER_LAYER = 18  # a layer's kernels a forward pass's worth (module docstring)
SCORE_PASSES = (7.5, 5.5)  # XLA's attention: the score tensor outside GEMMs, a forward and
# a backward (module docstring)
UPDATE_BYTES = 30  # Adam's bytes a parameter: 16 read, 12 written, 2 (the 16-bit copy)


def wave_efficiency(m: int, n: int, cores: int) -> float:
    """Useful work over the waves' capacity of an [m, n] GEMM output in TILE tiles (the
    better orientation) on `cores` streaming multiprocessors."""
    best = 0.0
    for tm, tn in (TILE, TILE[::-1]):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, m * n / (tm * tn * cores * math.ceil(tiles / cores)))
    return best


def gemms_efficiency(rows: int, matrices, cores: int, forwards: int = 1) -> float:
    """The FLOP-weighted wave efficiency of `matrices` ([K, N] weights) applied to `rows`
    tokens: `forwards` forward GEMMs [rows, N], a data gradient [rows, K] and a weight
    gradient [K, N] each (all 2 rows K N FLOPs)."""
    flops = seconds = 0.0
    for k, n in matrices:
        for out, times in (((rows, n), forwards), ((rows, k), 1), ((k, n), 1)):
            flops += times * rows * k * n
            seconds += times * rows * k * n / wave_efficiency(*out, cores)
    return flops / seconds


def layer_matrices(h: int, heads: int, kv_heads: int, ffn: int, t: int, gated: bool):
    """A transformer layer's weight shards [K, N] on a tensor rank: q, k, v; the output
    projection; the MLP's in (gate and up, gated) and out."""
    qkv = h + 2 * h * kv_heads // heads
    return [(h, qkv // t), (h // t, h), (h, (2 if gated else 1) * ffn // t), (ffn // t, h)]


GRAD_SUM_BYTES = 8  # a float32 gradient sum read and written in place, a parameter
CHUNKS_BYTES = 16  # with two or more chunks, a round's chunk (the compiled depth rows:
# BENCHMARKS.md): at a traced index its float32 weights read out of the [v, ...] stack and
# written (8), its gradients written by their GEMMs and read again for the add into the
# sums (8); held static (static_chunks), the rounds whose ranks hold different chunks
# select and add into both chunks' sums, about as much (zb-v)
HEAD_ENDS_BYTES = 20  # an unspread head's parameter a round: the tied embedding cast to
# the compute dtype for the F's and the B's head (4 read + 2 written each), the embedding
# gradient's float32 scatter-add (read and written)


def executor_bytes(*, chunk_params: float, chunks: int, stash_slot: float,
                   copied: float, head_params: float) -> float:
    """Bytes a pipelined rank moves outside GEMMs in a round that runs an F and a B (one
    microbatch through one chunk each way; jaxptd/pipeline/training.py): the B adds the
    chunk's gradients into their float32 sums (buffers.add_chunk: GRAD_SUM_BYTES a
    parameter, the gradient itself fused from the GEMM that makes it), with chunks > 1
    CHUNKS_BYTES more (one chunk is read in place); the F's values are written into their
    stash slot (`stash_slot` bytes, each read and written) and the B's and W's operands
    among them copied out (`copied`, each read and written); and head_params: the head and
    embedding a lockstep round runs on every rank where the head is not spread over pipe
    (HEAD_ENDS_BYTES a parameter; 0: spread, or pipe 1). What the rounds phase of a
    compiled pipelined step moves, kernel by op: the chunk's weights sliced, the sums'
    adds and in-place writes, the stash's dynamic updates and slices, the ends' casts and
    scatter-add (bench/table1.py's rows, bench/h100_compile.py's depth rows)."""
    per_param = GRAD_SUM_BYTES + (CHUNKS_BYTES if chunks > 1 else 0)
    return per_param * chunk_params + 2 * (stash_slot + copied) + HEAD_ENDS_BYTES * head_params


def compute(*, hw, flops: dict, b: int, n: int, s: int, h: int, heads: int, kv_heads: int,
            ffn: int, t: int, sp: bool, gated: bool, flash: bool, forwards: int, e: int,
            layer_microbatches: float, vocab_local: float, params: float,
            fp8_flops: float = 0.0, rounds_bytes: float = 0.0,
            elementwise_again: bool = False) -> dict:
    """Seconds a device spends in kernels a step, before the bubble (module docstring):
    flops = {"linear", "core", "head"}, the executed FLOPs a device of each kind;
    layer_microbatches: layers a device runs times microbatches; params: the parameters
    it updates; rounds_bytes: what a pipelined rank's rounds move a step (executor_bytes
    times its F and B rounds); elementwise_again: the backward runs the layer's elementwise
    forward again (model.remat minimal). Keys: gemm (linears and head), attention (core
    matmuls and score traffic), memory (other activations), rounds (the executor's),
    launches, update, total; gemm_efficiency and head_efficiency (wave quantization) and
    gemm_rate (FLOP/s of the linears)."""
    peak, cores = hw.peak_bf16 * hw.gemm_fraction, hw.chip.cores
    bandwidth = hw.hbm * HBM_FRACTION
    rows = b * n
    layer = gemms_efficiency(rows, layer_matrices(h, heads, kv_heads, ffn, t, gated), cores,
                             forwards)
    head = gemms_efficiency(rows, [(h, int(vocab_local))], cores)
    fp8_saved = fp8_flops * (1 - hw.peak_bf16 / hw.peak_fp8) if hw.peak_fp8 else 0.0
    gemm = (flops["linear"] - fp8_saved) / (peak * layer) + flops["head"] / (peak * head)
    attention = flops["core"] / peak
    if not flash:  # the score tensor's passes, bytes (module docstring)
        scores = layer_microbatches * b * heads / t * n * s * e
        in_gemms = (2 * forwards + 4) * scores / bandwidth
        outside = (SCORE_PASSES[0] * forwards + SCORE_PASSES[1]) * scores / bandwidth
        attention = max(attention, in_gemms) + outside
    per_token = 10 * h / (t if sp else 1) + (3 if gated else 2) * ffn / t
    memory = (forwards + elementwise_again + 2) * per_token * e * rows * layer_microbatches \
        / bandwidth
    launches = (forwards + 2) * KERNELS_PER_LAYER * layer_microbatches * KERNEL_S
    update = UPDATE_BYTES * params / bandwidth
    rounds = rounds_bytes / bandwidth
    total = gemm + attention + memory + rounds + launches + update
    return {"gemm": gemm, "attention": attention, "memory": memory, "rounds": rounds,
            "launches": launches, "update": update, "total": total, "gemm_efficiency": layer,
            "head_efficiency": head, "gemm_rate": peak * layer}


def covered_fraction(by_kind: dict, kinds) -> float:
    """Of a compiled step's collectives of `kinds`, the fraction of their bytes in flight
    beside kernels that take at least as long (each kind's covered launches over its
    launches, weighted by its bytes; jaxptd/plan/compile_check.py's `covered`)."""
    rows = [by_kind[k] for k in kinds if by_kind.get(k, {}).get("launches")]
    total = sum(r["bytes"] for r in rows)
    return sum(r["bytes"] * r["covered"] / r["launches"] for r in rows) / total if total else 0.0


def compiled_step_time(planned: dict, compiled: dict, hw) -> dict:
    """The step time from a compiled step's static kernel costs (compile_check's report:
    `cost`, each kernel at max(FLOPs / peak, bytes / HBM), the lockstep rounds' idle slots
    and the bubble in them; `collectives`) and the plan's links: its GEMM and attention
    seconds at the target's gemm_fraction times the layers' wave efficiency, the rest at
    HBM_FRACTION, KERNEL_S a launch; the plan's tensor and pipe traffic less the fraction
    of the compiled collectives that kernels cover (sequence parallelism's all-gathers and
    reduce-scatters, else all-reduces; collective-permutes and all-to-alls), the rest of
    its communication as planned (the data-parallel reduction at the step's end overlaps
    nothing)."""
    cost, kinds = compiled["cost"], compiled["collectives"]["by_kind"]
    category = cost["category"]
    matmul = sum(category.get(k, {}).get("seconds", 0.0) for k in ("gemm", "attention"))
    rate = hw.gemm_fraction * planned["kernels"]["gemm_efficiency"]
    t = planned["step_time_s"]
    tensor = ("reduce-scatter", "all-gather") if planned["options"]["sequence_parallel"] \
        else ("all-reduce",)
    parts = {"gemm": matmul / rate, "other": (cost["seconds"] - matmul) / HBM_FRACTION,
             "launches": cost["launches"] * KERNEL_S,
             "tensor": t["tensor"] * (1 - covered_fraction(kinds, tensor)),
             "p2p": t["p2p"] * (1 - covered_fraction(kinds, ("collective-permute",
                                                            "all-to-all")))}
    parts.update({k: t[k] for k in ("context", "expert", "fsdp", "data", "host")})
    parts["total"] = sum(parts.values())
    return parts
