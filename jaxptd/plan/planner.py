"""One plan: a config and its PlanInputs -> the JSON-ready report (bytes, seconds).

Owns `plan` and what it needs of the real model beyond the parameter counts
(jaxptd/plan/counts.py) and the step's program (jaxptd/plan/program.py: what a step
recomputes, the schedule's bubble and buffer slots, flash attention, the head's spread):
the memory and time models (jaxptd/plan/model.py, timing.py, kernels.py) fed with them.
`device_memory_bytes` is the one place a run's pre-flight check gets the per-device total
from.

Device memory is the hardware's `usable` bytes per device, host memory `host_memory`
per node shared by `gpus_per_node` devices (offloading puts optimizer state and layer
inputs there); a plan fits when both do. What the planner reads of a model family's
model is on its JAX-free record (jaxptd/arch: Family.gated_mlp, encoder); the model itself
(its FLOPs, the layer scan) is imported inside the functions that ask it: it imports JAX,
which --verify must configure first (jaxptd/plan/verify.py).
"""
from __future__ import annotations

from jaxptd.arch import family
from jaxptd.config import Config
from jaxptd.pipeline import schedules
from jaxptd.plan import memory as pmem
from jaxptd.plan import model as pm
from jaxptd.plan import kernels as pk
from jaxptd.plan import timing as pt
from jaxptd.plan import buffers as pb
from jaxptd.plan.counts import real_counts
from jaxptd.plan.experts import moe_rows
from jaxptd.plan.inputs import PlanInputs
from jaxptd.plan.program import (MINIMAL, causal, flash_attention, head_runs,  # noqa: F401
                                 moe_shape, recomputation, schedule_stats, spreads_head)
from jaxptd.train.metrics import flops_per_iteration


def _memory(config: Config, counts: dict, slots: dict, platform: str,
            balanced: bool = False) -> tuple[dict, dict, dict]:
    """(device bytes, host bytes, activation terms) on the busiest device of `platform`
    ("gpu" or "cpu": which attention is flash, flash_attention); balanced: a mixture of
    experts' rows as balanced routing needs them (moe_shape)."""
    from jaxptd.model import scans_layers  # JAX on use: --verify configures it first
    m_cfg, par = config.model, config.parallel
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    streams = config.offload.optimizer and par.pipe == 1  # the masters fetched per layer
    unrolled = not scans_layers(m_cfg, platform)
    acts = pm.activation_memory(
        b=config.microbatch_size, s=m_cfg.seq_len, h=m_cfg.hidden_size, a=m_cfg.num_heads,
        t=par.tensor, e=e, layers_per_stage=m_cfg.num_layers // par.pipe,
        vocab_local=counts["vocab_padded"] / par.tensor, remat=m_cfg.remat, pipe=par.pipe,
        slots=slots, chunks=par.chunks, keep_activations=par.stash == "activations",
        sp=par.sequence_parallel and par.tensor > 1,
        flash=flash_attention(config, platform),
        offload=config.offload.activations, ffn=m_cfg.ffn, kv_heads=m_cfg.kv_heads,
        gated=family(m_cfg).gated_mlp, c=par.context, method=par.context_attention,
        moe=moe_shape(config, balanced),
        xla_gpu=platform == "gpu" and par.context == 1 and not flash_attention(config, platform),
        gpu=platform == "gpu",
        regathered=par.fsdp_size > 1 or streams,
        combined_wgrad=par.fsdp_size > 1 and par.fsdp_unit == "matmul" and platform == "gpu",
        unrolled=unrolled,
        layer_weights=e * counts["layer_params"] if e < 4 else 0.0)  # (cast: a copy)
    if spreads_head(config, platform):  # the broadcast weights (compute dtype: their
        acts["stash"] += (e + 4.0) * counts["head_params"]  # matrices), float32 sums
    gathered = pmem.fsdp_gathered_bytes(
        counts, config.optimizer.grad_reduce_dtype, m_cfg.dtype, par.fsdp_unit == "layer",
        recomputation(config) == "full", platform == "gpu", unrolled,
        head_cotangent=e * config.microbatch_size * m_cfg.seq_len // par.context
        * (counts["vocab_padded"] / par.tensor + m_cfg.hidden_size)) \
        if par.fsdp_size > 1 else None
    device, host = pmem.device_memory(
        counts=counts, activations=acts, microbatches=par.microbatches, gathered=gathered,
        unrolled_gpu=pmem.unrolled_gpu_extras(  # (FSDP's gathered, offload's fetched: cast)
            counts, e, par.pipe, m_cfg.units // par.pipe // par.chunks, par.microbatches,
            par.fsdp_size == 1 and not streams) if platform == "gpu" and unrolled else None,
        offload_optimizer=config.offload.optimizer,
        streams=streams,
        peeled=par.microbatches if config.peels_last_microbatch else 0,
        zero1_hook=config.overlaps_grad_reduce and config.optimizer.zero1
        and par.fsdp_size == 1 and par.data > 1,
        early_reduced=4.0 * counts["layer_grad_params"] * (par.chunks - 1) / par.chunks
        if config.reduces_chunks_early else 0.0,
        reduced_copy=0.0 if par.data == 1 or par.fsdp_size > 1 or config.overlaps_grad_reduce
        or (par.pipe == 1 and par.microbatches == 1) else  # ZeRO-1: this replica's part
        1.0 / par.data if config.optimizer.zero1 else 1.0)
    return device, host, acts


def device_memory_bytes(config: Config, platform: str) -> float:
    """The plan's bytes on the busiest device (the `memory/dev` total) of `platform`,
    nothing allocated: what a run compares with its devices' memory before compiling."""
    return _memory(config, real_counts(config), schedule_stats(config, platform)[1],
                   platform)[0]["total"]


def plan(config: Config, inputs: PlanInputs, counts: dict | None = None,
         simulate: bool = True) -> dict:
    """The whole report for one configuration, as a JSON-ready dict (bytes, seconds).
    counts: real_counts(config), when the caller has them (the search reuses them)."""
    m_cfg, par = config.model, config.parallel
    counts = counts or real_counts(config)
    l, h, a, s = m_cfg.num_layers, m_cfg.hidden_size, m_cfg.num_heads, m_cfg.seq_len
    V, n, B, b = counts["vocab_padded"], config.num_devices, config.train.global_batch, \
        config.microbatch_size
    bubble, slots, stats = schedule_stats(config, inputs.platform, simulate)
    hw = inputs.hardware
    device, host, acts = _memory(config, counts, slots, inputs.platform)
    flops = {"recompute": flops_per_iteration(m_cfg, B, V, "full"),
             "no_recompute": flops_per_iteration(m_cfg, B, V)}
    executed = executed_flops(config, V)
    comm, time, context, kernels = _time(config, inputs, counts, host, executed, bubble, simulate)
    moe = _moe(config, inputs, counts, slots, device, comm, time)
    per_node = min(n, hw.gpus_per_node)
    sp = par.sequence_parallel and par.tensor > 1
    report = {
        "params_model": counts["params_model"],
        "params_formula": pm.params_formula(l, h, m_cfg.vocab_size, s),
        "params_difference": counts["params_model"] - pm.params_formula(l, h, m_cfg.vocab_size, s),
        "num_devices": n, "layout": {"data": par.data, "pipe": par.pipe, "tensor": par.tensor,
                                     "context": par.context, "expert": par.expert,
                                     "context_attention": par.context_attention,
                                     "chunks": par.chunks, "microbatches": par.microbatches,
                                     "microbatch_size": b, "schedule": par.schedule},
        "options": options(config),
        "flops_per_iteration": executed, "flops_recompute": flops["recompute"],
        "flops_no_recompute": flops["no_recompute"],
        "memory_bytes_per_device": device, "memory_fits": device["total"] <= hw.usable,
        "host_memory_bytes_per_device": host,
        "host_memory_fits": host["total"] * per_node <= hw.host_memory,
        "activation_bytes_per_layer": acts["per_layer"],
        "korthikanti_activation_bytes_per_layer": pm.korthikanti_layer_bytes(
            b, s // par.context, h, a, par.tensor, sp, m_cfg.remat),
        "bubble_fraction": bubble, "pipeline_slots": slots,
        "peak_stash": max(stats[0].peak_stash) if stats else slots["stash"],
        "comm_bytes": comm, "step_time_s": time, "context": context, "moe": moe,
        "time_model": "kernels" if kernels else "flat", "kernels": kernels,
        "tflops_per_device_estimate": executed / n / time["total"] / 1e12,
    }
    report["fits"] = report["memory_fits"] and report["host_memory_fits"]
    if inputs.tokens:
        per_token = flops["recompute"] / (B * s)  # §5.1 counts with recomputation
        report["days_to_train"] = pt.days_to_train(inputs.tokens, per_token, n, inputs.tflops)
        report["days_to_train_eq4"] = pt.days_eq4(inputs.tokens, counts["params_model"], n,
                                                  inputs.tflops)
    return report


def _moe(config: Config, inputs: PlanInputs, counts: dict, slots: dict, device: dict,
         comm: dict, time: dict) -> dict | None:
    """A mixture of experts' part of the report (None: dense MLPs): its shape, total and
    active parameters (counts.real_counts: the real shapes), the forward FLOPs a token of
    one MoE layer's MLP (jaxptd/model/moe.py's active_mlp_flops, which the family's
    forward_flops adds to attention: from the active parameters), the expert weights'
    bytes on the device (float32 masters, gradients and moments as sharded), the rows of
    a layer (model.moe_rows), the all-to-all (bytes a microbatch, seconds a step, the
    link; not overlapped: timing.step_time), and the imbalance headroom: what the plan's
    device bytes (the layer's rows as allocated, for the worst routing) take over those
    of balanced routing, and whether balanced routing would fit."""
    from jaxptd.model.moe import active_mlp_flops  # JAX on use: --verify configures it first
    moe = moe_shape(config)
    if moe is None:
        return None
    m_cfg, par, hw = config.model, config.parallel, inputs.hardware
    balanced = _memory(config, counts, slots, inputs.platform, balanced=True)[0]["total"]
    tokens = config.microbatch_size * m_cfg.seq_len / par.context
    return {"experts": moe.experts, "top_k": moe.top_k, "every": moe.every,
            "expert_ffn": moe.ffn,
            "shared_ffn": moe.shared_ffn, "ranks": par.expert,
            "experts_per_rank": moe.experts // par.expert, "capacity": moe.capacity,
            "params_total": counts["params_model"], "params_active": counts["params_active"],
            "params_experts": counts["params_experts"],
            "mlp_flops_per_token": active_mlp_flops(m_cfg,
                                                    6 if family(m_cfg).gated_mlp else 4),
            "expert_weight_bytes": 8.0 * counts["expert_weight_params"]
            + 4.0 * counts["expert_moment_params"],
            "rows": moe_rows(tokens, moe),
            "all_to_all_per_microbatch": comm["expert_per_microbatch"],
            "all_to_all_message": comm["expert_message"], "all_to_all_s": time["expert"],
            "link": "intra" if par.expert * par.context * par.tensor <= hw.gpus_per_node
            else "inter", "overlapped": False,
            "balanced_bytes": balanced, "imbalance_headroom": device["total"] - balanced,
            "balanced_fits": balanced <= hw.usable}


def executed_flops(config: Config, vocab: int) -> float:
    """The iteration's matmul FLOPs as executed: equation (3) with what the step
    recomputes (recomputation), and with the ring (parallel.context > 1) its attention
    cores at timing.context_core_fraction of the model count, 3.5 times the forward's:
    the forward's 2 matmuls a block part (S = QK^T, PV) and its flash backward's 5
    (S again, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), XLA's blocks and Pallas's
    alike; and model.remat's: a layer's forward again with full or minimal (the ring's
    residuals are no matmul outputs), none with selective (which leaves the ring alone).
    allgather computes every score: equation (3)'s count."""
    from jaxptd.model import get  # JAX on use: --verify configures it first
    m_cfg, par = config.model, config.parallel
    B, remat = config.train.global_batch, recomputation(config)
    executed = flops_per_iteration(m_cfg, B, vocab, remat)
    if par.context == 1 or par.context_attention != "ring":
        return executed
    core = B * m_cfg.seq_len * m_cfg.num_layers * get(m_cfg).forward_flops(m_cfg, vocab)["core"]
    counted = 3 + (remat in ("selective", "full")
                   or (remat in MINIMAL and m_cfg.attention != "cudnn"))
    ring = 3.5 + (remat in ("full", *MINIMAL))
    fraction = pt.context_core_fraction(par.context, "ring", causal(config))
    return executed + core * (ring * fraction - counted)


def fp8_flops(config: Config, vocab: int) -> float:
    """Of the iteration's executed FLOPs, those model.fp8 runs as FP8 GEMMs: the layers'
    linears (a layer's forward less its attention core and router; a dropless mixture's
    routed experts are grouped GEMMs, 16-bit), forward and both backward GEMMs, and what
    model.remat runs again of them (full: the layer's; minimal_mlp: q, k, v). 0 without
    FP8."""
    from jaxptd.model import get  # JAX on use: --verify configures it first
    m_cfg = config.model
    if m_cfg.fp8 == "none":
        return 0.0
    per_token = get(m_cfg).forward_flops(m_cfg, vocab)
    linear = per_token["layer"] - per_token["core"]
    if m_cfg.moe:  # (a mean over the layers: one a unit is a mixture)
        h, width = m_cfg.hidden_size, 6 if family(m_cfg).gated_mlp else 4
        routed = 0 if m_cfg.moe_capacity else m_cfg.moe_top_k * width * h * m_cfg.expert_ffn
        linear -= (2 * h * m_cfg.moe_experts + routed) / m_cfg.unit
    again = {"full": linear, "minimal_mlp": per_token["qkv"]}.get(recomputation(config), 0)
    return config.train.global_batch * m_cfg.seq_len * m_cfg.num_layers * (3 * linear + again)


def options(config: Config) -> dict:
    """The memory-saving options a plan was made with (what --search varies)."""
    par = config.parallel
    return {"sequence_parallel": par.sequence_parallel and par.tensor > 1,
            "zero1": config.optimizer.zero1, "fsdp_group": par.fsdp_size if par.fsdp else 0,
            "offload_optimizer": config.offload.optimizer,
            "offload_activations": config.offload.activations,
            "stash": par.stash if par.pipe > 1 else "", "remat": recomputation(config)}


def _time(config: Config, inputs: PlanInputs, counts: dict, host: dict, executed: float,
          bubble: float, lowered: bool = True) -> tuple[dict, dict, dict, dict | None]:
    """(communication volumes, step time, context parallelism's terms, the kernel model's
    seconds or None) of timing.py's model for one configuration (the volumes: _comm;
    lowered: head_runs may lower the schedule, not in the search). The context ranks sit
    next to tensor's in the mesh: a context group's c t devices use the node's links when
    they fit in one; the expert ranks next to context's. Without a sustained rate
    (inputs.device_flops None) on a target with a measured GEMM ceiling the kernels and
    links are calibrated (jaxptd/plan/kernels.py, timing.link_bandwidths)."""
    from jaxptd.model import get  # JAX on use: --verify configures it first
    hw = inputs.hardware
    m_cfg, par = config.model, config.parallel
    b, s, h, c = config.microbatch_size, m_cfg.seq_len, m_cfg.hidden_size, par.context
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    again = recomputation(config) in ("full", *MINIMAL)
    comm = _comm(config, inputs, counts, host, again)
    # the head, unless spread over pipe (spreads_head), is the last stage's work: a lockstep
    # round lasts as long as the last stage's, as if every rank ran it, in head_runs' rounds
    head = 3 * config.train.global_batch * s * get(m_cfg).forward_flops(
        m_cfg, counts["vocab_padded"])["head"]
    unspread = 0 if spreads_head(config, inputs.platform) else par.pipe - 1
    kernels = _kernels(config, inputs, counts, executed, head * head_runs(
        config, inputs.platform, lowered) * (1 + unspread)) if calibrated(inputs) else None
    links = pt.link_bandwidths(hw, t=par.tensor, c=c, ep=par.expert, p=par.pipe,
                               fsdp=par.fsdp_size, d=par.data // par.fsdp_size) \
        if kernels else None
    link = "intra" if c * par.tensor <= hw.gpus_per_node else "inter"
    overlap = pt.context_overlap(
        comm=comm, c=c, method=par.context_attention,
        layers_per_stage=m_cfg.num_layers // par.pipe,
        block_flops=pt.ring_block_flops(b, s, h, par.tensor, c),
        device_flops=kernels["gemm_rate"] if kernels else inputs.device_flops,
        bandwidth=links["context"] if links else getattr(hw, link), forward_again=again)
    # FP8 GEMMs run at the target's FP8 peak: their FLOPs count at peak_bf16 / peak_fp8
    speedup = hw.peak_fp8 / hw.peak_bf16 if hw.peak_fp8 and hw.peak_bf16 else 1.0
    fp8_saved = fp8_flops(config, counts["vocab_padded"]) * (1 - 1 / speedup)
    time = pt.step_time(
        flops_device=(executed - fp8_saved + unspread * head) / config.num_devices,
        bubble=bubble, comm=comm, m=par.microbatches, v=par.chunks, p=par.pipe,
        t=par.tensor, d=par.data, fsdp_group=par.fsdp_size, gpus_per_node=hw.gpus_per_node,
        device_flops=inputs.device_flops, hbm_bytes_per_s=hw.hbm,
        weight_bytes_per_microbatch=3 * counts["compute_params"] * e,  # fwd, 2x bwd reads
        intra_bw=hw.intra, inter_bw=hw.inter, host_bw=hw.host_link, c=c,
        context_exposed_s=overlap["exposed_s"], ep=par.expert, links=links, kernels=kernels)
    context = {"ranks": c, "method": par.context_attention, "link": link, **overlap,
               "core_fraction": pt.context_core_fraction(c, par.context_attention,
                                                         causal(config)),
               "imbalance": pt.context_imbalance(c),
               "imbalance_contiguous": pt.context_imbalance(c, pairs=False)}
    return comm, time, context, kernels


def calibrated(inputs: PlanInputs) -> bool:
    """Whether the plan's time is the calibrated model's (kernels.py): no sustained rate
    given, a target with a measured GEMM ceiling and a device description."""
    hw = inputs.hardware
    return inputs.device_flops is None and bool(hw.gemm_fraction) and hw.chip is not None


def _kernels(config: Config, inputs: PlanInputs, counts: dict, executed: float,
             head: float) -> dict:
    """kernels.compute for one configuration: the executed FLOPs a device split into the
    layers' linears, their attention cores (equation 3's 4 s h a token, every score, as
    often as a layer runs forward: 3 passes' worth, 4 with full recomputation) and the
    head (`head`: the whole batch's, as often as the busiest rank runs it). A pipelined
    stage recomputed from its stashed input whose layers are checkpointed (model.remat
    full) runs each layer forward a third time: the stage's forward again in the B slot,
    then each layer's from its checkpoint (the compiled pipelined Table 1 rows: 29-30
    GEMMs a layer and microbatch, the unpipelined 23)."""
    from jaxptd.model import get  # JAX on use: --verify configures it first
    m_cfg, par, n = config.model, config.parallel, config.num_devices
    per_token = get(m_cfg).forward_flops(m_cfg, counts["vocab_padded"])
    full = recomputation(config) == "full"
    nested = full and m_cfg.remat == "full" and par.pipe > 1 and par.stash == "inputs"
    tokens = config.train.global_batch * m_cfg.seq_len
    core = tokens * m_cfg.num_layers * per_token["core"] * (3 + full + nested)
    head_once = 3 * tokens * per_token["head"]
    linear = executed - tokens * m_cfg.num_layers * per_token["core"] * (3 + full) - head_once \
        + nested * tokens * m_cfg.num_layers * (per_token["layer"] - per_token["core"])
    return pk.compute(
        hw=inputs.hardware, b=config.microbatch_size, n=m_cfg.seq_len // par.context,
        s=m_cfg.seq_len, h=m_cfg.hidden_size, heads=m_cfg.num_heads, kv_heads=m_cfg.kv_heads,
        ffn=m_cfg.ffn, t=par.tensor, sp=par.sequence_parallel and par.tensor > 1,
        gated=family(m_cfg).gated_mlp, flash=flash_attention(config, inputs.platform),
        forwards=1 + full + nested, e=pm.DTYPE_BYTES[m_cfg.dtype],
        elementwise_again=recomputation(config) in MINIMAL,
        flops={"linear": linear / n, "core": core / n, "head": head / n},
        layer_microbatches=m_cfg.num_layers // par.pipe * par.microbatches,
        vocab_local=counts["vocab_padded"] / par.tensor, params=counts["weight_params"] / (
            par.data if config.optimizer.zero1 and par.fsdp_size == 1 else 1),
        fp8_flops=fp8_flops(config, counts["vocab_padded"]) / n,
        rounds_bytes=_rounds_bytes(config, inputs.platform, counts))


def _rounds_bytes(config: Config, platform: str, counts: dict) -> float:
    """What a pipelined rank's executor moves outside GEMMs a step (kernels.executor_bytes
    a round, m v rounds that run an F and a B; 0 unpipelined): a stash slot holds the
    chunk's input and, with parallel.stash=activations, its output, each layer's kept
    values and a zero-bubble F's tape (less what the B's slot leaves to it), copied out
    for the B's and W's operands unless recomputed beside no tape (BENCHMARKS.md)."""
    m_cfg, par = config.model, config.parallel
    if par.pipe == 1:
        return 0.0
    e, sp = pm.DTYPE_BYTES[m_cfg.dtype], par.sequence_parallel and par.tensor > 1
    b, n, h, t = config.microbatch_size, m_cfg.seq_len // par.context, m_cfg.hidden_size, par.tensor
    remat, activations = recomputation(config), par.stash == "activations"
    kept = pm.layer_activation_bytes(
        b, m_cfg.seq_len, h, m_cfg.num_heads, t, e, sp, flash_attention(config, platform),
        remat, ffn=m_cfg.ffn, kv_heads=m_cfg.kv_heads, gated=family(m_cfg).gated_mlp,
        c=par.context, method=par.context_attention, moe=moe_shape(config))
    tape = pb.dense_input_bytes(b, n, h, t, e, sp) - pb.taped_not_in_slot(
        remat, b, n, h, t, e, sp) if par.schedule in schedules.ZERO_BUBBLE else 0.0
    stage_in, layers = b * n * h * e / (t if sp else 1), m_cfg.num_layers // par.pipe // par.chunks
    copied = layers * ((0.0 if remat in ("full", *MINIMAL) and not tape else kept) + tape) \
        if activations else 0.0
    return par.microbatches * par.chunks * pk.executor_bytes(
        chunk_params=counts["stage_params"] / par.chunks, chunks=par.chunks,
        stash_slot=stage_in + (layers * (kept + tape) + stage_in if activations else 0),
        copied=copied, head_params=0 if spreads_head(config, platform) else counts["head_params"])


def _comm(config: Config, inputs: PlanInputs, counts: dict, host: dict,
          again: bool) -> dict:
    """timing.comm_volumes of one configuration (again: the backward runs the layers'
    forward again). A mixture of experts' gradients are all-reduced over the data and
    context ranks that hold the same experts (replicas / parallel.expert), the rest over
    all replicas; its all-to-all moves the routed rows (capacity: the buffer's)."""
    m_cfg, par = config.model, config.parallel
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    gather = pm.DTYPE_BYTES[config.optimizer.grad_reduce_dtype]
    b, s, h, c = config.microbatch_size, m_cfg.seq_len, m_cfg.hidden_size, par.context
    layers = m_cfg.num_layers // par.pipe
    moe = moe_shape(config)
    replicas = par.data // par.fsdp_size * c  # the context ranks hold the same parameters
    return pt.comm_volumes(
        b=b, s=s, h=h, t=par.tensor, e=e,
        layers_per_stage=layers, grad_bytes=4 * counts["weight_params"],
        replicas=replicas, fsdp_group=par.fsdp_size,
        expert_grad_bytes=4 * counts["expert_weight_params"],
        expert_replicas=replicas // par.expert,
        moe=pt.moe_volumes(rows=moe_rows(b * s / c, moe)["balanced"],
                           h=h, e=e, ep=par.expert, layers_per_stage=layers // moe.every,
                           forward_again=again) if moe else None,
        stage_params=counts["stage_params"], gather_bytes=gather, fp8_gathered=counts[
            "fp8_gathered_params"], host_per_step=_host_traffic(config, host),
        tied_grad_bytes=counts["tied_params"] * gather * (par.schedule not in schedules.V_SHAPED),
        host_per_microbatch=2 * host["activations"], c=c,
        context=pt.context_volumes(b=b, s=s, h=h, a=m_cfg.num_heads, t=par.tensor, e=e, c=c,
                                   kv_heads=m_cfg.kv_heads, layers_per_stage=layers,
                                   method=par.context_attention, forward_again=again),
        head=pt.head_volumes(b=b, s=s / c, h=h, e=e, p=par.pipe, t=par.tensor,
                             sp=par.sequence_parallel and par.tensor > 1,
                             head_params=counts["head_params"])
        if spreads_head(config, inputs.platform) else None,
        forward_again=recomputation(config) == "full")


def _host_traffic(config: Config, host: dict) -> float:
    """Bytes a device moves over its host link a step for offload.optimizer (not the
    layer inputs: timing.py counts those per microbatch): the update reads the masters
    and moments and writes them back, reads the gradients twice (the norm, then the
    update); unpipelined the backward writes the gradients and each layer's masters are
    fetched for its forward and again for its backward."""
    fetches = 2 * config.parallel.microbatches if config.parallel.pipe == 1 else 0
    return (2 + fetches) * host["weights"] + 2 * host["optimizer"] + 3 * host["gradients"]
