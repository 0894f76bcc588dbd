"""`python -m jaxptd.plan`: plan a PTD-P run before it runs, and check the plan against XLA.

Owns the planner's CLI and report. The formulas live in jaxptd/plan_model.py (no JAX);
this module adds what needs the real model: its parameter count and per-device shards
from `jax.eval_shape` of the initialiser and the logical sharding rules (no mesh, no
memory, so a 3072-GPU config plans on a laptop), the schedule's bubble and stash from
the simulator, the search over layouts, and `--verify`, which compiles (never runs) the
real training step on simulated CPU devices and prints XLA's memory and cost analyses
beside the plan. Only --verify builds a mesh; it sets the CPU device count before the
JAX backend starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from functools import partial

from jaxptd import plan_model as pm
from jaxptd.config import Config, ConfigError, load_config, validate
from jaxptd.metrics import flops_per_iteration
from jaxptd.pipeline import schedules
from jaxptd.pipeline.simulate import simulate as simulate_schedule

GB = 1e9
MAX_VERIFY_DEVICES = 1024
SIMULATE_LIMIT = 200_000  # ranks x actions above which the bubble comes from the formula


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxptd.plan", description=__doc__)
    parser.add_argument("--config", help="YAML file (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="memory bars and schedule timeline")
    parser.add_argument("--tokens", type=float, help="tokens to train on (e.g. 300e9)")
    parser.add_argument("--tflops", type=float, help="achieved TFLOP/s per device (Table 1)")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="device memory")
    parser.add_argument("--device-tflops", type=float, default=156.0,
                        help="sustained matmul TFLOP/s per device for the time model "
                             "(default: half an A100's 312 bf16 peak)")
    parser.add_argument("--hbm-gbs", type=float, default=2000.0, help="device memory GB/s")
    parser.add_argument("--intra-gbs", type=float, default=300.0,
                        help="intra-node GB/s per direction (NVLink)")
    parser.add_argument("--inter-gbs", type=float, default=25.0,
                        help="inter-node GB/s per GPU (InfiniBand HDR)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--search", type=int, metavar="N_GPUS",
                        help="rank the layouts (p, t, d, v, m, b) that fit on N_GPUS")
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument("--verify", action="store_true",
                        help="compile the real step on simulated CPU devices, compare")
    parser.error = _fail
    args = parser.parse_args(argv)
    positive = {"--memory-gb": args.memory_gb, "--device-tflops": args.device_tflops,
                "--hbm-gbs": args.hbm_gbs, "--intra-gbs": args.intra_gbs,
                "--inter-gbs": args.inter_gbs, "--gpus-per-node": args.gpus_per_node,
                "--top": args.top, "--tokens": args.tokens, "--tflops": args.tflops,
                "--search": args.search}
    for flag, value in positive.items():
        if value is not None and value <= 0:
            _fail(f"{flag}={value}: must be positive")
    if (args.tokens is None) != (args.tflops is None):
        _fail("--tokens and --tflops go together (time to train needs both)")
    return args


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def real_counts(config: Config) -> dict:
    """The real model's parameters (eval_shape, nothing allocated) and the busiest
    device's shards: float32 weights and optimizer moments, by the sharding rules."""
    import jax
    from jaxptd.mesh import DATA, PIPE, TENSOR
    from jaxptd import model as models
    from jaxptd.sharding import is_spec, specs_from_logical, zero1_spec

    par = config.parallel
    vocab = config.model.padded_vocab(par.tensor)
    arch = models.get(config.model)
    params = jax.eval_shape(partial(arch.init_params, config.model, vocab), jax.random.key(0))
    specs = specs_from_logical(arch.logical_axes(config.model, vocab, par.tensor))
    sizes = {DATA: par.data, PIPE: par.pipe, TENSOR: par.tensor}

    def local(leaf, spec, layers: bool) -> float:
        axes = [a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))]
        count = math.prod(leaf.shape) / math.prod(sizes[a] for a in axes)
        # stacked layers are split over pipe whether or not the layout names 'stages'
        return count / par.pipe if layers and PIPE not in axes else count

    flat_params = jax.tree_util.tree_leaves_with_path(params)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    is_layer = [getattr(path[0], "key", "") == "layers" for path, _ in flat_params]
    zero1 = config.optimizer.zero1
    # Adam's mu and nu mirror the parameters (optim.optimizer_specs); ZeRO-1 splits them
    moments = 2 * sum(local(x, zero1_spec(s, x.shape, par.data) if zero1 else s, lay)
                      for (_, x), s, lay in zip(flat_params, flat_specs, is_layer))
    return {
        "params_model": sum(math.prod(x.shape) for _, x in flat_params),
        "weight_params": sum(local(x, s, lay) for (_, x), s, lay
                             in zip(flat_params, flat_specs, is_layer)),
        "moment_params": moments,
        "vocab_padded": vocab,
    }


def recomputation(config: Config) -> str:
    """What a step recomputes in its backward pass: "full" with model.remat=full or when a
    pipelined stage is recomputed from its stashed input (parallel.stash=inputs; a
    selective recomputation inside that one is not counted again), else model.remat."""
    if config.parallel.pipe > 1 and config.parallel.stash == "inputs":
        return "full"
    return config.model.remat


def schedule_stats(config: Config, simulate: bool = True):
    """(bubble fraction, peak stash, (Stats, Schedule) or None): from the simulator when
    asked and small enough, else the formula's bubble and the lockstep schedule's stash on
    rank 0 ((v - 1) p + 2p - 1, see schedules.make_schedule; one more for zb-interleaved).
    The stash counts a microbatch-stage from its input's arrival to its last backward piece
    (for zero-bubble kinds its W), each slot priced as a non-split one."""
    par = config.parallel
    if par.pipe == 1:
        return 0.0, 0, None
    p, v, m = par.pipe, par.chunks, par.microbatches
    zero_bubble = par.schedule in schedules.ZERO_BUBBLE
    if not simulate or p * p * m * v * 3 > SIMULATE_LIMIT:
        stash = min(m * v, (v - 1) * p + 2 * p - 1 + (zero_bubble and v > 1))
        return pm.bubble_formula(p, v, m, zero_bubble), stash, None
    sched = schedules.make_schedule(par.schedule, par.pipe, par.microbatches, par.chunks)
    stats = simulate_schedule(sched)
    return stats.bubble_fraction, max(stats.peak_stash), (stats, sched)


def _memory(config: Config, counts: dict, peak_stash: int) -> tuple[dict, dict]:
    """(bytes by kind, activation terms) on the busiest device."""
    m_cfg, par = config.model, config.parallel
    acts = pm.activation_memory(
        b=config.microbatch_size, s=m_cfg.seq_len, h=m_cfg.hidden_size, a=m_cfg.num_heads,
        t=par.tensor, e=pm.DTYPE_BYTES[m_cfg.dtype],
        layers_per_stage=m_cfg.num_layers // par.pipe,
        vocab_local=counts["vocab_padded"] / par.tensor, remat=m_cfg.remat, pipe=par.pipe,
        peak_stash=peak_stash, chunks=par.chunks,
        keep_activations=par.stash == "activations")
    memory = pm.device_memory(weight_params=counts["weight_params"],
                              moment_params=counts["moment_params"], activations=acts,
                              microbatches=par.microbatches)
    return memory, acts


def device_memory_bytes(config: Config) -> float:
    """The plan's bytes on the busiest device (the `memory/dev` total), nothing allocated:
    what a run compares with its devices' memory before compiling."""
    return _memory(config, real_counts(config), schedule_stats(config)[1])[0]["total"]


def plan(config: Config, args, counts: dict | None = None, simulate: bool = True) -> dict:
    """The whole report for one configuration, as a JSON-ready dict (bytes, seconds)."""
    m_cfg, par = config.model, config.parallel
    counts = counts or real_counts(config)
    l, h, a, s = m_cfg.num_layers, m_cfg.hidden_size, m_cfg.num_heads, m_cfg.seq_len
    V, n, B, b = counts["vocab_padded"], config.num_devices, config.train.global_batch, \
        config.microbatch_size
    e = pm.DTYPE_BYTES[m_cfg.dtype]
    bubble, peak_stash, _ = schedule_stats(config, simulate)
    per_stage = l // par.pipe
    memory, acts = _memory(config, counts, peak_stash)
    flops = {"recompute": flops_per_iteration(m_cfg, B, V, "full"),
             "no_recompute": flops_per_iteration(m_cfg, B, V)}
    executed = flops_per_iteration(m_cfg, B, V, recomputation(config))
    comm = pm.comm_volumes(b=b, s=s, h=h, t=par.tensor, d=par.data, e=e,
                           layers_per_stage=per_stage, grad_bytes=memory["gradients"])
    time = pm.step_time(
        flops_device=executed / n, bubble=bubble, comm=comm, m=par.microbatches,
        v=par.chunks, p=par.pipe, t=par.tensor, d=par.data,
        gpus_per_node=args.gpus_per_node, device_flops=args.device_tflops * 1e12,
        hbm_bytes_per_s=args.hbm_gbs * GB,
        weight_bytes_per_microbatch=3 * counts["weight_params"] * e,  # fwd, 2x bwd reads
        intra_bw=args.intra_gbs * GB, inter_bw=args.inter_gbs * GB)
    report = {
        "params_model": counts["params_model"],
        "params_formula": pm.params_formula(l, h, m_cfg.vocab_size, s),
        "params_difference": counts["params_model"] - pm.params_formula(l, h, m_cfg.vocab_size, s),
        "num_devices": n, "layout": {"data": par.data, "pipe": par.pipe, "tensor": par.tensor,
                                     "chunks": par.chunks, "microbatches": par.microbatches,
                                     "microbatch_size": b, "schedule": par.schedule},
        "flops_per_iteration": executed, "flops_recompute": flops["recompute"],
        "flops_no_recompute": flops["no_recompute"],
        "memory_bytes_per_device": memory, "memory_fits": memory["total"] <= args.memory_gb * GB,
        "activation_bytes_per_layer": acts["per_layer"],
        "megatron_activation_bytes_per_layer": pm.megatron_layer_activation_bytes(
            b, s, h, a, par.tensor),
        "bubble_fraction": bubble, "peak_stash": peak_stash,
        "comm_bytes": comm, "step_time_s": time,
        "tflops_per_device_estimate": executed / n / time["total"] / 1e12,
    }
    if args.tokens:
        per_token = flops["recompute"] / (B * s)  # §5.1 counts with recomputation
        report["days_to_train"] = pm.days_to_train(args.tokens, per_token, n, args.tflops)
        report["days_to_train_eq4"] = pm.days_eq4(args.tokens, counts["params_model"], n,
                                                  args.tflops)
    return report


def search(config: Config, args) -> list:
    """Layouts (p, t, d, v, m, b) of `config`'s model on args.search GPUs that fit in
    args.memory_gb, best estimated throughput first. Takeaway #1: t is a power of two up
    to the GPUs per node; pipeline across nodes (p divides l); Takeaway #2: the rest is
    data; Takeaway #3: every microbatch size b dividing B / d is tried with the time model.
    """
    n, model, B = args.search, config.model, config.train.global_batch
    counts_by_tp, rows = {}, []
    tensors = [t for t in pm.divisors(args.gpus_per_node) if t & (t - 1) == 0
               and model.num_heads % t == 0 and n % t == 0]
    for t in tensors:
        for p in (p for p in pm.divisors(model.num_layers) if n % (t * p) == 0):
            d = n // (t * p)
            if B % d:
                continue
            for v in ([1] if p == 1 else [v for v in (1, 2, 4) if model.num_layers % (p * v) == 0]):
                for b in pm.divisors(B // d):
                    row = _try_layout(config, args, counts_by_tp, p, t, d, v, B // (d * b))
                    if row:
                        rows.append(row)
    return sorted(rows, key=lambda r: -r["tflops_per_device_estimate"])


def _try_layout(config: Config, args, counts_by_tp: dict, p, t, d, v, m):
    """The plan of one layout as a search row, or None when it does not fit."""
    parallel = dataclasses.replace(config.parallel, data=d, pipe=p, tensor=t, chunks=v,
                                   microbatches=m, schedule="interleaved" if v > 1 else "1f1b")
    candidate = dataclasses.replace(config, parallel=parallel,
                                    runtime=dataclasses.replace(config.runtime, cpu_devices=0))
    try:
        validate(candidate)
    except ConfigError:
        return None
    key = (p, t, d)
    if key not in counts_by_tp:
        counts_by_tp[key] = real_counts(candidate)
    report = plan(candidate, args, counts_by_tp[key], simulate=False)
    if not report["memory_fits"]:
        return None
    return {**report["layout"], "memory_gb": report["memory_bytes_per_device"]["total"] / GB,
            "bubble_fraction": report["bubble_fraction"],
            "step_time_s": report["step_time_s"]["total"],
            "tflops_per_device_estimate": report["tflops_per_device_estimate"]}



def verify(config: Config, report: dict) -> dict:
    """Compiles (never runs) the real step on simulated CPU devices from abstract,
    sharded arguments and puts XLA's analyses beside the plan. The backend must already
    have config.num_devices devices (main sets jax_num_cpu_devices first)."""
    import jax
    import jax.numpy as jnp
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
    xla = {k: float(getattr(mem, f"{k}_size_in_bytes")) for k in
           ("argument", "output", "alias", "temp", "generated_code")}
    xla["total"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"] + \
        xla["generated_code"]
    planned = report["memory_bytes_per_device"]
    return {"xla_memory": xla, "xla_flops": float(cost.get("flops", 0.0)),
            "planned_arguments": planned["weights"] + planned["optimizer"],
            "planned_temp": planned["total"] - planned["weights"] - planned["optimizer"],
            "memory_ratio": planned["total"] / xla["total"],
            "planned_flops_loop_bodies": _loop_body_flops(config, report)}


def _loop_body_flops(config: Config, report: dict) -> float:
    """What XLA's cost analysis counts: it counts a while loop's body once, so the
    microbatch scan and the layer scan contribute one microbatch through one layer
    (forward, backward and what model.remat recomputes; Appendix) plus the logit
    layer (6 b s h V), per device."""
    from jaxptd.model import get
    m_cfg, par = config.model, config.parallel
    tokens = config.microbatch_size * m_cfg.seq_len
    per_token = get(m_cfg).forward_flops(m_cfg, m_cfg.padded_vocab(par.tensor))
    forward, core = per_token["layer"], per_token["core"]
    layer = 3 * forward + {"none": 0, "selective": core, "full": forward}[m_cfg.remat]
    return tokens * (layer + 3 * per_token["head"]) / par.tensor


def format_report(r: dict, args) -> str:
    """The human-readable plan: one section per question, bytes in GB (1e9)."""
    lay, mem, comm, t = r["layout"], r["memory_bytes_per_device"], r["comm_bytes"], \
        r["step_time_s"]
    lines = [
        f"layout      (p, t, d) = ({lay['pipe']}, {lay['tensor']}, {lay['data']}) on "
        f"{r['num_devices']} devices; v={lay['chunks']} m={lay['microbatches']} "
        f"b={lay['microbatch_size']} schedule={lay['schedule']}",
        f"parameters  model {r['params_model'] / 1e9:.4f} B   eq. (2) "
        f"{r['params_formula'] / 1e9:.4f} B   difference {r['params_difference']:+,.0f} "
        "(ours adds the final LayerNorm 2h and pads V to 128 x tensor; eq. (2) already "
        "counts tied embeddings, learned positions and biases)",
        f"FLOPs/iter  {r['flops_per_iteration']:.4g} executed   eq. (3) with recompute "
        f"{r['flops_recompute']:.4g}, without {r['flops_no_recompute']:.4g}",
        f"memory/dev  ({args.memory_gb:g} GB: {'fits' if r['memory_fits'] else 'DOES NOT FIT'})",
    ]
    for key in ("weights", "gradients", "optimizer", "activations", "stash",
                "gradient_workspace", "total"):
        note = " (included in activations)" if key == "stash" else ""
        lines.append(f"  {key:<19} {mem[key] / GB:10.3f} GB{note}")
    lines += [
        f"  activations/layer/microbatch {r['activation_bytes_per_layer'] / GB:.3f} GB "
        f"(Megatron fused 16-bit: {r['megatron_activation_bytes_per_layer'] / GB:.3f} GB)",
        f"pipeline    bubble {r['bubble_fraction']:.4f}   peak stash {r['peak_stash']} "
        "microbatches (stage inputs)",
        f"comm/dev    p2p {comm['p2p_per_microbatch'] / 1e6:.2f} MB/microbatch (b s h / t), "
        f"tensor {comm['tensor_per_microbatch'] / 1e6:.2f} MB/microbatch, "
        f"data {comm['data_per_step'] / GB:.3f} GB/step",
        f"step time   {t['total']:.3f} s = compute {t['compute']:.3f} (bubble incl.) + tensor "
        f"{t['tensor']:.3f} + p2p {t['p2p']:.3f} + data {t['data']:.3f}   ~ "
        f"{r['tflops_per_device_estimate']:.1f} TFLOP/s per device",
    ]
    if "days_to_train" in r:
        lines.append(f"train time  {r['days_to_train']:.1f} days (eq. 3)   "
                     f"{r['days_to_train_eq4']:.1f} days (eq. 4: 8 T P / (n X))")
    if "verify" in r:
        lines += _format_verify(r["verify"], mem)
    return "\n".join(lines)


def _format_verify(v: dict, mem: dict) -> list:
    x = v["xla_memory"]
    return [
        "verify      XLA compiled step (CPU, simulated devices), per device:",
        f"  arguments  XLA {x['argument'] / 1e6:10.2f} MB   plan {v['planned_arguments'] / 1e6:10.2f}"
        " MB (weights + optimizer; outputs alias the donated state)",
        f"  temp       XLA {x['temp'] / 1e6:10.2f} MB   plan {v['planned_temp'] / 1e6:10.2f}"
        " MB (gradients + workspace + activations)",
        f"  total      XLA {x['total'] / 1e6:10.2f} MB   plan {mem['total'] / 1e6:10.2f} MB"
        f"   plan / XLA = {v['memory_ratio']:.3f}",
        f"  FLOPs      XLA {v['xla_flops']:.4g}   plan {v['planned_flops_loop_bodies']:.4g}"
        " (XLA counts each loop body once: one microbatch, one layer, plus the logit layer"
        "; its count also includes elementwise ops, eq. (3) only matmuls)",
        "  why they differ: XLA CPU computes bfloat16 matmuls in float32 and may keep both "
        "copies; its buffer reuse is exact where the plan adds phases; the plan's tensor "
        "inventory is our layer's autodiff residuals, Megatron's fused kernels keep fewer",
    ]


def draw(report: dict, config: Config, path: str) -> None:
    """Memory bars and, with pipe > 1, the schedule's timeline (path-timeline.png); says
    on stderr which files it wrote (stdout keeps the report or its JSON)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"--png {path}: matplotlib is not installed "
                          "(pip install matplotlib)") from None
    mem = report["memory_bytes_per_device"]
    keys = ("weights", "gradients", "optimizer", "gradient_workspace", "activations")
    fig, ax = plt.subplots(figsize=(6, 3))
    left = 0.0
    for key in keys:
        ax.barh(0, mem[key] / GB, left=left, label=key)
        left += mem[key] / GB
    ax.axvline(report["memory_limit_gb"], color="red", linestyle="--", label="device memory")
    ax.set_yticks([])
    ax.set_xlabel("GB per device")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
        print(f"wrote {path} (memory per device)", file=sys.stderr)
        stats = schedule_stats(config)[2]
        if stats:
            from jaxptd.pipeline.draw import draw_timeline
            timeline = path.rsplit(".", 1)[0] + "-timeline.png"
            draw_timeline(stats[0], stats[1], timeline)
            print(f"wrote {timeline} (the pipeline schedule)", file=sys.stderr)
    except OSError as e:
        raise ConfigError(f"--png {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    """CLI entry: bad input -> 'error: ...' on stderr, exit 2."""
    args = _parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.verify:  # before anything starts the JAX backend
            if config.num_devices > MAX_VERIFY_DEVICES:
                raise ConfigError(f"--verify: {config.num_devices} devices is more than "
                                  f"{MAX_VERIFY_DEVICES} simulated CPU devices can compile")
            import jax
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", config.num_devices)
        if args.search:
            rows = search(config, args)
            print(json.dumps(rows[: args.top]) if args.json else _format_search(rows, args))
            return 0
        report = plan(config, args)
        report["memory_limit_gb"] = args.memory_gb
        if args.verify:
            report["verify"] = verify(config, report)
        if args.png:
            draw(report, config, args.png)
    except ConfigError as e:
        _fail(str(e))
    print(json.dumps(report) if args.json else format_report(report, args))
    return 0


def _format_search(rows: list, args) -> str:
    if not rows:
        return f"no layout fits {args.search} GPUs with {args.memory_gb:g} GB each"
    head = f"{'p':>4} {'t':>3} {'d':>5} {'v':>3} {'m':>5} {'b':>4} {'GB':>7} {'bubble':>7} " \
           f"{'step s':>8} {'TFLOP/s':>8}"
    body = [f"{r['pipe']:>4} {r['tensor']:>3} {r['data']:>5} {r['chunks']:>3} "
            f"{r['microbatches']:>5} {r['microbatch_size']:>4} {r['memory_gb']:>7.1f} "
            f"{r['bubble_fraction']:>7.4f} {r['step_time_s']:>8.3f} "
            f"{r['tflops_per_device_estimate']:>8.1f}" for r in rows[: args.top]]
    return "\n".join([f"{len(rows)} layouts fit; best {min(args.top, len(rows))} by "
                      "estimated throughput:", head] + body)


if __name__ == "__main__":
    sys.exit(main())
