"""The SLURM template's environment and the GPU step's XLA options: every option of
jaxptd/runtime/target.py parses on the installed jaxlib (an unknown flag stops XLA at start-up),
a newer XLA that lacks one compiles the step without it, the template sets the memory fraction the planner assumes, and no PyTorch-only variable
is left in it. The template's requeue: after USR1 (the signal before the time limit) and
after a failure, a few times (stand-ins for srun and scontrol record what it does)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

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


# Stand-ins: srun records its arguments and environment, then exits with SRUN_STATUS, or
# with SRUN_USR1 set waits for USR1 (as the training processes save on it) and exits 0;
# scontrol records its arguments.
SRUN = """#!/bin/bash
printf "%s\\n" "$@" > "$RECORD.args"
env > "$RECORD.env"
if [ -n "${SRUN_USR1:-}" ]; then
  sleep 30 &
  trap 'echo USR1 > "$RECORD.usr1"; kill $!; exit 0' USR1
  touch "$RECORD.ready"
  wait $!
  exit 1
fi
exit "${SRUN_STATUS:-0}"
"""
SCONTROL = '#!/bin/sh\necho "$@" >> "$RECORD.scontrol"\n'


def start_sbatch(tmp_path, env=()):
    """The template started by bash with the stand-ins first on PATH -> its Popen."""
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "SLURM_RESTART_COUNT")}
    return subprocess.Popen(["bash", SBATCH, "configs/gpt_tiny.yaml", "train.steps=3"],
                            env={**base, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                                 "RECORD": str(tmp_path / "srun"), "SLURM_JOB_ID": "17",
                                 **dict(env)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def recorded(tmp_path, name) -> str:
    path = tmp_path / f"srun.{name}"
    return path.read_text() if path.exists() else ""


def run_sbatch(tmp_path, env=()) -> dict:
    """The template run by bash with a stand-in `srun` that records what it was given:
    {"args": srun's arguments, "env": the environment the training processes get}."""
    done = start_sbatch(tmp_path, env)
    _, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    seen = recorded(tmp_path, "env").splitlines()
    return {"args": recorded(tmp_path, "args").splitlines(),
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


def test_sbatch_saves_on_usr1_and_requeues(tmp_path):
    """`--signal=B:USR1@...` signals the batch shell: it passes USR1 to srun (the training
    processes agree on a step, save it and exit 0), then requeues the job."""
    text = open(SBATCH).read()
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", text, re.M), text
    assert re.search(r"^#SBATCH --requeue$", text, re.M), text
    job = start_sbatch(tmp_path, {"SRUN_USR1": "1"})
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.ready").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert recorded(tmp_path, "usr1") == "USR1\n"
    assert recorded(tmp_path, "scontrol") == "requeue 17\n"


@pytest.mark.parametrize("status,restarts,requeued", [
    (75, 0, True),  # a process lost or hung
    (137, 2, True),  # one killed
    (75, 3, False),  # JAXPTD_MAX_RESTARTS=3 spent
    (2, 0, False),  # a user error: a restart would fail the same way
    (130, 0, False),  # interrupted
    (0, 0, False),  # done
])
def test_sbatch_requeues_a_failed_job_a_few_times(tmp_path, status, restarts, requeued):
    job = start_sbatch(tmp_path, {"SRUN_STATUS": str(status),
                                  "SLURM_RESTART_COUNT": str(restarts)})
    _, err = job.communicate(timeout=60)
    assert recorded(tmp_path, "scontrol") == ("requeue 17\n" if requeued else ""), err
    assert job.returncode == (0 if requeued else status)
    args = recorded(tmp_path, "args").splitlines()  # the others end on their own first
    assert args[:2] == ["--kill-on-bad-exit=0", "--wait=30"]
