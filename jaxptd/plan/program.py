"""What the step a config compiles to does, as the planner's models read it: what its
backward recomputes, the schedule's bubble and buffer slots (from the simulator and the
lowering, or the formulas above SIMULATE_LIMIT / LOWER_LIMIT), its mixture of experts'
shape, whether its head is spread over pipe and how often its scans run it, whether its
attention is flash attention and causal. JAX-free (the pipeline's schedules and lowering
are plain Python); the memory and time models (jaxptd/plan/planner.py, model.py,
timing.py) are fed with these.
"""
from __future__ import annotations

from functools import lru_cache

from jaxptd.arch import family
from jaxptd.config import Config
from jaxptd.pipeline import schedules, static_chunks
from jaxptd.pipeline.lowering import lower
from jaxptd.pipeline.scans import (head_pieces, head_rounds, headless_stretch, round_costs,
                                   round_form)
from jaxptd.pipeline.simulate import simulate as simulate_schedule
from jaxptd.plan import model as pm
from jaxptd.plan import timing as pt
from jaxptd.plan.experts import Moe

MINIMAL = ("minimal", "minimal_mlp")  # model.remat's: keep matmul outputs, run the rest again
SIMULATE_LIMIT = 200_000  # ranks x actions above which the bubble comes from the formula
LOWER_LIMIT = 4096  # p m v above which the buffer slots come from the formula


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
def _lowered(kind: str, p: int, m: int, v: int, form: str):
    costs = round_costs(form)
    return lower(schedules.make_schedule(kind, p, m, v, costs), costs)


def _lowered_slots(kind: str, p: int, m: int, v: int, form: str) -> dict:
    rounds = _lowered(kind, p, m, v, form)
    return {"stash": rounds.num_stash_slots, "grad": rounds.num_grad_slots,
            "w": rounds.num_w_slots, "tape": rounds.num_tape_slots}


def head_runs(config: Config, platform: str, lowered: bool = True) -> float:
    """How many times a pipelined step runs each microbatch's head: the rounds whose scans
    run it (scans.head_rounds: the step's cuts, scans.headless_stretch, which starts JAX; a
    two-chunk schedule's held chunks swapped as static_chunks finds) over the microbatches;
    1 unpipelined, above LOWER_LIMIT or not `lowered` (the search, which lowering every
    layout would slow from seconds to minutes)."""
    par = config.parallel
    p, m, v = par.pipe, par.microbatches, par.chunks
    if p == 1 or p * m * v > LOWER_LIMIT or not lowered:
        return 1.0
    form = round_form(config, platform)
    rounds = _lowered(par.schedule, p, m, v, form)
    swaps = static_chunks.swaps(rounds) if v == 2 else None
    headless = headless_stretch(config, recomputation(config))
    return head_rounds(rounds, form, headless, swaps) / m


def schedule_stats(config: Config, platform: str, simulate: bool = True):
    """(bubble fraction, buffer slots {stash, grad, w, tape}, (Stats, Schedule) or None) of
    the schedule as the round form the step runs on `platform` packs and times it
    (scans.round_costs: a GPU's steady form runs a slot kind some rank uses on every
    rank).

    The bubble comes from the simulator when asked and small enough, else from the
    formula. The slots are the executor's (the schedule lowered) when it is small, or
    when an interleaved m is not a multiple of p; else model.slots_formula."""
    par = config.parallel
    if par.pipe == 1:
        return 0.0, {"stash": 0, "grad": 0, "w": 0, "tape": 0}, None
    p, v, m, kind = par.pipe, par.chunks, par.microbatches, par.schedule
    form = round_form(config, platform)
    costs = round_costs(form)
    irregular = v > 1 and m % p != 0
    slots = _lowered_slots(kind, p, m, v, form) if (simulate and p * m * v <= LOWER_LIMIT) \
        or irregular else pm.slots_formula(kind, p, m, v, costs.masked)
    if not simulate or p * p * m * v * 3 > SIMULATE_LIMIT:
        zb, v_shape = kind in schedules.ZERO_BUBBLE, kind in schedules.V_SHAPED
        return pt.bubble_formula(p, v, m, zb, costs.masked, v_shape), slots, None
    sched = schedules.make_schedule(kind, p, m, v, costs)
    stats = simulate_schedule(sched, costs)
    return stats.bubble_fraction, slots, (stats, sched)


def moe_shape(config: Config, balanced: bool = False) -> Moe | None:
    """The config's mixture of experts as the formulas read it (None: dense MLPs);
    balanced: its rows as balanced routing needs them, not as the layer allocates them
    (model.moe_rows)."""
    m_cfg = config.model
    if not m_cfg.moe:
        return None
    return Moe(experts=m_cfg.moe_experts, top_k=m_cfg.moe_top_k, ffn=m_cfg.expert_ffn,
                  shared_ffn=m_cfg.moe_shared_ffn, ep=config.parallel.expert,
                  capacity=m_cfg.moe_capacity, balanced=balanced, every=m_cfg.unit)


def spreads_head(config: Config, platform: str) -> bool:
    """Whether the step spreads the head over the pipe ranks (jaxptd/pipeline/head.py)."""
    return head_pieces(config, round_form(config, platform)) > 0


def flash_attention(config: Config, platform: str) -> bool:
    """Whether a layer's attention core keeps no score tensor on `platform`: the ring's
    blocks (parallel.context > 1, context_attention=ring) are Pallas's flash kernels with
    model.kernels=pallas where no segment or padding masks the rows (a decoder's unpacked
    rows; interpret mode on CPU), else XLA's (jaxptd/model/context.py); any other
    attention is cuDNN's flash attention with model.attention=cudnn on a GPU, or Pallas's with
    model.attention=flash."""
    m_cfg, par = config.model, config.parallel
    if par.context > 1 and par.context_attention == "ring":
        return m_cfg.kernels == "pallas" and m_cfg.document_end < 0 and causal(config)
    return m_cfg.attention == "flash" or (m_cfg.attention == "cudnn" and platform == "gpu")


def causal(config: Config) -> bool:
    """A decoder's causal attention, else an encoder's (BERT: padding, whole blocks)."""
    return not family(config.model).encoder
