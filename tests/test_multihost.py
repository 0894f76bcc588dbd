"""Multi-process training: launchers, SLURM, checkpoints across layouts, preemption, faults.

The reference is the single-process program (this pytest process, 8 simulated devices):
`Setup` + the jitted step over the same batches `train.py` reads. Multi-process runs go
through `launch/local.sh` (4 processes x 2 devices) or a real single-node SLURM cluster
(`launch/slurm/local_cluster.sh`; skipped when SLURM is not installed; the CI script
`launch/slurm/install.sh` installs it; .ci/run calls that): a preempted job requeued, and
restarted on half the processes. Losses must match in fp32 to rtol 1e-5 (1e-6 for SLURM).
A process lost or hung, SIGTERM to one process, a second run on a run directory in use,
the local checkpoint tier: tests/test_faults.py's sequence of launches.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import walk_faults
from jaxptd.checkpoint.integrity import inspect
from jaxptd.checkpoint.store import Checkpointer
from jaxptd.config import load_config
from jaxptd.data import TokenDataset, resolve_corpus
from jaxptd.parallel.mesh import make_mesh
from jaxptd.train.step import Setup, build_train_step
from jaxptd.train.loop import global_batch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=8", "model.hidden_size=32", "model.num_heads=8", "model.seq_len=16",
        "model.vocab_size=300", "train.global_batch=16", "optimizer.warmup_steps=1",
        "parallel.microbatches=2", "train.log_every=1", "train.eval_every=0"]
STEPS = 6
# (data, pipe, tensor, chunks) of the 4-process run: 2 devices per process, tensor inside
# one (pipe 1, data 4 is tests/test_faults.py's sequence); PIPE1: a restore target.
LAUNCH_LAYOUTS = {"pipe2": (2, 2, 2, 1)}
PIPE1 = (4, 1, 2, 1)
SOURCE = ("pipe2", False)  # the layout and zero1 of the checkpoint the restore matrix reads


def overrides(layout, zero1=False, steps=STEPS, extra=()):
    data, pipe, tensor, chunks = layout
    schedule = ["parallel.schedule=interleaved"] if chunks > 1 else []
    return TINY + [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}",
                   f"parallel.chunks={chunks}", f"optimizer.zero1={zero1}",
                   f"train.steps={steps}", *schedule, *extra]


def setup_for(args):
    config = load_config(None, args)
    return Setup(config, make_mesh(config.parallel, jax.devices()[: config.num_devices]))


def run_steps(setup, state, start, stop):
    """Losses of steps start+1..stop, reading the batches train.py reads."""
    config = setup.config
    dataset = TokenDataset(resolve_corpus(config.data.path), "train")
    step_fn, losses = build_train_step(setup), []
    for step in range(start, stop):
        state, out = step_fn(state, global_batch(setup, dataset, config.train.seed, step))
        losses.append(float(out["loss"]))
    return losses


_REFERENCE = {}


def reference_losses(args):
    """The single-process run: losses of every step, cached per config."""
    key = tuple(args)
    if key not in _REFERENCE:
        setup = setup_for(args)
        _REFERENCE[key] = run_steps(setup, setup.state_layout.init_state(setup.config.train.seed), 0,
                                    setup.config.train.steps)
    return _REFERENCE[key]


def env():
    return {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(ROOT)}


def launch(nproc, args, run_dir, out=None, extra_env=()):
    """Starts launch/local.sh; returns the Popen (stdout and stderr to `out`, by default
    run_dir/out.txt; `extra_env` added to its environment)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(out or run_dir / "out.txt", "w")
    return subprocess.Popen(
        [str(ROOT / "launch/local.sh"), str(nproc), "-", *args, f"train.run_dir={run_dir}"],
        stdout=out, stderr=subprocess.STDOUT, env={**env(), **dict(extra_env)}, cwd=ROOT,
        start_new_session=True)


def losses_of(run_dir):
    """{step: loss} from a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def wait_for_step(run_dir, step, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while max(losses_of(run_dir), default=0) < step:
        assert proc.poll() is None, (run_dir / "out.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "run too slow"
        time.sleep(0.1)


def rank_pid(launcher_pid, rank):
    """The pid of the training process `rank` started by launch/local.sh."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher_pid and f"JAXPTD_PROCESS_ID={rank}".encode() in environ \
                and b"PYTHON=" + sys.executable.encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process {rank} under launcher {launcher_pid}")


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """4-process runs of LAUNCH_LAYOUTS (saving every 3 steps), started once each."""
    resolve_corpus("pystdlib")  # prepared once here, not by 4 processes at once
    runs = {}

    def get(name, zero1):
        if (name, zero1) not in runs:
            args = overrides(LAUNCH_LAYOUTS[name], zero1, extra=["checkpoint.every=3"])
            reference_losses(overrides(LAUNCH_LAYOUTS[name], zero1))  # skips if not ready
            run_dir = tmp_path_factory.mktemp(f"local-{name}")
            proc = launch(4, args, run_dir)
            assert proc.wait(timeout=300) == 0, (run_dir / "out.txt").read_text()[-3000:]
            runs[(name, zero1)] = run_dir
        return runs[(name, zero1)]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAUNCH_LAYOUTS))
def test_local_launch_matches_single_process(launched, name):
    zero1 = SOURCE[1] if name == SOURCE[0] else False
    run_dir = launched(name, zero1)
    losses = losses_of(run_dir)
    assert_close([losses[s] for s in range(1, STEPS + 1)],
                 reference_losses(overrides(LAUNCH_LAYOUTS[name], zero1)))
    records = inspect(str(run_dir / "checkpoints"))
    assert [(r["step"], r["status"]) for r in records] == [(3, "complete"), (6, "complete")]
    out = (run_dir / "out.txt").read_text()  # only process 0 speaks; no gloo chatter
    assert "peer ranks" not in out and not any(line.startswith(("[1]", "[2]", "[3]"))
                                               for line in out.splitlines()), out[-3000:]
    data, pipe, tensor, chunks = LAUNCH_LAYOUTS[name]
    assert {k: records[0]["layout"][k] for k in ("data", "pipe", "tensor", "chunks",
                                                  "processes")} == \
        dict(data=data, pipe=pipe, tensor=tensor, chunks=chunks, processes=4)


# Targets: (data, pipe, tensor, chunks), zero1; the matrix from (2, 2, 2, 1). All in
# this single process; (1, 1, 1, 1) is one device.
RESTORE_TARGETS = [((1, 2, 4, 1), False), ((2, 4, 1, 2), True), ((1, 1, 1, 1), False)]


@pytest.mark.slow
@pytest.mark.parametrize("target,zero1", RESTORE_TARGETS, ids=lambda v: str(v))
def test_restore_into_another_layout(launched, target, zero1):
    expected = reference_losses(overrides(LAUNCH_LAYOUTS[SOURCE[0]], SOURCE[1]))
    source = launched(*SOURCE)
    setup = setup_for(overrides(target, zero1))
    ckpt = Checkpointer(str(source / "checkpoints"), 0, 3)
    state = setup.state_layout.state_from_logical(
        ckpt.restore(setup.state_layout.abstract_state(logical=True), 3, setup.config.model.vocab_size))
    ckpt.close()
    assert int(state["step"]) == 3
    assert state["params"]["embed"]["wte"].shape[-2] == setup.vocab  # ([p,] V, h)
    assert_close(run_steps(setup, state, 3, STEPS), expected[3:])


def _restore_latest(directory):
    setup = setup_for(overrides(PIPE1, True))
    ckpt = Checkpointer(str(directory), 0, 3)
    try:
        return ckpt.restore_latest(setup.state_layout.abstract_state(logical=True), 300)
    finally:
        ckpt.close()


@pytest.mark.slow
def test_half_written_and_corrupt_steps_are_skipped(launched, tmp_path, capfd):
    directory = tmp_path / "checkpoints"
    shutil.copytree(launched(*SOURCE) / "checkpoints", directory)
    # A save killed halfway: Orbax's temporary directory, never renamed.
    half = directory / "9.orbax-checkpoint-tmp-1234"
    shutil.copytree(directory / "6", half)
    (half / "_CHECKPOINT_METADATA").unlink()
    state, step = _restore_latest(directory)
    assert step == 6 and int(state["step"]) == 6
    assert f"removed half-written checkpoint {half}" in capfd.readouterr().err
    assert not half.exists()
    # A complete-looking step with a truncated data file: reported, set aside, step 3 used.
    data_file = max((directory / "6" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[:10])
    state, step = _restore_latest(directory)
    assert step == 3 and int(state["step"]) == 3
    err = capfd.readouterr().err
    assert "checkpoint step 6 is damaged" in err, err
    assert (directory / "6.corrupt").is_dir() and not (directory / "6").exists()
    statuses = {r["step"]: r["status"] for r in inspect(str(directory)) if r["step"] != 9}
    assert statuses == {3: "complete", 6: "corrupt"}


@pytest.mark.slow
def test_every_fault_in_a_multi_process_step_resumes_from_a_good_step(launched, tmp_path,
                                                                     capfd):
    """The walk of tests/test_checkpoint.py over a step written by 4 processes: every
    process's files, each damaged one of the four ways in turn (the single-process walk
    does all four to every kind of file), restored here at another layout."""
    source = launched(*SOURCE) / "checkpoints"
    states = {step: _restore_step(source, step) for step in (3, 6)}
    outcomes = walk_faults(source, 6, tmp_path, _restore_latest, states, capfd, rotate=True)
    damaged = {rel for (rel, _), step in outcomes.items() if step == 3}
    assert {"state/_METADATA", "layout/metadata"} <= damaged
    assert {f"state/array_metadatas/process_{i}" for i in range(4)} <= damaged
    assert any(f"ocdbt.process_{i}/d/" in rel for rel in damaged for i in range(1, 4))


def _restore_step(directory, step):
    setup = setup_for(overrides(PIPE1, True))
    ckpt = Checkpointer(str(directory), 0, 3)
    try:
        return jax.device_get(ckpt.restore(setup.state_layout.abstract_state(logical=True), step, 300))
    finally:
        ckpt.close()


def slurm_cluster(tmp_path):
    """Starts the local single-node cluster, or skips with the reason."""
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        pytest.skip("SLURM is not installed (launch/slurm/install.sh installs it)")
    result = subprocess.run([str(ROOT / "launch/slurm/local_cluster.sh"), "start",
                             str(tmp_path / "slurm")], capture_output=True, text=True,
                            timeout=60)
    if result.returncode:
        pytest.skip(f"SLURM could not start: {result.stderr.strip()[-500:]}")
    return result.stdout.strip().split("=", 1)[1]


def slurm(job_env, *args) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, env=job_env,
                          timeout=60).stdout


def submit(job_env, tasks, args, output) -> str:
    """Submits launch/slurm/submit.sh with `tasks` processes on the one node -> job id."""
    job_env = {**job_env, "SBATCH_ARGS": " ".join([
        "--nodes=1", f"--ntasks={tasks}", f"--ntasks-per-node={tasks}", "--cpus-per-task=1",
        "--gpus-per-node=0", "--overcommit", "--time=10", f"--chdir={ROOT}",
        f"--output={output}", "--export=ALL"])}
    done = subprocess.run([str(ROOT / "launch/slurm/submit.sh"), "-", *args],
                          capture_output=True, text=True, env=job_env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def job_field(job_env, job, name) -> str:
    found = re.search(rf"\b{name}=(\S+)", slurm(job_env, "scontrol", "show", "job", job))
    return found.group(1) if found else ""


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


SLURM_STEPS = 8


def slurm_args(data, steps, extra=()):
    """TINY with 2 layers (a shorter compile): 2 microbatches of 2 sequences at data 4."""
    return TINY + ["model.num_layers=2", f"parallel.data={data}", "parallel.tensor=2",
                   f"train.steps={steps}", "checkpoint.every=100", *extra]


@pytest.mark.slow
def test_slurm_preemption_requeues_and_a_half_size_restart_keeps_the_loss_curve(tmp_path):
    """A 4-process sbatch job gets USR1 (what --signal=B:USR1@120 sends before the time
    limit): it saves, requeues itself and the requeued job resumes with no step lost; then
    a job with half the processes and one override (parallel.data=2, with train.steps to
    go on) restores into data 2, in twice the microbatches of the same size, the same
    global batch and the single-process run's losses to 1e-6."""
    resolve_corpus("pystdlib")
    expected = reference_losses(slurm_args(4, SLURM_STEPS + 3,
                                           [f"optimizer.decay_steps={SLURM_STEPS}"]))
    job_env = {**env(), "SLURM_CONF": slurm_cluster(tmp_path)}
    run_dir, log = tmp_path / "run", tmp_path / "slurm.out"
    try:
        job = submit(job_env, 4, [*slurm_args(4, SLURM_STEPS), f"train.run_dir={run_dir}"],
                     log)
        wait_until(lambda: max(losses_of(run_dir), default=0) >= 2, 300, "job too slow")
        slurm(job_env, "scancel", "--batch", "--signal=USR1", job)
        wait_until(lambda: job_field(job_env, job, "Restarts") == "1", 120, "no requeue")
        # SLURM revokes the job's credential at the requeue, to the second: a start within
        # that second is killed ("Job credential revoked", the job FAILED)
        time.sleep(2)
        slurm(job_env, "scontrol", "update", f"jobid={job}", "StartTime=now")  # not 2 min
        wait_until(lambda: job_field(job_env, job, "JobState") in ("COMPLETED", "FAILED"),
                   600, "the requeued job did not finish")  # (4 processes on 2 busy cores)
        assert job_field(job_env, job, "JobState") == "COMPLETED", log.read_text()[-3000:]
        first = log.read_text()
        half = submit(job_env, 2, [*slurm_args(2, SLURM_STEPS + 3),
                                   f"train.run_dir={run_dir}"], tmp_path / "half.out")
        wait_until(lambda: job_field(job_env, half, "JobState") in ("COMPLETED", "FAILED"),
                   600, "the half-size job did not finish")
        second = (tmp_path / "half.out").read_text()
        assert job_field(job_env, half, "JobState") == "COMPLETED", second[-3000:]
    finally:
        subprocess.run([str(ROOT / "launch/slurm/local_cluster.sh"), "stop",
                        str(tmp_path / "slurm")], timeout=60)
    saved = int(re.search(r"preempted \(SIGUSR1\): saving step (\d+) and exiting",
                          first).group(1))
    before = first[:first.index("preempted (SIGUSR1)")]
    trained = max(int(s) for s in re.findall(r"^step +(\d+)/", before, re.M))
    assert trained == saved < SLURM_STEPS  # no step lost
    assert f"resumed from step {saved}" in first and first.count("4 processes, 8 devices") == 2
    assert f"resumed from step {SLURM_STEPS}" in second and "2 processes, 4 devices" in second
    assert "parallel.data 4 -> 2: parallel.microbatches 2 -> 4 keeps the checkpoint's " \
        "microbatch size (2 sequences) and train.global_batch=16" in second, second[-3000:]
    losses = losses_of(run_dir)
    assert sorted(losses) == list(range(1, SLURM_STEPS + 4))
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], expected, rtol=1e-6)


def test_missing_process_is_named_at_start_up(tmp_path):
    """3 of 4 processes start: each ends with an error; process 0 names process 3."""
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxptd.train", *overrides(PIPE1),
         "runtime.init_timeout_s=3", "checkpoint.every=0", f"train.run_dir={tmp_path}"],
        env={**env(), "JAXPTD_COORDINATOR": "localhost:23457", "JAXPTD_NUM_PROCESSES": "4",
             "JAXPTD_PROCESS_ID": str(rank)}, stderr=subprocess.PIPE, text=True)
        for rank in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2, 2], errors
    assert "processes [3] of 4 never arrived at localhost:23457 (arrived: [0, 1, 2])" in errors[0]
