"""bench/pipeline_rounds.py's input checks (its toy run is part of the GPU driver's test)
and bench/cond_rounds.py's reading of a conditional program's rounds per rank."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_rounds_refuses_bad_input():
    """(Its every variant runs at toy shapes in test_bench_gpu.py's driver test.)"""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    bad = subprocess.run([sys.executable, "-m", "bench.pipeline_rounds", "--rounds", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_cond_rounds_charges_each_rank_its_own_branches():
    """Per rank, the slots of its rows at their taken or idle branch: over the step every
    rank runs m F and m B slots, the last stage's B slots the head's taken branch too (the
    others its idle one), the embedding's taken in the first stage's; spread, the head's
    time / p on every rank in the rounds that run it instead."""
    from bench.cond_rounds import round_seconds
    from jaxptd.pipeline.executor import rounds_for

    p, m = 4, 6
    rounds = rounds_for("1f1b", p, m, 1, "cond")
    piece = {True: 0.0, False: 0.0}
    slots = {"f": {"run": 1.0, "idle": 0.25, "embed": {True: 8.0, False: 0.0},
                   "head": piece},
             "b": {"run": 2.0, "idle": 0.5, "embed": piece, "head": {True: 16.0, False: 4.0}}}
    idle = rounds.num_rounds - m  # each rank's idle F (and B) slots
    totals = [sum(column) for column in zip(*round_seconds(rounds, slots))]
    head = [16.0 * m if r == p - 1 else 4.0 * m for r in range(p)]
    embed = [8.0 * m if r == 0 else 0.0 for r in range(p)]
    assert totals == [m * 3.0 + idle * 0.75 + h + e for h, e in zip(head, embed)]
    spread = [sum(column) for column in zip(*round_seconds(rounds, slots, spread=True))]
    assert spread == [m * 3.0 + idle * 0.75 + m * 16.0 / p + e for e in embed]
