"""`python -m jaxptd.plan`: plan a PTD-P run before it runs, and check the plan against XLA.

Owns the planner's CLI and the plan itself. The formulas live in jaxptd/plan_model.py
(memory) and jaxptd/plan_time.py (time), the search in jaxptd/plan_search.py, the text and
pictures in jaxptd/plan_report.py (none of them imports JAX). This module adds what needs
the real model: its parameter count and per-device shards from `jax.eval_shape` of the
initialiser and the logical sharding rules (no mesh, no memory, so a 3072-GPU config plans
on a laptop), the schedule's bubble and buffers from the simulator and the lowering, and
`--verify`, which compiles (never runs) the real training step on simulated CPU devices
and prints XLA's memory and cost analyses beside the plan. Only --verify builds a mesh; it
sets the CPU device count before the JAX backend starts.

Device memory is --memory-gb per device, host memory --host-memory-gb per node shared by
--gpus-per-node devices (offloading puts optimizer state and layer inputs there); a plan
fits when both do. `device_memory_bytes` is the one place a run's pre-flight check gets
the per-device total from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from functools import lru_cache, partial

from jaxptd import plan_model as pm
from jaxptd import plan_report, plan_search
from jaxptd import plan_time as pt
from jaxptd.config import Config, ConfigError, load_config
from jaxptd.metrics import flops_per_iteration
from jaxptd.pipeline import schedules
from jaxptd.pipeline.lowering import lower
from jaxptd.pipeline.simulate import simulate as simulate_schedule
from jaxptd.target import TARGETS, Target

GB = 1e9
MAX_VERIFY_DEVICES = 1024
SIMULATE_LIMIT = 200_000  # ranks x actions above which the bubble comes from the formula
LOWER_LIMIT = 4096  # p m v above which the buffer slots come from the formula


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxptd.plan", description=__doc__)
    parser.add_argument("--config", help="YAML file (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="memory bars and schedule timeline")
    parser.add_argument("--tokens", type=float, help="tokens to train on (e.g. 300e9)")
    parser.add_argument("--tflops", type=float, help="achieved TFLOP/s per device (Table 1)")
    parser.add_argument("--target", choices=[n for n, t in TARGETS.items() if t.memory],
                        help="the hardware (jaxptd/target.py): the defaults of the numbers "
                             "below, and what --verify compiles for (a GPU: XLA's GPU "
                             "compiler, no GPU needed). Default: runtime.target, or a100 "
                             "(the PTD-P paper's) when that is auto")
    parser.add_argument("--memory-gb", type=float,
                        help="usable device memory per device (default: the target's)")
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory per node, shared by its --gpus-per-node devices "
                             "(default: the target's node; DGX A100: 1024)")
    parser.add_argument("--device-tflops", type=float,
                        help="sustained matmul TFLOP/s per device for the time model "
                             "(default: half the target's dense bf16 peak)")
    parser.add_argument("--hbm-gbs", type=float, help="device memory GB/s")
    parser.add_argument("--intra-gbs", type=float,
                        help="intra-node GB/s per direction (NVLink)")
    parser.add_argument("--inter-gbs", type=float,
                        help="inter-node GB/s per GPU (InfiniBand)")
    parser.add_argument("--host-gbs", type=float,
                        help="host <-> device GB/s per device (PCIe)")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--search", type=int, metavar="N_GPUS",
                        help="rank the layouts (p, t, d, v, m, b, schedule) and memory options "
                             "(SP, ZeRO-1, FSDP/HSDP, offload) that fit on N_GPUS")
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument("--verify-top", type=int, default=3, metavar="K",
                        help="with --search, --verify and a GPU --target: compile the best K "
                             "layouts for it and say whether they fit")
    parser.add_argument("--verify", action="store_true",
                        help="compile the real step, compare: for the GPU --target without a "
                             "GPU (memory, buffers, overlap, cost), else on simulated CPU "
                             "devices")
    parser.error = _fail
    args = parser.parse_args(argv)
    positive = {"--memory-gb": args.memory_gb, "--host-memory-gb": args.host_memory_gb,
                "--host-gbs": args.host_gbs, "--device-tflops": args.device_tflops,
                "--hbm-gbs": args.hbm_gbs, "--intra-gbs": args.intra_gbs,
                "--inter-gbs": args.inter_gbs, "--gpus-per-node": args.gpus_per_node,
                "--top": args.top, "--tokens": args.tokens, "--tflops": args.tflops,
                "--search": args.search}
    for flag, value in positive.items():
        if value is not None and not 0 < value < math.inf:  # nan fails too
            _fail(f"{flag}={value}: must be a positive finite number")
    if (args.tokens is None) != (args.tflops is None):
        _fail("--tokens and --tflops go together (time to train needs both)")
    return args


def _hardware(args, config: Config) -> Target:
    """The target the plan is for, and every hardware number the flags left unset filled
    in from its record (one hardware description: jaxptd/target.py)."""
    name = args.target or (config.runtime.target if config.runtime.target in TARGETS
                           and TARGETS[config.runtime.target].memory else "a100")
    t = TARGETS[name]
    defaults = {"memory_gb": t.usable / GB, "host_memory_gb": t.host_memory / GB,
                "device_tflops": 0.5 * t.peak_bf16 / 1e12, "hbm_gbs": t.hbm / GB,
                "intra_gbs": t.intra / GB, "inter_gbs": t.inter / GB,
                "host_gbs": t.host_link / GB, "gpus_per_node": t.gpus_per_node}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.target = name
    return t


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@lru_cache(maxsize=16)
def _abstract_model(model, vocab: int, tensor: int) -> tuple:
    """((kind, name, global shape, mesh-axis spec), ...) of the real model from
    jax.eval_shape of its initialiser, nothing allocated; kind: "layers", or which end reads
    the leaf ("first", "last", "both": a tied embedding, model.ends_readers); name: the
    leaf's own key (w_qkv, scale, ...)."""
    import jax
    from jaxptd import model as models
    from jaxptd.sharding import is_spec, specs_from_logical

    arch = models.get(model)
    params = jax.eval_shape(partial(arch.init_params, model, vocab), jax.random.key(0))
    specs = jax.tree.leaves(specs_from_logical(arch.logical_axes(model, vocab, tensor)),
                            is_leaf=is_spec)
    readers = models.ends_readers(model, vocab)
    return tuple(("layers" if path[0].key == "layers" else
                  readers[tuple(e.key for e in path)], path[-1].key, tuple(x.shape), spec)
                 for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs))


def real_counts(config: Config) -> dict:
    """Parameter counts of the real model and of the busiest device's shards (elements):
    weight_params (masters and gradients: tensor, pipe and FSDP shards), moment_params
    (the optimizer's moments, config.moments of them: Adam's mu and nu, SGD's momentum;
    also ZeRO-1's split over the data replicas), compute_params (what the forward reads:
    tensor and pipe shards), stage_params (the stage's layers of it), layer_params and
    ends_params (one layer, and the embedding, positions and final norm, tensor-local, not
    FSDP-split), and under FSDP what a gather materialises: dense_unit_params (with
    parallel.fsdp_unit=matmul the largest dense() weight of a layer, which `dense` gathers
    alone) and layer_gathered_params (the rest of a layer, gathered with it; a layer's
    unit: all of it); layer_weight_params and ends_weight_params (one
    layer's and the ends' part of weight_params: what offload.optimizer fetches and
    updates at a time); shared_ends_params (the ends both the embedding and the head
    read, a tied embedding); layer_grad_params (the stage's reduced layer
    gradients, split like a moment), tied_params (pipelined: the ends both the first and
    the last stage read, a tied embedding, whose gradients those two exchange). Layers are
    split over pipe whether or not a leaf's layout names 'stages'; FSDP and ZeRO-1 pick a
    dimension past the layer one (sharding.py's rule)."""
    from jaxptd.mesh import DATA, FSDP, TENSOR

    par, model = config.parallel, config.model
    vocab = model.padded_vocab(par.tensor)
    g = par.fsdp_size
    replicas = par.data // g
    sizes = {TENSOR: par.tensor, FSDP: g, DATA: replicas}
    totals = dict.fromkeys(("weight_params", "moment_params", "compute_params",
                            "stage_params", "layer_params", "ends_params", "dense_unit_params",
                            "layer_gathered_params", "layer_weight_params",
                            "ends_weight_params", "shared_ends_params", "layer_grad_params",
                            "tied_params"), 0.0)
    leaves = _abstract_model(model, vocab, par.tensor)

    def split(spec) -> int:
        return math.prod(sizes.get(a, 1) for e in spec if e
                         for a in (e if isinstance(e, tuple) else (e,)))

    for kind, name, shape, spec in leaves:
        for key, count in _leaf_counts(config, kind, name, shape, spec, split).items():
            totals[key] = max(totals[key], count) if key == "dense_unit_params" \
                else totals[key] + count
    return {**totals, "params_model": sum(math.prod(shape) for _, _, shape, _ in leaves),
            "vocab_padded": vocab}


def _leaf_counts(config: Config, kind: str, name: str, shape: tuple, spec, split) -> dict:
    """One parameter leaf's part of real_counts' totals (dense_unit_params: its own size,
    which real_counts takes the largest of). split(spec): the devices a spec splits it
    over."""
    from jaxptd.model.layers import DENSE
    from jaxptd.sharding import fsdp_spec, zero1_spec

    par, model = config.parallel, config.model
    g, replicas = par.fsdp_size, par.data // par.fsdp_size
    is_layer = kind == "layers"
    skip, per_pipe = (1, par.pipe) if is_layer else (0, 1)
    sharded = fsdp_spec(spec, shape, g, skip)
    moments = zero1_spec(sharded, shape, replicas, skip) if config.optimizer.zero1 else sharded
    size = math.prod(shape)
    tensor_local = size / split(spec)
    weights = size / split(sharded) / per_pipe
    moment = size / split(moments) / per_pipe  # one moment (or reduced gradient) of it
    counts = {"weight_params": weights, "moment_params": config.moments * moment,
              "compute_params": tensor_local / per_pipe}
    if not is_layer:
        both = tensor_local if kind == "both" else 0
        return {**counts, "ends_params": tensor_local, "ends_weight_params": weights,
                "shared_ends_params": both, "tied_params": both if par.pipe > 1 else 0}
    one = tensor_local / model.num_layers
    gathered = sharded != spec  # FSDP splits it: a gather brings it whole
    by_matmul = par.fsdp_unit == "matmul"  # else the layer is gathered whole
    return {**counts, "layer_grad_params": moment, "stage_params": tensor_local / par.pipe,
            "layer_params": one, "layer_weight_params": weights * par.pipe / model.num_layers,
            "dense_unit_params": one if name in DENSE and gathered and by_matmul else 0.0,
            "layer_gathered_params": one if gathered and not (name in DENSE and by_matmul)
            else 0.0}


def recomputation(config: Config) -> str:
    """What a step recomputes in its backward pass: "full" with model.remat=full, with
    offload.activations (a layer keeps only its input, in host memory) or when a pipelined
    stage is recomputed from its stashed input (parallel.stash=inputs; a selective
    recomputation inside that one is not counted again), else model.remat."""
    if config.offload.activations or (config.parallel.pipe > 1
                                      and config.parallel.stash == "inputs"):
        return "full"
    return config.model.remat


@lru_cache(maxsize=64)
def _lowered_slots(kind: str, p: int, m: int, v: int) -> dict:
    rounds = lower(schedules.make_schedule(kind, p, m, v))
    return {"stash": rounds.num_stash_slots, "grad": rounds.num_grad_slots,
            "w": rounds.num_w_slots}


def schedule_stats(config: Config, simulate: bool = True):
    """(bubble fraction, buffer slots {stash, grad, w}, (Stats, Schedule) or None).

    The bubble comes from the simulator when asked and small enough, else from the
    formula. The slots are the executor's (the schedule lowered) when it is small, or
    when an interleaved m is not a multiple of p; else plan_model.slots_formula."""
    par = config.parallel
    if par.pipe == 1:
        return 0.0, {"stash": 0, "grad": 0, "w": 0}, None
    p, v, m, kind = par.pipe, par.chunks, par.microbatches, par.schedule
    irregular = v > 1 and m % p != 0
    slots = _lowered_slots(kind, p, m, v) if (simulate and p * m * v <= LOWER_LIMIT) \
        or irregular else pm.slots_formula(kind, p, m, v)
    if not simulate or p * p * m * v * 3 > SIMULATE_LIMIT:
        return pt.bubble_formula(p, v, m, kind in schedules.ZERO_BUBBLE), slots, None
    sched = schedules.make_schedule(kind, p, m, v)
    stats = simulate_schedule(sched)
    return stats.bubble_fraction, slots, (stats, sched)


def _memory(config: Config, counts: dict, slots: dict, platform: str
            ) -> tuple[dict, dict, dict]:
    """(device bytes, host bytes, activation terms) on the busiest device of `platform`
    ("gpu": model.attention=cudnn is flash attention; "cpu": the XLA path)."""
    from jaxptd import model as models
    m_cfg, par = config.model, config.parallel
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    acts = pm.activation_memory(
        b=config.microbatch_size, s=m_cfg.seq_len, h=m_cfg.hidden_size, a=m_cfg.num_heads,
        t=par.tensor, e=e, layers_per_stage=m_cfg.num_layers // par.pipe,
        vocab_local=counts["vocab_padded"] / par.tensor, remat=m_cfg.remat, pipe=par.pipe,
        slots=slots, chunks=par.chunks, keep_activations=par.stash == "activations",
        sp=par.sequence_parallel and par.tensor > 1,
        flash=m_cfg.attention == "cudnn" and platform == "gpu",
        offload=config.offload.activations, ffn=m_cfg.ffn, kv_heads=m_cfg.kv_heads,
        gated=models.get(m_cfg).GATED_MLP)
    gathered = pm.fsdp_gathered_bytes(counts, config.optimizer.grad_reduce_dtype,
                                      m_cfg.dtype, par.fsdp_unit == "layer",
                                      recomputation(config) == "full") \
        if par.fsdp_size > 1 else None
    device, host = pm.device_memory(
        counts=counts, activations=acts, microbatches=par.microbatches, gathered=gathered,
        offload_optimizer=config.offload.optimizer,
        streams=config.offload.optimizer and par.pipe == 1,
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
    return _memory(config, real_counts(config), schedule_stats(config)[1], platform)[0]["total"]


def plan(config: Config, args, counts: dict | None = None, simulate: bool = True) -> dict:
    """The whole report for one configuration, as a JSON-ready dict (bytes, seconds)."""
    m_cfg, par = config.model, config.parallel
    counts = counts or real_counts(config)
    l, h, a, s = m_cfg.num_layers, m_cfg.hidden_size, m_cfg.num_heads, m_cfg.seq_len
    V, n, B, b = counts["vocab_padded"], config.num_devices, config.train.global_batch, \
        config.microbatch_size
    bubble, slots, stats = schedule_stats(config, simulate)
    device, host, acts = _memory(config, counts, slots, args.platform)
    flops = {"recompute": flops_per_iteration(m_cfg, B, V, "full"),
             "no_recompute": flops_per_iteration(m_cfg, B, V)}
    executed = flops_per_iteration(m_cfg, B, V, recomputation(config))
    comm, time = _time(config, args, counts, device, host, executed, bubble)
    per_node = min(n, args.gpus_per_node)
    sp = par.sequence_parallel and par.tensor > 1
    report = {
        "params_model": counts["params_model"],
        "params_formula": pm.params_formula(l, h, m_cfg.vocab_size, s),
        "params_difference": counts["params_model"] - pm.params_formula(l, h, m_cfg.vocab_size, s),
        "num_devices": n, "layout": {"data": par.data, "pipe": par.pipe, "tensor": par.tensor,
                                     "chunks": par.chunks, "microbatches": par.microbatches,
                                     "microbatch_size": b, "schedule": par.schedule},
        "options": options(config),
        "flops_per_iteration": executed, "flops_recompute": flops["recompute"],
        "flops_no_recompute": flops["no_recompute"],
        "memory_bytes_per_device": device, "memory_fits": device["total"] <= args.memory_gb * GB,
        "host_memory_bytes_per_device": host,
        "host_memory_fits": host["total"] * per_node <= args.host_memory_gb * GB,
        "activation_bytes_per_layer": acts["per_layer"],
        "korthikanti_activation_bytes_per_layer": pm.korthikanti_layer_bytes(
            b, s, h, a, par.tensor, sp, m_cfg.remat),
        "bubble_fraction": bubble, "pipeline_slots": slots,
        "peak_stash": max(stats[0].peak_stash) if stats else slots["stash"],
        "comm_bytes": comm, "step_time_s": time,
        "tflops_per_device_estimate": executed / n / time["total"] / 1e12,
    }
    report["fits"] = report["memory_fits"] and report["host_memory_fits"]
    if args.tokens:
        per_token = flops["recompute"] / (B * s)  # §5.1 counts with recomputation
        report["days_to_train"] = pt.days_to_train(args.tokens, per_token, n, args.tflops)
        report["days_to_train_eq4"] = pt.days_eq4(args.tokens, counts["params_model"], n,
                                                  args.tflops)
    return report


def options(config: Config) -> dict:
    """The memory-saving options a plan was made with (what --search varies)."""
    par = config.parallel
    return {"sequence_parallel": par.sequence_parallel and par.tensor > 1,
            "zero1": config.optimizer.zero1, "fsdp_group": par.fsdp_size if par.fsdp else 0,
            "offload_optimizer": config.offload.optimizer,
            "offload_activations": config.offload.activations,
            "stash": par.stash if par.pipe > 1 else "", "remat": recomputation(config)}


def _time(config: Config, args, counts: dict, device: dict, host: dict, executed: float,
          bubble: float) -> tuple[dict, dict]:
    """(communication volumes, step time) of plan_time's model for one configuration."""
    m_cfg, par = config.model, config.parallel
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    gather = pm.DTYPE_BYTES[config.optimizer.grad_reduce_dtype]
    comm = pt.comm_volumes(
        b=config.microbatch_size, s=m_cfg.seq_len, h=m_cfg.hidden_size, t=par.tensor, e=e,
        layers_per_stage=m_cfg.num_layers // par.pipe, grad_bytes=4 * counts["weight_params"],
        replicas=par.data // par.fsdp_size, fsdp_group=par.fsdp_size,
        stage_params=counts["stage_params"], gather_bytes=gather,
        tied_grad_bytes=counts["tied_params"] * gather,
        host_per_step=_host_traffic(config, host),
        host_per_microbatch=2 * host["activations"])
    time = pt.step_time(
        flops_device=executed / config.num_devices, bubble=bubble, comm=comm,
        m=par.microbatches, v=par.chunks, p=par.pipe, t=par.tensor, d=par.data,
        fsdp_group=par.fsdp_size, gpus_per_node=args.gpus_per_node,
        device_flops=args.device_tflops * 1e12, hbm_bytes_per_s=args.hbm_gbs * GB,
        weight_bytes_per_microbatch=3 * counts["compute_params"] * e,  # fwd, 2x bwd reads
        intra_bw=args.intra_gbs * GB, inter_bw=args.inter_gbs * GB,
        host_bw=args.host_gbs * GB)
    return comm, time


def _host_traffic(config: Config, host: dict) -> float:
    """Bytes a device moves over its host link a step for offload.optimizer (not the
    layer inputs: plan_time counts those per microbatch): the update reads the masters
    and moments and writes them back, reads the gradients twice (the norm, then the
    update); unpipelined the backward writes the gradients and each layer's masters are
    fetched for its forward and again for its backward."""
    fetches = 2 * config.parallel.microbatches if config.parallel.pipe == 1 else 0
    return (2 + fetches) * host["weights"] + 2 * host["optimizer"] + 3 * host["gradients"]


def verify(config: Config, report: dict, dump: str | None = None) -> dict:
    """Compiles (never runs) the real step on simulated CPU devices from abstract,
    sharded arguments and puts XLA's analyses beside the plan: its memory, and with the
    step dumped into `dump` (main's _cpu_backend) the device peak, its temporaries live at
    once but for those a GPU program keeps in host memory (_in_host_memory). The backend
    must already have config.num_devices devices (main sets jax_num_cpu_devices first)."""
    import jax
    import jax.numpy as jnp
    from jaxptd import compile_check
    from jaxptd.mesh import make_mesh
    from jaxptd.step import Setup, build_train_step

    if len(jax.devices()) < config.num_devices:
        raise ConfigError(f"--verify needs {config.num_devices} devices, the backend has "
                          f"{len(jax.devices())}")
    mesh = make_mesh(config.parallel, jax.devices()[: config.num_devices])
    setup = Setup(config, mesh)
    from jaxptd.model import batch_width
    batch = jax.ShapeDtypeStruct((config.train.global_batch, batch_width(config.model)),
                                 jnp.int32, sharding=setup.batch_sharding)
    try:
        compiled = build_train_step(setup).lower(setup.abstract_state(), batch).compile()
    except Exception as e:  # noqa: BLE001 -- reported, e.g. pipe > 1 before the executor
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"--verify: compiling the step failed: {type(e).__name__}: "
                          f"{first[:300]}") from None
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = {k: float(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in
           ("argument", "output", "alias", "temp", "generated_code", "host_argument",
            "host_output", "host_alias", "host_temp")}
    xla["total"] = sum(xla[k] + xla[f"host_{k}"] for k in ("argument", "output", "temp")) \
        - xla["alias"] - xla["host_alias"] + xla["generated_code"]
    arguments, device, total = _planned_on_cpu(config, report)
    peaks = compile_check.live_peaks(dump, _in_host_memory(config, setup))
    return {"xla_memory": xla, "xla_flops": float(cost.get("flops", 0.0)),
            "xla_device_peak": peaks and peaks["device"], "planned_device": device,
            "planned_arguments": arguments, "planned_temp": total - arguments,
            "planned_total": total, "memory_ratio": total / xla["total"],
            "planned_flops_loop_bodies": _loop_body_flops(config, report)}


def _in_host_memory(config: Config, setup):
    """dims -> whether the CPU program's buffer of those dimensions is one a GPU program
    keeps in host memory, by its shape: unpipelined, with offload.optimizer the stacked
    layer gradients [L, ...] (shaped like the state's layer leaves), with
    offload.activations the stacked layer inputs [L, b, s, h] ([L, b, s/t, h] with SP)."""
    import jax
    par, model = config.parallel, config.model
    grads = {tuple(leaf.sharding.shard_shape(leaf.shape))
             for leaf in jax.tree.leaves(setup.abstract_state()["params"]["layers"])}
    split = par.tensor if par.sequence_parallel else 1
    inputs = (model.num_layers, config.microbatch_size, model.seq_len // split,
              model.hidden_size)

    def in_host(dims) -> bool:
        return par.pipe == 1 and ((config.offload.optimizer and tuple(dims) in grads) or (
            config.offload.activations and tuple(dims) == inputs))
    return in_host


def _planned_on_cpu(config: Config, report: dict) -> tuple[float, float, float]:
    """(the state's bytes, the device's, all bytes) a device of the CPU program the check
    compiles holds by the plan (made for the CPU program: main's args.platform). On CPU
    the host and device memory kinds are one memory: the state is the argument wherever
    it lives, and what a GPU program keeps in host memory (offloaded layer inputs and
    gradients) are temporaries like the rest."""
    device, host = report["memory_bytes_per_device"], report["host_memory_bytes_per_device"]
    state = host if config.offload.optimizer else device
    return (state["weights"] + state["optimizer"], device["total"],
            device["total"] + host["total"])


def _loop_body_flops(config: Config, report: dict) -> float:
    """What XLA's cost analysis counts: it counts a while loop's body once, so the
    microbatch scan and the layer scan contribute one microbatch through one layer
    (forward, backward and what model.remat recomputes; Appendix) plus the logit
    layer (6 b s h V), per device. A step that reduces gradients inside the last
    microbatch's backward runs that microbatch outside the scan: two microbatches."""
    from jaxptd.model import get
    m_cfg, par = config.model, config.parallel
    tokens = config.microbatch_size * m_cfg.seq_len
    per_token = get(m_cfg).forward_flops(m_cfg, m_cfg.padded_vocab(par.tensor))
    forward, core = per_token["layer"], per_token["core"]
    layer = 3 * forward + {"none": 0, "selective": core, "full": forward}[recomputation(config)]
    bodies = 2 if config.peels_last_microbatch else 1
    return bodies * tokens * (layer + 3 * per_token["head"]) / par.tensor


def main(argv=None) -> int:
    """CLI entry: bad input -> 'error: ...' on stderr, exit 2."""
    args = _parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        named = args.target or config.runtime.target != "auto"
        target = _hardware(args, config)
        if args.verify and named and target.chip is not None:
            return _verify_gpu(config, args, target) if not args.search else \
                _search_and_compile(config, args, target)
        # what the plan is for: the target, or the CPU program --verify compiles
        args.platform = "cpu" if args.verify else target.platform
        dump = _cpu_backend(config) if args.verify else None  # before anything starts JAX
        if args.search:
            rows = plan_search.search(config, args, plan, real_counts)
            print(json.dumps(rows[: args.top]) if args.json
                  else plan_report.format_search(rows, args))
            return 0 if rows else 1
        report = plan(config, args)
        report["memory_limit_gb"] = args.memory_gb
        if args.verify:
            report["verify"] = verify(config, report, dump)
        if args.png:
            plan_report.draw(report, args.png, schedule_stats(config)[2])
    except ConfigError as e:
        _fail(str(e))
    print(json.dumps(report) if args.json else plan_report.format_report(report, args))
    return 0 if report["fits"] else 1  # scripts: 1 = the plan does not fit


def _cpu_backend(config: Config) -> str | None:
    """Starts JAX on config.num_devices simulated CPU devices for --verify, XLA dumping the
    step (its buffers' live ranges give the device peak) into a directory removed at
    exit, which it returns (None where JAX already runs: no device peak). The step is
    compiled afresh: a step from the persistent compilation cache dumps nothing."""
    import atexit
    import shutil
    import tempfile

    if config.num_devices > MAX_VERIFY_DEVICES:
        raise ConfigError(f"--verify: {config.num_devices} devices is more than "
                          f"{MAX_VERIFY_DEVICES} simulated CPU devices can compile")
    dump = None
    if "jax" not in sys.modules:
        dump = tempfile.mkdtemp(prefix="jaxptd-xla-")
        atexit.register(shutil.rmtree, dump, True)
        _start_cpu_compiler(dump)
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", config.num_devices)
    jax.config.update("jax_enable_compilation_cache", False)
    return dump


def _search_and_compile(config: Config, args, target: Target) -> int:
    """--search with --verify for a GPU target: the ranked layouts, the best --verify-top
    of them compiled for the target (no GPU), each row saying what the compiled step
    needs and whether it fits; a layout the planner let through that does not fit when
    compiled is said so (exit 1 if none of those compiled fits)."""
    from jaxptd import compile_check
    _start_cpu_compiler(None)
    args.platform = target.platform
    rows = plan_search.search(config, args, plan, real_counts)
    for row in rows[: args.verify_top]:
        candidate = load_config(args.config, [*args.overrides, *row["overrides"],
                                              f"runtime.target={target.name}"])
        compiled, seconds = compile_check.compile_step(candidate, target, args.gpus_per_node)
        report = compile_check.analyse(candidate, compiled, target, seconds)
        row["compiled"] = {k: report[k] for k in ("fits", "margin_bytes", "compile_s")}
        row["compiled"].update(gb=report["memory"]["total"] / GB,
                               mfu_ceiling=report["cost"]["mfu_ceiling"])
    print(json.dumps(rows[: args.top]) if args.json else plan_report.format_search(rows, args))
    checked = [r["compiled"]["fits"] for r in rows[: args.verify_top]]
    return 0 if any(checked) else 1


def _start_cpu_compiler(dump: str | None) -> None:
    """Before JAX starts: CPU devices only (the GPU ones are XLA's topology devices), and
    XLA told where to dump the step's memory report (`dump`, None: nowhere)."""
    import os
    if "jax" in sys.modules:
        return
    if dump:
        from jaxptd import compile_check
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                            compile_check.dump_flags(dump)])
    os.environ["JAX_PLATFORMS"] = "cpu"


def _verify_gpu(config: Config, args, target: Target) -> int:
    """--verify for a GPU target: the step compiled for it without one (compile_check)."""
    import tempfile
    from jaxptd import compile_check

    # XLA dumps the step's memory report where the process tells it, at start (a process
    # whose JAX already runs: nowhere, and no largest buffers)
    dump = None if "jax" in sys.modules else tempfile.mkdtemp(prefix="jaxptd-xla-")
    _start_cpu_compiler(dump)
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime,
                                                                     target=target.name))
    args.platform = target.platform
    planned = plan(config, args)
    compiled, seconds = compile_check.compile_step(config, target, args.gpus_per_node)
    # XLA's topology devices have no host memory: what a run offloads to the host is
    # compiled into device memory, so the compiled total is the plan's device + host
    offloads = config.offload.optimizer or config.offload.activations
    expected = planned["memory_bytes_per_device"]["total"] + (
        planned["host_memory_bytes_per_device"]["total"] if offloads else 0.0)
    report = compile_check.analyse(config, compiled, target, seconds, expected, dump)
    report["offloaded_state_on_device"] = offloads
    report["plan"] = planned
    print(json.dumps(report) if args.json else compile_check.format_report(report))
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
