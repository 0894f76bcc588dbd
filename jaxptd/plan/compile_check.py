"""The real training step compiled for a GPU that is not there, and what the program says.

Owns `python -m jaxptd.plan --verify --target h100`'s work: devices of the target from
XLA's GPU compiler (jaxptd/runtime/target.py, `topology_devices`), the step built and compiled for
them exactly as a run builds it (its XLA options, the target's code paths: cuDNN
attention, the pipeline's steady rounds, Triton kernels, unrolled layers), and a report
read off the
compiled program: memory a device against what the target may use; the largest buffers
(from XLA's own memory report, when the process dumps it) and what they hold; the
asynchronous collectives and whether computation runs while they are in flight; loops and
the conditionals inside them; cuDNN, cuBLAS and Triton calls; and the static cost report
of jaxptd/hlo/, labelled an estimate: its roofline time and the MFU ceiling it implies.
Nothing runs on a device; nothing here needs a GPU, only the CUDA compiler plugin
(`pip install -e '.[h100]'`).
"""
from __future__ import annotations

import glob
import os
import re
import time
from collections import Counter, defaultdict

from jaxptd import hlo
from jaxptd.config import Config, ConfigError
from jaxptd.runtime.target import Target, TargetError, topology_devices
from jaxptd.train.metrics import flops_per_iteration
from jaxptd.units import GB, MB, GiB, KiB, MiB, TiB

_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}  # XLA's memory report


def dump_flags(directory: str) -> str:
    """XLA_FLAGS that dump the step's optimized program and memory report into directory
    (set before the JAX backend starts)."""
    return f"--xla_dump_to={directory} --xla_dump_hlo_module_re=.*step_fn.*"


def compile_step(config: Config, target: Target, gpus_per_node: int):
    """(compiled step, seconds) for config.num_devices devices of `target`, hosts of
    gpus_per_node devices each (the mesh puts tensor inside a host). A step that offloads
    is lowered on CPU devices standing in for the GPU's where the process has enough
    (stand_in.py: a stand_in.Compiled, its host memory apart from the device's);
    elsewhere it compiles as one memory."""
    # JAX on use: after --verify's XLA_FLAGS, never for --help
    import jax
    import jax.numpy as jnp
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.model import batch_width
    from jaxptd.plan import stand_in
    from jaxptd.train.step import Setup, build_train_step

    n = config.num_devices
    per_host = min(n, gpus_per_node)
    if n % per_host:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: must divide the layout's "
                          f"{n} devices to compile for whole hosts")
    try:
        devices = topology_devices(target, n // per_host, per_host)
    except TargetError as e:
        raise ConfigError(str(e)) from None
    mesh = make_mesh(config.parallel, devices)
    host = (config.offload.optimizer or config.offload.activations) and stand_in.available(n)
    setup = Setup(config, stand_in.mesh_for(mesh), target) if host else Setup(config, mesh)
    batch = jax.ShapeDtypeStruct((config.train.global_batch, batch_width(config.model)),
                                 jnp.int32, sharding=setup.batch_sharding)
    began = time.perf_counter()
    try:
        traced = build_train_step(setup).trace(setup.state_layout.abstract_state(), batch)
        compiled = stand_in.compile_for(traced.lower(lowering_platforms=("cuda",)), mesh,
                                        setup.compiler_options()) if host else \
            setup.compile(traced.lower())
    except Exception as e:  # noqa: BLE001 -- a program that does not trace or compile
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"--verify --target {target.name}: the step does not compile: "
                          f"{type(e).__name__}: {first}") from None
    return compiled, time.perf_counter() - began


def memory(compiled) -> dict:
    """Bytes a device (XLA's memory analysis): arguments, outputs, temporaries, aliased,
    host-side ones, the device total (arguments + temporaries + outputs not aliased) and
    the host's likewise (a step compiled with host memory apart: stand_in.py)."""
    analysis = compiled.memory_analysis()
    got = {k: float(getattr(analysis, f"{k}_size_in_bytes", 0) or 0) for k in (
        "argument", "output", "alias", "temp", "generated_code", "host_argument",
        "host_output", "host_alias", "host_temp")}
    got["total"] = got["argument"] + got["output"] - got["alias"] + got["temp"] + \
        got["generated_code"]
    got["host_total"] = got["host_argument"] + got["host_output"] - got["host_alias"] + \
        got["host_temp"]
    return got


def largest_buffers(dump_dir: str | None, module: hlo.Module, names: dict, top: int = 8):
    """[(bytes, shapes, what)] of the largest buffers of XLA's memory-usage report (None
    when the step was not dumped). shapes are written with the model's dimension names;
    what is the jax op that made the first value the buffer holds."""
    reports = glob.glob(os.path.join(dump_dir or "", "*step_fn*memory-usage-report.txt"))
    if not dump_dir or not reports:
        return None
    values = _buffer_values(reports[0].replace("memory-usage-report", "buffer-assignment"))
    defined = {i.name: i.op_name for c in module.computations.values() for i in c.instrs}
    rows = []
    for line in open(reports[0]).read().split("\n\n")[0].splitlines():
        m = re.match(r"\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*(\d+);\s*\d+;\s*(.*)$",
                     line)
        if m is None:
            continue
        size = float(m.group(1)) * _UNITS[m.group(2)]
        offset, shapes = int(m.group(3)), m.group(4)
        holders = [defined.get(v, "") for v in values.get(offset, [])]
        what = next((h for h in holders if h), "")
        rows.append((size, _named(shapes, names), re.sub(r"^jit\(\w+\)/", "", what)))
    return sorted(rows, key=lambda r: -r[0])[:top]


def _buffer_values(path: str) -> dict:
    """{offset in the temporary allocation: [instruction names of the values there]}."""
    found: dict = defaultdict(list)
    if not os.path.exists(path):
        return found
    blocks = re.split(r"\n(?=allocation \d+:)", open(path).read())
    temp = next((b for b in blocks if "preallocated-temp" in b.split("\n")[0]), "")
    for m in re.finditer(r"value: <\d+ ([\w.\-]+)(?:\{[\d,]*\})? @\d+> \(size=\d+,offset=(\d+)\)",
                         temp):
        found[int(m.group(2))].append(m.group(1))
    return found


def live_peaks(dump_dir: str | None, in_host) -> dict | None:
    """{"temp": the most bytes of the dumped step's temporaries live at once, "device": the
    same without the buffers in_host(dims) says a GPU program keeps in host memory (on
    CPU the two memory kinds are one, and XLA places everything in one allocation)}, from
    XLA's buffer assignment (each value's size and offset) and live ranges (its span in
    the schedule); values sharing addresses count once. None when the step was not
    dumped."""
    paths = sorted(glob.glob(os.path.join(dump_dir or "", "*step_fn*buffer-assignment.txt")))
    if not dump_dir or not paths:
        return None
    blocks = re.split(r"\n(?=allocation \d+:)", open(paths[-1]).read())  # the latest
    temp = next((b for b in blocks if "preallocated-temp" in b.split("\n")[0]), "")
    ranges_text = open(paths[-1].replace("buffer-assignment", "live-range")).read()
    spans = {name: (int(a), int(b)) for name, a, b in re.findall(
        r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", ranges_text, re.M)}
    values = [(spans[name + (index or "{}")], int(offset), int(offset) + int(size),
               [int(d) for d in dims.split(",") if d])
              for name, index, size, offset, dims in re.findall(
                  r"value: <\d+ (\S+?)(\{[\d,]*\})? (?:\(phi\) )?@\d+> "
                  r"\(size=(\d+),offset=(\d+)\): \w+\[([\d,]*)\]", temp)
              if name + (index or "{}") in spans]

    def peak(values) -> int:  # the most address space in use at a value's first point
        best = 0
        for t in sorted({span[0] for span, *_ in values}):
            used, top = 0, -1
            for lo, hi in sorted((lo, hi) for (a, b), lo, hi, _ in values if a <= t <= b):
                used, top = (used + hi - max(lo, top), hi) if hi > top else (used, top)
            best = max(best, used)
        return best
    return {"temp": float(peak(values)),
            "device": float(peak([v for v in values if not in_host(v[3])]))}


def _named(shapes: str, names: dict) -> str:
    """bf16[24,4,2048,8192] -> bf16[L,b,s,ffn] where the model's sizes are known."""
    return re.sub(r"\[([\d,]*)\]", lambda m: "[" + ",".join(
        names.get(int(d), d) for d in m.group(1).split(",") if d) + "]", shapes)


def dimension_names(config: Config) -> dict:
    """The model's sizes by name, for printing shapes."""
    m, par = config.model, config.parallel
    named = [("L", m.num_layers), ("b", config.microbatch_size), ("s", m.seq_len),
             ("h", m.hidden_size), ("ffn", m.ffn), ("V", m.padded_vocab(par.tensor)),
             ("heads", m.num_heads), ("d", m.head_dim)]
    if par.tensor > 1:
        named += [("h/t", m.hidden_size // par.tensor), ("ffn/t", m.ffn // par.tensor),
                  ("V/t", m.padded_vocab(par.tensor) // par.tensor),
                  ("heads/t", m.num_heads // par.tensor)]
    names: dict = {}
    for name, size in named:  # equal sizes share a name: s=h
        names[size] = f"{names[size]}={name}" if size in names else name
    return names


def cost_report(config: Config, module: hlo.Module, target: Target) -> dict:
    """The static cost report (jaxptd/hlo/): time, FLOPs, bytes and launches by kernel
    category and by phase, kernels a layer, and the MFU ceiling: PTD-P eq. (3)'s model
    FLOPs without recomputation per device over the roofline time at the target's peak."""
    peak, bandwidth, fp8_peak = target.peak_bf16, target.hbm, target.peak_fp8
    kernels = hlo.cost(module, peak, bandwidth, fp8_peak)
    by = {"category": defaultdict(lambda: [0.0] * 4), "phase": defaultdict(lambda: [0.0] * 4)}
    for k in kernels:
        for key, group in (("category", k.category), ("phase", k.phase)):
            row = by[key][group]
            for i, value in enumerate((k.seconds(peak, bandwidth, fp8_peak), k.flops, k.bytes,
                                       1.0)):
                row[i] += value * k.count
    seconds = sum(row[0] for row in by["category"].values())
    model = config.model
    model_flops = flops_per_iteration(model, config.train.global_batch,
                                      model.padded_vocab(config.parallel.tensor))
    # a device runs its stage's layers (all of them unpipelined) for each of its microbatches
    layer_passes = model.num_layers / config.parallel.pipe * config.parallel.microbatches
    table = {key: {group: dict(zip(("seconds", "flops", "bytes", "launches"), row))
                   for group, row in rows.items()} for key, rows in by.items()}
    other = sum(r["bytes"] for c, r in table["category"].items()
                if c not in ("gemm", "attention"))
    return {"seconds": seconds, **table, "bytes_outside_gemm_attention": other,
            "launches": sum(k.count for k in kernels),
            "kernels_per_layer": sum(k.count for k in kernels if k.is_layer) / layer_passes,
            "layer_gemms": layer_gemms(kernels, layer_passes),
            "model_flops_per_device": model_flops / config.num_devices,
            "mfu_ceiling": model_flops / config.num_devices / (seconds * peak)}


def layer_gemms(kernels: list, layer_passes: float) -> dict:
    """A layer's GEMM launches, those with FP8 operands and the others (model.fp8's
    evidence), each a layer pass; the others by the jax op that made them (the attention
    core's einsums under model.attention=xla are GEMMs that stay 16-bit)."""
    others: Counter = Counter()
    for k in kernels:
        if k.is_layer and k.category == "gemm" and not k.fp8:
            op = re.split(r"Block\W*/", k.op_name)[-1].removesuffix("/dot_general")
            others[f"{k.phase} {op}"] += k.count / layer_passes
    gemms = [k for k in kernels if k.is_layer and k.category == "gemm"]
    return {"fp8": sum(k.count for k in gemms if k.fp8) / layer_passes,
            "other": sum(others.values()), "other_by_op": dict(others.most_common(8))}


def covered(c: hlo.Collective, target: Target) -> bool:
    """The kernels in flight take, statically, at least the message's time over the node's
    links (what a rank moves in a ring, Collective.link_bytes, at target.intra)."""
    return c.in_flight_s(target.peak_bf16, target.hbm, target.peak_fp8) >= \
        c.link_bytes() / target.intra


def overlap_report(module: hlo.Module, target: Target) -> dict:
    """Collectives by kind: launches a step, bytes a step, how many are asynchronous and how
    many have a GEMM, attention or a loop scheduled while they are in flight, and how many
    are covered (`covered`); and the largest ones that overlap nothing."""
    kinds: dict = defaultdict(lambda: Counter())
    lonely = []
    for c in hlo.collectives(module):
        row = kinds[c.kind]
        row["launches"] += c.count
        row["bytes"] += c.bytes * c.count
        row["overlapped"] += c.count if c.overlap else 0
        row["covered"] += c.count if covered(c, target) else 0
        if not c.overlap:
            lonely.append((c.bytes, c.kind, c.name, c.op_name))
    return {"by_kind": {k: dict(v) for k, v in kinds.items()},
            "not_overlapped": sorted(lonely, reverse=True)[:6]}


def calls(module: hlo.Module) -> dict:
    """Library and generated kernels in the program text: cuDNN, cuBLAS, Triton (Pallas
    kernels), Triton GEMM fusions (XLA's own GEMMs when not autotuned to cuBLAS)."""
    counts: Counter = Counter()
    for comp in module.computations.values():
        for i in comp.instrs:
            target = i.attr("custom_call_target") or ""
            if target.startswith("__cudnn"):
                counts["cudnn " + target.split("$")[-1]] += 1
            elif target.startswith("__cublas"):
                counts["cublas"] += 1
            elif "triton" in target:
                counts["triton (pallas)"] += 1
            elif i.opcode == "fusion" and "triton_gemm" in i.attrs:
                counts["triton gemm fusion"] += 1
    return dict(counts)


def analyse(config: Config, compiled, target: Target, seconds: float,
            planned: float | None = None, dump_dir: str | None = None) -> dict:
    """The report of a compiled step (module docstring) as a JSON-ready dict."""
    module = hlo.parse(compiled.as_text())
    mem = memory(compiled)
    usable = target.usable
    report = {
        "target": target.name, "devices": config.num_devices, "compile_s": seconds,
        "memory": mem, "usable_bytes": usable, "fits": mem["total"] <= usable,
        "margin_bytes": usable - mem["total"],
        "planned_bytes": planned, "planned_ratio": planned / mem["total"] if planned else None,
        "largest_buffers": largest_buffers(dump_dir, module, dimension_names(config)),
        "collectives": overlap_report(module, target),
        "loops": [vars(loop) for loop in hlo.loops(module)],
        "calls": calls(module),
        "cost": cost_report(config, module, target),
    }
    return report


def format_report(report: dict) -> str:
    """The report as text: memory, buffers, collectives, loops, calls, cost."""
    mem, cost = report["memory"], report["cost"]
    lines = [f"compiled for {report['devices']} x {report['target']} in "
             f"{report['compile_s']:.1f} s (no device: XLA's GPU compiler, the run's XLA options)",
             f"memory/dev  {mem['total'] / GiB:.2f} GiB of {report['usable_bytes'] / GiB:.2f} "
             f"GiB usable: {'fits' if report['fits'] else 'DOES NOT FIT'} (margin "
             f"{report['margin_bytes'] / GiB:+.2f} GiB)   arguments {mem['argument'] / GiB:.2f}"
             f"  temporaries {mem['temp'] / GiB:.2f}  outputs not aliased "
             f"{(mem['output'] - mem['alias']) / GiB:.2f}  host {mem['host_total'] / GiB:.2f}"]
    if report["planned_bytes"]:
        lines.append(f"  planner {report['planned_bytes'] / GiB:.2f} GiB: "
                     f"{report['planned_ratio']:.2f} x the compiled step")
    if report.get("offloaded_state_on_device"):
        lines.append("  (XLA's devices without a GPU have no host memory: the offloaded "
                     "state is compiled into device memory here, and the planner's "
                     "device + host is compared)")
    if report["largest_buffers"]:
        lines.append("  largest buffers (XLA's memory report):")
        lines += [f"    {size / GiB:8.3f} GiB  {shapes}  {what[:90]}"
                  for size, shapes, what in report["largest_buffers"]]
    lines.append("collectives a step (overlapped: a GEMM, attention or loop runs while in "
                 "flight; covered: the kernels in flight take, statically, at least the "
                 "bytes over NVLink):")
    for kind, row in sorted(report["collectives"]["by_kind"].items()):
        lines.append(f"  {kind:<20} {row.get('launches', 0):8.0f} launches "
                     f"{row.get('bytes', 0) / GB:9.3f} GB   overlapped "
                     f"{row.get('overlapped', 0):.0f}   covered {row.get('covered', 0):.0f}")
    lines += [f"  overlaps nothing: {kind} {size / MB:.1f} MB  {op[-80:]}"
              for size, kind, _, op in report["collectives"]["not_overlapped"]]
    lines.append("loops: " + ", ".join(
        f"{lp['trip']} x {lp['count']:g} ({lp['kernels']} kernels, "
        f"{lp['conditionals']} conditionals, {lp['collectives']} collectives)"
        for lp in report["loops"]) if report["loops"] else "loops: none")
    lines.append("calls: " + (", ".join(f"{k} {v}" for k, v in sorted(report["calls"].items()))
                              or "none"))
    lines.append(f"static cost (an estimate: each kernel at max(FLOPs / peak, bytes / HBM), "
                 f"nothing autotuned): {cost['seconds'] * 1e3:.1f} ms a step, "
                 f"{cost['launches']:.0f} kernels, {cost['kernels_per_layer']:.0f} a layer, "
                 f"MFU ceiling {cost['mfu_ceiling']:.3f}")
    for key in ("category", "phase"):
        for group, row in sorted(cost[key].items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(f"  {group:<12} {row['seconds'] * 1e3:8.1f} ms  "
                         f"{row['flops'] / 1e12:8.2f} TFLOP  {row['bytes'] / GB:8.1f} GB  "
                         f"{row['launches']:6.0f} kernels")
    lines.append(f"  bytes moved outside GEMMs and attention: "
                 f"{cost['bytes_outside_gemm_attention'] / GB:.1f} GB a step")
    gemms = cost["layer_gemms"]
    lines.append(f"  a layer's GEMMs (each pass): {gemms['fp8']:g} FP8 (8-bit operands, at "
                 f"the FP8 peak), {gemms['other']:g} other" + "".join(
                     f"\n    other: {n:g} x {op}" for op, n in gemms["other_by_op"].items()))
    if report.get("kernel_time_s"):
        timed = report["kernel_time_s"]
        lines.append(f"planner's step from these kernels (jaxptd/plan/kernels.py): "
                     f"{timed['total']:.3f} s = " + " + ".join(
                         f"{k} {v:.3f}" for k, v in timed.items() if k != "total" and v))
    return "\n".join(lines)
