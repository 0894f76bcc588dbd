"""`python -m jaxptd.plan --search N`: the layouts and memory options that fit, ranked.

Owns the search space. A base layout is (p, t, c, d, v, b, schedule), chosen as the PTD-P
paper's takeaways say: t a power of two up to the GPUs per node (#1), p dividing the
layers, the rest data (#2), every microbatch size b dividing B / d (#3); a mixture of
experts' expert ranks e dividing d and its experts (a part of the data ranks); context
parallelism c in CONTEXTS where 2c divides the sequence and leaves each rank at least
MIN_CONTEXT_TOKENS (and the family has it), with
both attention methods (ring, allgather) for c > 1; the schedules are
1F1B and ZB-H1 (v = 1) or interleaved and zero-bubble interleaved (v in 2, 4; m a multiple
of p, as Megatron requires) and ZB-V (v = 2). Each base layout is planned with each memory
option set of OPTION_SETS (sequence parallelism, ZeRO-1, FSDP over a node's data ranks
(HSDP) or all of them, offloading the optimizer state and, with p = 1, the layer inputs) and keeps the
fastest set that fits device and host memory: the first in the list when times tie (SP and
ZeRO-1 move the same bytes as the collectives they replace; under the kernel model,
jaxptd/plan/kernels.py, SP is faster where t > 1: its LayerNorms and residual adds stream
h / t a token, not h).
model.remat and parallel.stash stay as the config says. Plans use the formulas only (no
schedule simulation) and reuse the parameter counts, so the search stays fast.
"""
from __future__ import annotations

import dataclasses

from jaxptd.config import Config, ConfigError, validate
from jaxptd.plan.counts import real_counts
from jaxptd.plan.inputs import PlanInputs
from jaxptd.plan.planner import plan
from jaxptd.units import GB

CONTEXTS = (1, 2, 4, 8)  # context ranks the search tries
# ... where each rank keeps at least this many tokens: a ring block's backward matmuls
# (5 b n^2 h/t FLOPs) hide its sends (the block and its float32 gradients, 2 b n h (k/a)/t
# (e + 4) bytes) only from n ~ 1,300 (k/a = 1/4) to 5,300 (k = a) tokens on an H100's
# NVLink (the planner's overlap model, timing.py; the forward's from 1,100), and below
# that sequence parallelism splits the activations for less. It also keeps --search at
# short sequences as fast as without context parallelism (7 x the plans otherwise).
MIN_CONTEXT_TOKENS = 1024

# (name, sequence parallel, ZeRO-1, FSDP group: 0 none / "node" / "all", offload optimizer,
#  offload activations), cheapest first
OPTION_SETS = (
    ("-", False, False, 0, False, False),
    ("sp", True, False, 0, False, False),
    ("sp+z1", True, True, 0, False, False),
    ("sp+z1+hsdp", True, True, "node", False, False),
    ("sp+fsdp", True, False, "all", False, False),
    ("sp+z1+offopt", True, True, 0, True, False),
    ("sp+fsdp+offopt", True, False, "all", True, False),
    ("sp+fsdp+offopt+offact", True, False, "all", True, True),
)


def divisors(n: int) -> list:
    """The divisors of n, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def search(config: Config, inputs: PlanInputs, n: int) -> list:
    """Rows (layout, schedule, options, memory, time) that fit on n GPUs, best estimated
    throughput first."""
    model, B = config.model, config.train.global_batch
    cache, rows = {}, []
    tensors = [t for t in divisors(inputs.hardware.gpus_per_node) if t & (t - 1) == 0
               and model.num_heads % t == 0 and n % t == 0]
    contexts = [c for c in CONTEXTS if c == 1 or (model.seq_len % (2 * c) == 0 and
                                                  model.seq_len // c >= MIN_CONTEXT_TOKENS)]
    for t, c in ((t, c) for t in tensors for c in contexts if n % (t * c) == 0):
        for p in (p for p in divisors(model.units) if n % (t * c * p) == 0):
            d = n // (t * c * p)
            if B % d:
                continue
            chunks = [1] if p == 1 else [v for v in (1, 2, 4) if model.units % (p * v) == 0]
            for v, ep in ((v, ep) for v in chunks for ep in _experts(model, d)):
                for b in divisors(B // d):
                    m = B // (d * b)
                    if v > 1 and m % p:
                        continue
                    for kind in _schedules(p, v):
                        for method in ("ring", "allgather") if c > 1 else ("ring",):
                            row = _best_options(config, inputs, cache,
                                                (p, t, c, ep, d, v, m), kind, method)
                            if row:
                                rows.append(row)
    return sorted(rows, key=lambda r: -r["tflops_per_device_estimate"])


def _experts(model, d: int) -> list:
    """The expert-parallel sizes to try: a mixture of experts' e dividing both the data
    ranks and the experts; a dense model's 1."""
    return [e for e in divisors(d) if model.moe_experts % e == 0] if model.moe else [1]


def _schedules(p: int, v: int) -> tuple:
    if p == 1:
        return ("1f1b",)
    if v == 1:
        return ("1f1b", "zb-h1")
    return ("interleaved", "zb-interleaved") + (("zb-v",) if v == 2 else ())


def _best_options(config, inputs, cache, layout, kind, method):
    """The fastest option set of one base layout (p, t, c, e, d, v, m) with this schedule
    and context attention method that fits, as a search row (or None). cache:
    real_counts by what they depend on (not the context ranks, over which the parameters
    are replicated), shared by the whole search."""
    p, t, c, ep, d, v, m = layout
    parallel = dataclasses.replace(config.parallel, data=d, pipe=p, tensor=t, context=c,
                                   expert=ep, context_attention=method, chunks=v,
                                   microbatches=m, schedule=kind, sequence_parallel=False,
                                   fsdp=False, fsdp_group=0)
    base = dataclasses.replace(config, parallel=parallel,
                               runtime=dataclasses.replace(config.runtime, cpu_devices=0),
                               optimizer=dataclasses.replace(config.optimizer, zero1=False),
                               offload=dataclasses.replace(config.offload, optimizer=False,
                                                           activations=False))
    try:  # every rule but building the schedule, which accepts any m and is slow
        validate(dataclasses.replace(base, parallel=dataclasses.replace(
            parallel, pipe=1, chunks=1, schedule="1f1b")))
    except ConfigError:
        return None
    best = None
    for candidate in _with_options(base, inputs.hardware.gpus_per_node):
        key = (p, t, ep, d, candidate.parallel.fsdp_size, candidate.optimizer.zero1)
        if key not in cache:
            cache[key] = real_counts(candidate)
        report = plan(candidate, inputs, cache[key], simulate=False)
        if report["fits"] and (best is None or report["tflops_per_device_estimate"]
                               > best["tflops_per_device_estimate"] * (1 + 1e-9)):
            best, chosen = report, candidate
    if best is None:
        return None
    return {**best["layout"], "options": best["options"], "overrides": overrides(chosen),
            "memory_gb": best["memory_bytes_per_device"]["total"] / GB,
            "host_memory_gb": best["host_memory_bytes_per_device"]["total"] / GB,
            "bubble_fraction": best["bubble_fraction"],
            "step_time_s": best["step_time_s"]["total"],
            "tflops_per_device_estimate": best["tflops_per_device_estimate"]}


def overrides(config: Config) -> list:
    """The section.key=value settings a search row varies, to reproduce it (or compile it:
    `plan --search N --verify --target h100`)."""
    par, fields = config.parallel, ("data", "pipe", "tensor", "context", "expert",
                                    "context_attention", "chunks", "microbatches", "schedule",
                                    "sequence_parallel", "fsdp", "fsdp_group")
    return ([f"parallel.{f}={getattr(par, f)}" for f in fields]
            + [f"optimizer.zero1={config.optimizer.zero1}",
               f"offload.optimizer={config.offload.optimizer}",
               f"offload.activations={config.offload.activations}"])


def _with_options(base: Config, gpus_per_node: int):
    """base with each applicable option set of OPTION_SETS, cheapest first. An FSDP group
    is data ranks of one expert rank (the mesh's fsdp axis lies outside expert): "all" is
    data / expert of them, "node" those a node holds beside its tensor, context, expert
    and pipe ranks."""
    par = base.parallel
    node_group = gpus_per_node // (par.tensor * par.context * par.expert * par.pipe)
    whole = par.data // par.expert
    seen = set()
    for _, sp, zero1, group, offload_opt, offload_act in OPTION_SETS:
        g = {0: 0, "node": node_group, "all": whole}[group]
        if (sp and (par.tensor == 1 or base.model.seq_len % (par.tensor * par.context))) \
                or (offload_act and par.pipe > 1) or \
                (group and (g < 2 or whole % g)) or (group == "node" and g == whole):
            continue
        zero1 = zero1 and par.data // (max(g, 1) * par.expert) > 1
        key = (sp, zero1, g, offload_opt, offload_act)
        if key in seen:
            continue
        seen.add(key)
        yield dataclasses.replace(
            base,
            parallel=dataclasses.replace(par, sequence_parallel=sp, fsdp=g > 0, fsdp_group=g),
            optimizer=dataclasses.replace(base.optimizer, zero1=zero1),
            offload=dataclasses.replace(base.offload, optimizer=offload_opt,
                                        activations=offload_act))
