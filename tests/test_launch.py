"""The SLURM template's environment and the GPU step's XLA options: every option of
jaxptd/target.py parses on the installed jaxlib (an unknown flag stops XLA at start-up),
the template sets the memory fraction the planner assumes, and no PyTorch-only variable
is left in it."""
import os
import re
import subprocess
import sys

from jaxptd.target import GPU_XLA_FLAGS, MEM_FRACTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")


def test_gpu_xla_options_parse_on_this_jaxlib():
    flags = list(GPU_XLA_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_no_such_flag=true")  # the check can fail
    assert subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=bad,
                          capture_output=True, timeout=120).returncode != 0


def test_sbatch_sets_the_memory_fraction_the_planner_assumes():
    fraction = re.search(r"XLA_PYTHON_CLIENT_MEM_FRACTION:-([\d.]+)", open(SBATCH).read())
    assert float(fraction.group(1)) == MEM_FRACTION
    assert "--xla_" not in open(SBATCH).read()  # the step's own compile options, not XLA_FLAGS


def test_sbatch_sets_no_pytorch_variables():
    assert "TORCH_" not in open(SBATCH).read()
