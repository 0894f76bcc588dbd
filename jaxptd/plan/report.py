"""The planner's output: the text report, the search table and the memory picture.

Owns how `python -m jaxptd.plan` shows a plan (jaxptd/plan/planner.py makes it): one
section per question, bytes in GB (jaxptd/units.py: 1e9), device and host memory by
category side by side, and where the bytes go.
"""
from __future__ import annotations

import sys

from jaxptd.config import ConfigError
from jaxptd.pipeline.draw import draw_timeline
from jaxptd.plan.memory import BACKWARD_PHASE
from jaxptd.runtime.target import Target
from jaxptd.units import GB, MB

DEVICE_KEYS = ("weights", "gradients", "optimizer", "activations", "stash", "fsdp_gathered",
               "gradient_workspace", "weight_copies")
NOTES = {
    "weights": "float32 masters (offload: on the host, a layer's at a time on the device)",
    "gradients": "float32 sums (offload, pipe 1: on the host, a layer's on the device)",
    "optimizer": "optimizer moments, float32: Adam mu and nu, SGD momentum",
    "activations": "one microbatch's working set (host: offloaded layer inputs)",
    "stash": "the pipeline's buffers: stage inputs, gradients, W taps, a spread head",
    "fsdp_gathered": "FSDP: one matmul's weight gathered, cast, its gradient (or the ends)",
    "gradient_workspace": "m > 1: a microbatch's gradient before it is added",
    "weight_copies": "GPU, layers unrolled: the weights cast to the compute dtype",
}


def format_report(r: dict, hw: Target) -> str:
    """The human-readable plan for the hardware hw."""
    lay, comm, t = r["layout"], r["comm_bytes"], r["step_time_s"]
    lines = [
        f"layout      (p, t, d) = ({lay['pipe']}, {lay['tensor']}, {lay['data']}) on "
        f"{r['num_devices']} devices; v={lay['chunks']} m={lay['microbatches']} "
        f"b={lay['microbatch_size']} schedule={lay['schedule']}",
        f"options     {_options(r['options'])}",
        f"parameters  model {r['params_model'] / 1e9:.4f} B   eq. (2) "
        f"{r['params_formula'] / 1e9:.4f} B   difference {r['params_difference']:+,.0f} "
        "(ours adds the final LayerNorm 2h and pads V to 128 x tensor; eq. (2) already "
        "counts tied embeddings, learned positions and biases)",
        f"FLOPs/iter  {r['flops_per_iteration']:.4g} executed   eq. (3) with recompute "
        f"{r['flops_recompute']:.4g}, without {r['flops_no_recompute']:.4g}",
        _context_line(r),
    ] + _moe_lines(r) + _memory_lines(r, hw) + [
        f"pipeline    bubble {r['bubble_fraction']:.4f}   peak stash {r['peak_stash']} "
        f"microbatch-stages   buffers {r['pipeline_slots']['stash']} stash, "
        f"{r['pipeline_slots']['grad']} grad, {r['pipeline_slots']['w']} W, "
        f"{r['pipeline_slots']['tape']} tape slots",
        f"comm/dev    p2p {comm['p2p_per_microbatch'] / MB:.2f} MB/microbatch, "
        f"tensor {comm['tensor_per_microbatch'] / MB:.2f} MB/microbatch, "
        f"context {comm['context_per_microbatch'] / MB:.2f} MB/microbatch, "
        f"all-to-all {comm['expert_per_microbatch'] / MB:.2f} MB/microbatch, "
        f"FSDP {comm['fsdp_per_microbatch'] / GB:.3f} GB/microbatch, "
        f"data {comm['data_per_step'] / GB:.3f} GB/step, tied embedding "
        f"{comm['tied_per_step'] / GB:.3f} GB/step (first <-> last stage), host "
        f"{(comm['host_per_step'] + lay['microbatches'] * comm['host_per_microbatch']) / GB:.3f}"
        " GB/step",
        f"step time   {t['total']:.3f} s = compute {t['compute']:.3f} (bubble incl.) + tensor "
        f"{t['tensor']:.3f} + context {t['context']:.3f} + all-to-all {t['expert']:.3f} + "
        f"p2p {t['p2p']:.3f} + FSDP "
        f"{t['fsdp']:.3f} + data "
        f"{t['data']:.3f} + host {t['host']:.3f}   ~ "
        f"{r['tflops_per_device_estimate']:.1f} TFLOP/s per device",
        _kernels_line(r),
    ]
    if "days_to_train" in r:
        lines.append(f"train time  {r['days_to_train']:.1f} days (eq. 3)   "
                     f"{r['days_to_train_eq4']:.1f} days (eq. 4: 8 T P / (n X))")
    if "verify" in r:
        lines += _format_verify(r["verify"])
    return "\n".join(lines)


def _kernels_line(r: dict) -> str:
    """The time model: the calibrated kernels' parts (jaxptd/plan/kernels.py), or the flat
    rate's."""
    k = r.get("kernels")
    if not k:
        return "compute     flat: the executed FLOPs at --device-tflops (or half the peak)"
    return (f"compute     kernels (bubble excl.): GEMMs {k['gemm']:.3f} s at "
            f"{k['gemm_rate'] / 1e12:.0f} TFLOP/s (the measured ceiling x wave efficiency "
            f"{k['gemm_efficiency']:.3f}), attention {k['attention']:.3f}, other activations "
            f"{k['memory']:.3f} (HBM), pipeline rounds {k.get('rounds', 0.0):.3f}, launches {k['launches']:.3f}, update {k['update']:.3f}"
            "; links at NCCL's measured fractions, a node's NICs in parallel")


def _context_line(r: dict) -> str:
    """Context parallelism: the ranks and method, the balance of the chunk pairs, the
    attention core executed, and whether the ring's permutes hide behind its blocks."""
    c = r["context"]
    if c["ranks"] == 1:
        return "context     c=1: off (every rank holds whole sequences)"
    if c["method"] == "ring":
        overlap = (f"a block's permute {c['permute_s'] * 1e3:.3f} ms vs its matmuls "
                   f"{c['block_s'] * 1e3:.3f} ms, backward (with its float32 gradients) "
                   f"{c['backward_permute_s'] * 1e3:.3f} vs "
                   f"{c['backward_block_s'] * 1e3:.3f} ms: "
                   f"{'hidden' if c['hidden'] else 'EXPOSED'}")
    else:
        overlap = "keys/values gathered before attention: not overlapped"
    return (f"context     c={c['ranks']} {c['method']} over {c['link']}-node links; "
            f"imbalance {c['imbalance']:.2f} with chunk pairs r, 2c-1-r (contiguous chunks: "
            f"{c['imbalance_contiguous']:.2f}); attention core executed "
            f"{c['core_fraction']:.3f} x the model count; {overlap}")


def _moe_lines(r: dict) -> list:
    """A mixture of experts: its shape and expert ranks, total and active parameters and
    the FLOPs formula, the expert weights' bytes, the all-to-all, the imbalance headroom."""
    x = r["moe"]
    if x is None:
        return []
    shared = f", a shared expert of width {x['shared_ffn']}" if x["shared_ffn"] else ""
    every = f" in one layer of every {x['every']} (the others dense)" if x["every"] > 1 else ""
    routing = (f"capacity factor {x['capacity']:g}: {x['rows']['allocated']:,.0f} rows a layer, "
               "overflow dropped" if x["capacity"] else "dropless")
    return [
        f"experts     E={x['experts']} top-{x['top_k']} of width {x['expert_ffn']}{shared}"
        f"{every}, "
        f"{routing}; expert ranks e={x['ranks']} ({x['experts_per_rank']} experts a rank); "
        f"params total {x['params_total'] / 1e9:.4f} B, active {x['params_active'] / 1e9:.4f} "
        f"B a token; expert weights {x['expert_weight_bytes'] / GB:.3f} GB/dev (masters, "
        "gradients, moments)",
        f"  FLOPs from the active parameters: a layer's MLP {x['mlp_flops_per_token']:,.0f} "
        "a token forward = 2 h E (router) + top_k x 6 h fe (SwiGLU; GeLU 4 h fe) + 6 h fs "
        "(shared; GeLU 4 h fs) + 2 h (shared gate); a layer = attention + that (with dense "
        "layers between: their mean); x 3 forward and backward",
        f"  all-to-all  {x['all_to_all_per_microbatch'] / MB:.2f} MB/microbatch leave a rank "
        f"(dispatch and combine, forward and backward, {x['all_to_all_message'] / MB:.2f} MB "
        f"each, (e-1)/e of it sent) over {x['link']}-node links: "
        f"{x['all_to_all_s']:.3f} s/step, not overlapped (a layer waits for its tokens)",
        f"  imbalance headroom {x['imbalance_headroom'] / GB:.3f} GB: the layer's static "
        f"buffers hold {x['rows']['allocated']:,.0f} expert rows, the worst routing's, "
        f"against {x['rows']['balanced']:,.0f} balanced; the plan counts them (balanced "
        f"routing alone: {x['balanced_bytes'] / GB:.3f} GB/dev, "
        f"{_fits(x['balanced_fits'])})",
    ]


def _options(o: dict) -> str:
    fsdp = "off" if not o["fsdp_group"] else f"over {o['fsdp_group']} data ranks"
    return ", ".join([
        f"sequence parallel {'on' if o['sequence_parallel'] else 'off'}",
        f"ZeRO-1 {'on' if o['zero1'] else 'off'}", f"FSDP {fsdp}",
        f"offload optimizer {'on' if o['offload_optimizer'] else 'off'}",
        f"offload activations {'on' if o['offload_activations'] else 'off'}",
        f"recomputation {o['remat']}" + (f" (stash {o['stash']})" if o["stash"] else "")])


def _fits(ok: bool) -> str:
    return "fits" if ok else "DOES NOT FIT"


def _memory_lines(r: dict, hw: Target) -> list:
    """Device and host bytes per category, whether each fits, and the largest parts."""
    dev, host = r["memory_bytes_per_device"], r["host_memory_bytes_per_device"]
    per_node = min(r["num_devices"], hw.gpus_per_node)
    lines = [
        f"memory/dev  device {dev['total'] / GB:.3f} GB of {hw.usable / GB:g} GB: "
        f"{_fits(r['memory_fits'])}   host {host['total'] / GB:.3f} GB per device x "
        f"{per_node} = {host['total'] * per_node / GB:.1f} GB of {hw.host_memory / GB:g} GB "
        f"per node: {_fits(r['host_memory_fits'])}",
        f"  {'':<19} {'device GB':>10} {'host GB':>10}",
    ]
    for key in DEVICE_KEYS:
        lines.append(f"  {key:<19} {dev[key] / GB:10.3f} {host.get(key, 0.0) / GB:10.3f}   "
                     f"{NOTES[key]}")
    lines.append(f"  {'total':<19} {dev['total'] / GB:10.3f} {host['total'] / GB:10.3f}   "
                 "peak: weights + gradients + optimizer (unless offloaded) + the larger phase")
    lines.append(f"  phases: forward/backward {dev['backward_phase'] / GB:.3f} GB (activations, "
                 f"stash, FSDP, workspace, weight copies), update {dev['update_phase'] / GB:.3f} GB (the "
                 "reduced gradient; offload: one layer's state at a time)")
    lines.append("  where the bytes go: " + where_the_bytes_go(
        dev, r["options"]["offload_optimizer"]))
    lines.append(
        f"  activations/layer/microbatch {r['activation_bytes_per_layer'] / GB:.3f} GB without "
        f"recomputation (Megatron's fused 16-bit layer, Korthikanti et al. 2022, at this "
        f"recomputation: {r['korthikanti_activation_bytes_per_layer'] / GB:.3f} GB)")
    return lines


def where_the_bytes_go(memory: dict, offload_optimizer: bool = False, top: int = 4) -> str:
    """The largest categories on the device at its peak, with their shares of it."""
    at_peak = {k: memory[k] for k in ("weights", "gradients", "optimizer")}
    if memory["peak_phase"] == "backward":
        at_peak.update({k: memory[k] for k in BACKWARD_PHASE})
    else:
        at_peak["update" if offload_optimizer else "reduced gradient"] = memory["update_phase"]
    parts = sorted(((v, k) for k, v in at_peak.items() if v), reverse=True)
    total = memory["total"] or 1.0
    return f"(peak in the {memory['peak_phase']} phase) " + ", ".join(
        f"{k} {v / GB:.1f} GB ({100 * v / total:.0f}%)" for v, k in parts[:top])


def _format_verify(v: dict) -> list:
    x = v["xla_memory"]
    return [
        "verify      XLA compiled step (CPU, simulated devices), per device:",
        f"  arguments  XLA {x['argument'] / MB:10.2f} MB   plan {v['planned_arguments'] / MB:10.2f}"
        " MB (masters + optimizer, host ones included; outputs alias the donated state)",
        f"  temp       XLA {x['temp'] / MB:10.2f} MB   plan {v['planned_temp'] / MB:10.2f}"
        " MB (the rest)",
        f"  total      XLA {x['total'] / MB:10.2f} MB   plan {v['planned_total'] / MB:10.2f} MB"
        f"   plan / XLA = {v['memory_ratio']:.3f} (on CPU host and device memory are one)",
        *([f"  device     XLA {v['xla_device_peak'] / MB:10.2f} MB   plan "
           f"{v['planned_device'] / MB:10.2f} MB (the temporaries live at once but the "
           "stacks a GPU keeps in host memory: offloaded gradients, layer inputs)"]
          if v.get("xla_device_peak") else []),
        f"  FLOPs      XLA {v['xla_flops']:.4g}   plan {v['planned_flops_loop_bodies']:.4g}"
        " (XLA counts each loop body once: one microbatch, one layer, plus the logit layer"
        "; its count also includes elementwise ops, eq. (3) only matmuls)",
        "  why they differ: XLA CPU computes bfloat16 matmuls in float32 and may keep both "
        "copies; its buffer reuse is exact where the plan adds phases; the plan's tensor "
        "inventory is our layer's autodiff residuals, Megatron's fused kernels keep fewer",
    ]


def format_search(rows: list, hw: Target, n: int, top: int) -> str:
    """The --search table of n GPUs of hw: the `top` layouts that fit, best estimated
    throughput first."""
    if not rows:
        return (f"no layout fits {n} GPUs with {hw.usable / GB:g} GB each "
                f"(and {hw.host_memory / GB:g} GB of host memory per node)")
    head = f"{'p':>4} {'t':>3} {'c':>3} {'e':>3} {'d':>5} {'v':>3} {'m':>5} {'b':>4} " \
           f"{'schedule':>14} " \
           f"{'options':<22} {'GB':>6} {'host GB':>8} {'bubble':>7} {'step s':>8} {'TFLOP/s':>8}"
    body = [f"{r['pipe']:>4} {r['tensor']:>3} {r['context']:>3} {r['expert']:>3} "
            f"{r['data']:>5} {r['chunks']:>3} "
            f"{r['microbatches']:>5} {r['microbatch_size']:>4} {r['schedule']:>14} "
            f"{_row_options(r):<22} {r['memory_gb']:>6.1f} "
            f"{r['host_memory_gb']:>8.1f} {r['bubble_fraction']:>7.4f} "
            f"{r['step_time_s']:>8.3f} {r['tflops_per_device_estimate']:>8.1f}"
            + _compiled_cell(r) for r in rows[:top]]
    legend = ("c: context ranks; e: expert ranks (of the d data ranks); options: ag allgather attention (c > 1; else the ring), "
              "sp sequence parallel, z1 ZeRO-1, fsdpG FSDP over G data ranks, "
              "offopt/offact offload of the optimizer state / layer inputs, "
              "inputs: stash stage inputs only")
    order = "; the compiled ones first, by their compiled step" \
        if any("step_s" in r.get("compiled", {}) for r in rows) else ""
    return "\n".join([f"{len(rows)} layouts fit; best {min(top, len(rows))} by "
                      f"estimated throughput{order}:", head] + body + [legend])


def _compiled_cell(row: dict) -> str:
    """What compiling the row for a GPU target said (plan --search --verify --target)."""
    c = row.get("compiled")
    if c is None:
        return ""
    step = f", step {c['step_s']:.4g} s" if "step_s" in c else ""
    return (f"   compiled {c['gb']:.1f} GB: {'fits' if c['fits'] else 'DOES NOT FIT'}, "
            f"MFU ceiling {c['mfu_ceiling']:.2f}{step}")


def _row_options(row: dict) -> str:
    """A search row's options, "ag" first with allgather attention (format_search)."""
    options = short_options(row["options"])
    if row["context"] == 1 or row["context_attention"] != "allgather":
        return options
    return "ag" if options == "-" else "ag+" + options


def short_options(o: dict) -> str:
    """A search row's options in a few letters (format_search's legend)."""
    words = ["sp"] if o["sequence_parallel"] else []
    words += ["z1"] if o["zero1"] else []
    words += [f"fsdp{o['fsdp_group']}"] if o["fsdp_group"] else []
    words += ["offopt"] if o["offload_optimizer"] else []
    words += ["offact"] if o["offload_activations"] else []
    words += ["inputs"] if o["stash"] == "inputs" else []
    return "+".join(words) or "-"


def draw(report: dict, path: str, timeline_stats=None) -> None:
    """Memory bars (device and host) and, when given (Stats, Schedule), the schedule's
    timeline (path-timeline.png); says on stderr which files it wrote."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"--png {path}: matplotlib is not installed "
                          "(pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 3))
    for row, name in ((1, "memory_bytes_per_device"), (0, "host_memory_bytes_per_device")):
        left = 0.0
        for i, key in enumerate(DEVICE_KEYS):
            value = report[name].get(key, 0.0) / GB
            ax.barh(row, value, left=left, color=f"C{i}", label=key if row else None)
            left += value
    ax.axvline(report["memory_limit_gb"], color="red", linestyle="--", label="device memory")
    ax.set_yticks([0, 1], ["host", "device"])
    ax.set_xlabel("GB per device")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
        print(f"wrote {path} (memory per device)", file=sys.stderr)
        if timeline_stats:
            timeline = path.rsplit(".", 1)[0] + "-timeline.png"
            draw_timeline(timeline_stats[0], timeline_stats[1], timeline)
            print(f"wrote {timeline} (the pipeline schedule)", file=sys.stderr)
    except OSError as e:
        raise ConfigError(f"--png {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
