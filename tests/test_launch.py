"""The SLURM template's environment: every XLA flag it sets parses on the installed jaxlib
(an unknown flag stops XLA at start-up), and no PyTorch-only variable is left in it."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")


def sbatch_xla_flags() -> list:
    text = open(SBATCH).read()
    block = re.search(r"^xla=\((.*?)^\)", text, re.S | re.M).group(1)
    return re.findall(r"^\s*(--xla_\S+)", block, re.M)


def test_sbatch_xla_flags_parse_on_this_jaxlib():
    flags = sbatch_xla_flags()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_enable_pipelined_p2p=true" in flags
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_no_such_flag=true")  # the check can fail
    assert subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=bad,
                          capture_output=True, timeout=120).returncode != 0


def test_sbatch_sets_no_pytorch_variables():
    assert "TORCH_" not in open(SBATCH).read()
