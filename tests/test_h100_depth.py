"""The pipeline at the papers' depth, compiled for H100s without a GPU (issue 48): the
ordering of the schedules where lockstep rounds can keep it, and bench/phase_kernels.py's
reading of a compiled step by phase. Shares tests/test_h100.py's helpers; needs the CUDA
compile extra like it."""
import os

import pytest

from jaxptd import hlo
from jaxptd.config import load_config
from jaxptd.plan import compile_check
from test_h100 import H100, ROOT, compiled, layout, needs_compiler


@needs_compiler
@pytest.mark.slow  # two compiles at GPT-1.3B's width, about a minute
def test_zb_h1_ahead_of_1f1b_at_depth():
    """Issue 48's ordering where the lockstep rounds can keep it: GPT-1.3B's width, 8
    stages of one layer, 16 microbatches of 2 (configs/gpu/gpt_1.3b.yaml, 8 layers):
    zb-h1's static step is below 1F1B's by at least a third of what its tables save in
    the simulator's units (`--masked`), so a change that loses zero bubble's gain at depth
    fails. (zb-v cannot be held below zb-h1 here: in lockstep rounds no V order packs
    fewer units than zb-h1's, schedules/vshape.py; the narrow layouts of the small tests
    put zb-h1 behind 1F1B, its update and ends outweighing its bubble.)"""
    from jaxptd.pipeline.schedules import Costs, make_schedule
    from jaxptd.pipeline.simulate import simulate
    step = {}
    for kind in ("1f1b", "zb-h1"):
        config = load_config(os.path.join(ROOT, "configs", "gpu", "gpt_1.3b.yaml"), [
            *layout(1, 8, 1, 16, f"parallel.schedule={kind}"), "model.num_layers=8",
            "runtime.target=h100"])
        compiled_step, seconds = compile_check.compile_step(config, H100, 8)
        step[kind] = compile_check.analyse(config, compiled_step, H100,
                                           seconds)["cost"]["seconds"]
    costs = Costs(masked=True)
    units = {kind: simulate(make_schedule(kind, 8, 16, 1, costs), costs).total_time
             for kind in step}
    saved = 1 - units["zb-h1"] / units["1f1b"]
    assert step["zb-h1"] < (1 - saved / 3) * step["1f1b"], (step, units)


@needs_compiler
@pytest.mark.slow  # (a pipelined compile: half a minute)
def test_phase_kernels_groups_the_cost_report():
    """bench/phase_kernels.py's grouping of a pipelined step's kernels: each phase's groups
    add up to the cost report's phase, and 1F1B's rounds phase holds its stash writes
    (each kept value copied into a slot chosen at run time)."""
    from bench.phase_kernels import grouped
    config, step, report, module = compiled(*layout(1, 2, 1, 4))
    kernels = hlo.cost(module, H100.peak_bf16, H100.hbm)
    phases = report["cost"]["phase"]
    for phase in phases:
        rows = grouped(module, kernels, H100, phase)
        assert sum(r[0] for r in rows) == pytest.approx(phases[phase]["seconds"] * 1e3)
        assert sum(r[1] for r in rows) == phases[phase]["launches"]
    assert "stack write" in {r[2] for r in grouped(module, kernels, H100, "rounds")}
    assert "?" not in {r[4] for r in grouped(module, kernels, H100, "all")}
