"""bench/pipeline_rounds.py's input checks (its toy run is part of the GPU driver's test)."""
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
