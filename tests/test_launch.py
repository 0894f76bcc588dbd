"""The SLURM template's environment and the GPU step's XLA options: every option of
jaxptd/runtime/target.py parses on the installed jaxlib (an unknown flag stops XLA at start-up),
a newer XLA that lacks one compiles the step without it, the template sets the memory fraction the planner assumes, and no PyTorch-only variable
is left in it."""
import json
import os
import subprocess
import sys

import pytest

from jaxptd.runtime.target import (GPU_XLA_FLAGS, MEM_FRACTION, PIPELINE_XLA_FLAGS, TARGETS,
                           compile_lowered)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")


def test_gpu_xla_options_parse_on_this_jaxlib():
    flags = list(GPU_XLA_FLAGS + PIPELINE_XLA_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_no_such_flag=true")  # the check can fail
    assert subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=bad,
                          capture_output=True, timeout=120).returncode != 0


def test_compile_leaves_out_options_this_xla_lacks(capsys):
    """jax 0.11.2 on an H100 refused the whole step over two options 0.10.2 has
    (xla_gpu_enable_pipelined_all_reduce/_all_gather): the step compiles without them and
    says so; an option it knows stays, and an error of another kind still raises."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    compiled = compile_lowered(lowered, {"xla_no_such_option_a": True,
                                         "xla_cpu_enable_fast_math": False,
                                         "xla_no_such_option_b": 1})
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    err = capsys.readouterr().err
    assert "xla_no_such_option_a" in err and "xla_no_such_option_b" in err
    assert "fast_math" not in err
    with pytest.raises(Exception, match="xla_cpu_enable_fast_math"):
        compile_lowered(lowered, {"xla_cpu_enable_fast_math": "not a bool"})


def run_sbatch(tmp_path, env=()) -> dict:
    """The template run by bash with a stand-in `srun` that records what it was given:
    {"args": srun's arguments, "env": the environment the training processes get}."""
    (tmp_path / "srun").write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD.args"\nenv > "$RECORD.env"\n')
    (tmp_path / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")}
    done = subprocess.run(["bash", SBATCH, "configs/gpt_tiny.yaml", "train.steps=3"],
                          env={**base, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                               "RECORD": str(tmp_path / "srun"), **dict(env)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = (tmp_path / "srun.env").read_text().splitlines()
    return {"args": (tmp_path / "srun.args").read_text().splitlines(),
            "env": dict(line.split("=", 1) for line in seen if "=" in line)}


def test_sbatch_sets_the_memory_fraction_the_planner_assumes(tmp_path):
    """The processes srun starts get XLA_PYTHON_CLIENT_MEM_FRACTION = MEM_FRACTION unless
    the site sets its own; the planner's H100 budget is that fraction of the device; no
    XLA_FLAGS (the step passes its own compile options); the config and overrides reach
    jaxptd.train."""
    ran = run_sbatch(tmp_path)
    assert float(ran["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == MEM_FRACTION
    assert "XLA_FLAGS" not in ran["env"]
    args = ran["args"]
    assert args[args.index("-m"):] == ["-m", "jaxptd.train", "--config",
                                       "configs/gpt_tiny.yaml", "train.steps=3"]
    site = run_sbatch(tmp_path, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"})
    assert site["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
    planned = subprocess.run([sys.executable, "-m", "jaxptd.plan", "--config",
                              os.path.join(ROOT, "configs", "gpt_tiny.yaml"), "--target",
                              "h100", "--json"], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
    assert planned.returncode == 0, planned.stderr[-500:]
    assert json.loads(planned.stdout)["memory_limit_gb"] * 1e9 == pytest.approx(
        MEM_FRACTION * TARGETS["h100"].memory)
    assert "--xla_" not in open(SBATCH).read()  # the step's own compile options, not XLA_FLAGS


def test_sbatch_sets_no_pytorch_variables():
    assert "TORCH_" not in open(SBATCH).read()
