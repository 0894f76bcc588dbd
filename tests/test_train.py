"""End to end through `python -m jaxptd.train` in subprocesses: metrics and checkpoints of a
short run, what it prints and writes (progress, log, config, TensorBoard), a real SIGKILL
and a bitwise-identical resume, a half-written checkpoint ignored, reruns and resumes
(nothing to train, changed settings, one metrics record per step), SIGINT, a full disk,
one-line errors for bad input before device work. The default config's own run (its
convergence, the README's table and sample output) is tests/test_readme.py's.

Every run gets its own run_dir and checkpoint.dir under tmp; the built-in stdlib corpus is
prepared once per session into a session cache ($JAXPTD_CACHE). Every subprocess has a
timeout, so a hang fails instead of blocking CI.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per training subprocess on a shared 2-core machine
STEPS = 12
# A small (data 2, tensor 4) model; decay_steps is explicit so runs of different
# train.steps follow the same learning-rate schedule (the killed run is longer).
BASE = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_len=32",
    "train.global_batch=8", "parallel.data=2", "parallel.tensor=4", "train.log_every=1",
    "train.eval_every=6", "train.eval_batches=1", "checkpoint.every=3", "checkpoint.keep=10",
    "optimizer.warmup_steps=2", "optimizer.decay_steps=100",
]
RECORD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
               "tflops_per_device", "mfu"}
TMP_MARK = ".orbax-checkpoint-tmp"


def train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxptd.train", *args]


def run_train(env, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(*args), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def dirs(tmp: Path, name: str) -> list[str]:
    return [f"train.run_dir={tmp / name}", f"checkpoint.dir={tmp / 'ckpt'}"]


def records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def complete_steps(directory: Path) -> list[int]:
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(corpus_env, tmp_path_factory):
    """An uninterrupted run of STEPS steps: (run_dir, checkpoint dir, result)."""
    env, _ = corpus_env
    tmp = tmp_path_factory.mktemp("reference")
    result = run_train(env, *BASE, f"train.steps={STEPS}", *dirs(tmp, "run"))
    assert_ok(result)
    return tmp / "run", tmp / "ckpt", result


def test_short_run_writes_metrics_and_checkpoints(reference):
    run_dir, ckpt, _ = reference
    steps = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        assert RECORD_KEYS <= set(record), record
        assert record["mfu"] is None  # no known peak FLOP/s on CPU
        for key in RECORD_KEYS - {"mfu", "step"}:
            assert math.isfinite(record[key]) and record[key] >= 0, (key, record)
        assert record["tokens_per_s"] > 0 and record["tflops_per_device"] > 0
    assert steps[0]["loss"] == pytest.approx(math.log(257), abs=0.3)  # near ln(vocab) at init
    vals = [r for r in records(run_dir) if "val_loss" in r]
    assert [r["step"] for r in vals] == [6, 12]
    for record in vals:
        assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]), rel=1e-6)
    assert complete_steps(ckpt) == [3, 6, 9, 12]
    assert not [name for name in os.listdir(ckpt) if TMP_MARK in name]


@pytest.mark.slow
def test_killed_run_resumes_bitwise(corpus_env, reference, tmp_path):
    """SIGKILL once a complete checkpoint exists; the rerun resumes from the newest complete
    step and its losses equal the uninterrupted run's, bit for bit."""
    env, _ = corpus_env
    ckpt = tmp_path / "ckpt"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(train_command(*BASE, "train.steps=100000", *dirs(tmp_path, "a")),
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                if ckpt.is_dir() and complete_steps(ckpt):
                    break
                time.sleep(0.02)
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert complete_steps(ckpt), "no complete checkpoint before the deadline"
        finally:
            proc.kill()  # SIGKILL: no handler, no final save
            proc.wait(timeout=60)
    assert proc.returncode == -9
    last = max(complete_steps(ckpt))
    assert last < STEPS, f"the killed run got to step {last} before the kill"

    result = run_train(env, *BASE, f"train.steps={STEPS}", *dirs(tmp_path, "b"))
    assert_ok(result)
    assert f"resumed from step {last}" in result.stdout, result.stdout[-3000:]
    expected = {s: v for s, v in losses(reference[0]).items() if s > last}
    assert losses(tmp_path / "b") == expected


# --------------------------------------------------------------------------- what a run says


def tensorboard_scalars(directory: Path) -> dict[str, list[int]]:
    """{tag: steps} from TensorBoard event files (TFRecords of Event protos)."""
    import struct
    from tensorboardX.proto import event_pb2
    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(event.step)
    return scalars


def test_run_prints_progress_and_writes_log_config_and_tensorboard(reference):
    from jaxptd.config import load_config
    run_dir, ckpt, result = reference
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")
                and f"/{STEPS} (" in line]
    assert [int(line.split()[1].split("/")[0]) for line in progress] == list(range(1, STEPS + 1))
    for line in progress:
        assert all(part in line for part in ("loss ", " tok/s", "elapsed ", "left ")), line
    assert "\r" not in result.stdout
    saved = [line for line in result.stdout.splitlines() if line.startswith("checkpoint: step")]
    assert sorted(int(line.split()[2]) for line in saved) == [3, 6, 9, 12], result.stdout
    assert all(" MB)" in line or " KB)" in line for line in saved), saved
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"done: step {STEPS}/{STEPS}, {STEPS} steps") and \
        "best val loss" in summary and str(run_dir) in summary, summary
    log = (run_dir / "train.log").read_text().splitlines()
    stamped = [line for line in log if not line.startswith(" ")]
    assert all(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S") for line in stamped)
    assert sum(f"/{STEPS} (" in line for line in log) == STEPS
    config = load_config(str(run_dir / "config.yaml"))
    assert config == load_config(None, [*BASE, f"train.steps={STEPS}", *dirs(run_dir.parent,
                                                                            "run")])
    starts = list((run_dir / "starts").iterdir())  # the start's record: config.yaml's copy
    assert [p.name.split("-")[0] for p in starts] == ["0"], starts
    assert starts[0].read_text() == (run_dir / "config.yaml").read_text()
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["train/loss"] == list(range(1, STEPS + 1))
    assert scalars["val/loss"] == [6, 12] and "perf/tokens_per_s" in scalars


def read_tree(directory: Path, *names: str) -> dict[str, bytes]:
    """{path: bytes} of the files `names` (files or directories) under directory."""
    paths = [p for name in names for p in [directory / name, *(directory / name).rglob("*")]]
    return {str(p.relative_to(directory)): p.read_bytes() for p in paths if p.is_file()}


def copy_run(reference, tmp_path) -> None:
    shutil.copytree(reference[0], tmp_path / "run")
    shutil.copytree(reference[1], tmp_path / "ckpt")


def test_rerun_of_a_finished_run_says_so_and_names_changed_settings(corpus_env, reference,
                                                                   tmp_path):
    env, _ = corpus_env
    copy_run(reference, tmp_path)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    configs = read_tree(tmp_path / "run", "config.yaml", "starts")
    result = run_train(env, *BASE, f"train.steps={STEPS}", *dirs(tmp_path, "run"),
                       "optimizer.lr=0.002", "train.seed=1", "train.log_every=3")
    assert_ok(result)
    assert f"nothing to train: the checkpoint in {tmp_path / 'ckpt'} is at step {STEPS} and " \
        f"train.steps={STEPS}; raise train.steps" in result.stdout, result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "optimizer.lr 0.001 -> 0.002" in warnings[0] and \
        "train.seed 0 -> 1" in warnings[0] and "log_every" not in warnings[0], result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    # a start that trains nothing records no config: the checkpoints' stays
    assert read_tree(tmp_path / "run", "config.yaml", "starts") == configs


@pytest.mark.slow
def test_resume_ignores_a_half_written_save_keeps_one_record_per_step_and_evaluates(
        corpus_env, reference, tmp_path):
    """Resume at step 6 of a run whose metrics reach step 12 and lack step 6's validation
    (a kill between saving and evaluating), a killed save of step 9 beside it: the
    half-written step is ignored and removed (not skipped forever), records past 6 are
    replaced, 6 is evaluated."""
    env, _ = corpus_env
    copy_run(reference, tmp_path)
    for step in (9, 12):
        shutil.rmtree(tmp_path / "ckpt" / str(step))
    junk = tmp_path / "ckpt" / f"9{TMP_MARK}-1234"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "manifest.ocdbt").write_bytes(os.urandom(256))
    (junk / "_CHECKPOINT_METADATA").write_text("{not json")
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                            if json.loads(line) != next(r for r in records(reference[0])
                                                        if r.get("val_loss") and r["step"] == 6)))
    import importlib.util
    wandb = [] if importlib.util.find_spec("wandb") else ["train.wandb_project=jaxptd-test"]
    result = run_train(env, *BASE, f"train.steps={STEPS}", *dirs(tmp_path, "run"), *wandb)
    assert_ok(result)
    assert "resumed from step 6" in result.stdout, result.stdout[-3000:]
    assert not junk.exists()
    if wandb:  # asked for, not installed: said once, TensorBoard goes on
        assert result.stderr.count("wandb is not installed") == 1, result.stderr
    kinds = [("val" if "val_loss" in r else "event" if "event" in r else "train", r["step"])
             for r in records(tmp_path / "run")]
    assert len(kinds) == len(set(kinds)), kinds
    assert sorted(s for k, s in kinds if k == "train") == list(range(1, STEPS + 1))
    assert sorted(s for k, s in kinds if k == "val") == [6, 12]
    reference_vals = {r["step"]: r["val_loss"] for r in records(reference[0]) if "val_loss" in r}
    vals = {r["step"]: r["val_loss"] for r in records(tmp_path / "run") if "val_loss" in r}
    assert vals == reference_vals and losses(tmp_path / "run") == losses(reference[0])


def start_and_wait(env, tmp_path, name, step=2, extra=()):
    """A long run started in the background, returned once it has logged `step`."""
    run_dir = tmp_path / name
    log = open(tmp_path / f"{name}.out", "w")
    proc = subprocess.Popen(train_command(*BASE, "train.steps=100000", "train.eval_every=0",
                                          f"train.run_dir={run_dir}",
                                          f"checkpoint.dir={tmp_path / name / 'ckpt'}", *extra),
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not (run_dir / "metrics.jsonl").exists() or max(losses(run_dir), default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp_path / f"{name}.out").read_text()[-3000:]
        time.sleep(0.05)
    return proc, run_dir


@pytest.mark.slow
def test_sigint_saves_the_step_and_exits_130(corpus_env, tmp_path):
    from jaxptd.checkpoint.integrity import inspect
    env, _ = corpus_env
    proc, run_dir = start_and_wait(env, tmp_path, "run")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    out = (tmp_path / "run.out").read_text()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupt again to exit at once" in err, err
    saved = max(losses(run_dir))
    assert f"interrupted (SIGINT): saving step {saved} and exiting" in out, out[-2000:]
    assert [(r["step"], r["status"]) for r in inspect(str(run_dir / "ckpt"))] == \
        [(saved, "complete")]


def test_second_sigint_exits_at_once_even_inside_a_long_call():
    """After the first SIGINT's notice, a second one ends the process although its main
    thread is blocked in a call that does not return (a Python handler would wait)."""
    code = ("import threading; from jaxptd.runtime.preemption import Preemption; Preemption(); "
            "print('ready', flush=True); threading.Event().wait(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert "interrupt again" in proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGINT  # the shell reports it as 130


@pytest.mark.slow
def test_full_disk_is_one_error_line_and_earlier_steps_restore(corpus_env, small_disk,
                                                              tmp_path):
    """Checkpoints of ~1.6 MB every step on 4 MB: the second or third save finds the disk
    full; freed as the error line says, the rerun restores the last intact step. (Without
    freeing, what a failed save leaves free depends on how Orbax grouped the kept steps'
    files, each a whole page on tmpfs: under the rerun's 64 KB probe on CI once.)"""
    from jaxptd.checkpoint.integrity import inspect
    env, _ = corpus_env
    args = [*BASE, "checkpoint.every=1", "train.eval_every=0", f"checkpoint.dir={small_disk}",
            f"train.run_dir={tmp_path / 'run'}"]
    filler = small_disk / ".filler"  # (a dot file: not a step, as the probe's own file)
    filler.write_bytes(bytes(256 << 10))
    result = run_train(env, *args, "train.steps=20")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1 and len(errors) == 1, result.stderr
    assert f"checkpoint.dir={small_disk}: no space left on device" in errors[0]
    assert "bytes)" in errors[0] and " intact; free space or lower checkpoint.keep" in errors[0], \
        errors[0]
    records = inspect(str(small_disk))
    kept = [r["step"] for r in records]
    assert kept and all(r["status"] == "complete" for r in records), records
    filler.unlink()
    rerun = run_train(env, *args, f"train.steps={max(kept)}")
    assert_ok(rerun)
    assert f"is at step {max(kept)}" in rerun.stdout, rerun.stdout


# --------------------------------------------------------------------------- run directory

# One device and a small model: these runs test what a run does with its directories.
ONE = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16",
       "train.global_batch=2", "parallel.data=1", "parallel.tensor=1", "train.log_every=1",
       "train.eval_every=0", "optimizer.warmup_steps=1"]


def error_line(result: subprocess.CompletedProcess) -> str:
    """The single `error:` line of a refused run (exit 2, no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_rerun_without_saving_restores_and_adds_to_the_history(corpus_env, reference,
                                                               tmp_path):
    """checkpoint.every=0 in a run directory holding checkpoints restores them (it only
    stops saving): the history up to the restored step stays, the new steps follow."""
    from jaxptd.config import load_config
    env, _ = corpus_env
    copy_run(reference, tmp_path)
    before = [r for r in records(tmp_path / "run") if "event" not in r]
    result = run_train(env, *BASE, f"train.steps={STEPS + 2}", "checkpoint.every=0",
                       *dirs(tmp_path, "run"))
    assert_ok(result)
    assert f"resumed from step {STEPS}" in result.stdout, result.stdout[-3000:]
    after = [r for r in records(tmp_path / "run") if "event" not in r]
    assert after[:len(before)] == before
    assert [r["step"] for r in after[len(before):]] == [STEPS + 1, STEPS + 2]
    assert complete_steps(tmp_path / "ckpt") == complete_steps(reference[1])  # none saved
    assert load_config(str(tmp_path / "run" / "config.yaml")).checkpoint.every == 0


@pytest.mark.slow
def test_resume_with_another_model_shape_or_vocabulary_names_the_key(corpus_env, reference,
                                                                     tmp_path):
    """Another hidden size is refused naming the key and both values (not a leaf of the
    optimizer state); another vocabulary (which the padded rows would let restore) is
    refused unless --allow-change model.vocab_size asks for it."""
    env, _ = corpus_env
    copy_run(reference, tmp_path)
    args = [*BASE, f"train.steps={STEPS + 1}", *dirs(tmp_path, "run")]
    wider = run_train(env, *args, "model.hidden_size=128")
    assert wider.returncode == 2 and "Traceback" not in wider.stderr, wider.stderr[-3000:]
    assert "model.hidden_size 64 -> 128" in error_line(wider) and "opt_state" not in \
        error_line(wider), wider.stderr
    vocab = run_train(env, *args, "model.vocab_size=300")
    assert vocab.returncode == 2 and "model.vocab_size 257 -> 300" in error_line(vocab) and \
        "--allow-change model.vocab_size" in error_line(vocab), vocab.stderr
    allowed = run_train(env, *args, "model.vocab_size=300", "--allow-change",
                        "model.vocab_size")
    assert_ok(allowed)
    assert f"resumed from step {STEPS}" in allowed.stdout, allowed.stdout[-3000:]


@pytest.mark.slow
def test_raising_train_steps_keeps_the_schedule(corpus_env, tmp_path):
    """Raising train.steps keeps the schedule's length (optimizer.decay_steps 0: the
    continued run's train.steps), so the steps trained keep their rates and the rate is
    optimizer.min_lr past them; the length is written into config.yaml (and the
    checkpoints) for the resumes after. With checkpoint.every=0 here: nothing saved."""
    from jaxptd.config import load_config
    env, _ = corpus_env
    run = [*ONE, f"train.run_dir={tmp_path / 'run'}"]
    assert_ok(run_train(env, *run, "train.steps=4", "checkpoint.every=2"))
    first = [r for r in records(tmp_path / "run") if "loss" in r]
    result = run_train(env, *run, "train.steps=6", "checkpoint.every=0")
    assert_ok(result)
    assert "resumed from step 4" in result.stdout, result.stdout[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "optimizer.decay_steps=4" in warnings[0], result.stderr
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert trained[:4] == first and [r["step"] for r in trained] == list(range(1, 7))
    assert [r["lr"] for r in trained[4:]] == pytest.approx([1e-4, 1e-4])  # min_lr
    assert complete_steps(tmp_path / "run" / "checkpoints") == [2, 4]  # nothing saved
    config = load_config(str(tmp_path / "run" / "config.yaml"))
    assert (config.checkpoint.every, config.optimizer.decay_steps) == (0, 4)


def test_no_readable_checkpoint_is_refused_again_on_the_rerun(corpus_env, reference,
                                                              tmp_path):
    """Every step damaged: the run stops with `no readable checkpoint` and the same
    command stops again, naming the steps set aside and the history, instead of training
    from step 0 over it; metrics.jsonl and config.yaml stay as they were."""
    env, _ = corpus_env
    copy_run(reference, tmp_path)
    for step in complete_steps(tmp_path / "ckpt"):
        (tmp_path / "ckpt" / str(step) / "state" / "_METADATA").write_bytes(b"")
    kept = {name: (tmp_path / "run" / name).read_bytes()
            for name in ("metrics.jsonl", "config.yaml")}
    args = [*BASE, f"train.steps={STEPS}", *dirs(tmp_path, "run")]
    assert "no readable checkpoint" in error_line(run_train(env, *args))
    refused = error_line(run_train(env, *args))
    assert "3.corrupt, 6.corrupt, 9.corrupt, 12.corrupt" in refused, refused
    assert f"trained to step {STEPS}" in refused, refused
    assert kept == {name: (tmp_path / "run" / name).read_bytes() for name in kept}


@pytest.mark.slow
def test_second_run_on_a_run_directory_is_refused_and_a_killed_ones_lock_is_not(
        corpus_env, tmp_path):
    """A run holds its run directory: a second one is refused naming the holder (its pid
    and host) and writes nothing; once the holder is killed (SIGKILL) a run goes ahead."""
    import socket
    env, _ = corpus_env
    proc, run_dir = start_and_wait(env, tmp_path, "run")
    try:
        refused = error_line(run_train(env, *BASE, "train.steps=2", f"train.run_dir={run_dir}",
                                       f"checkpoint.dir={tmp_path / 'other'}"))
        assert f"train.run_dir={run_dir} is in use by another run" in refused, refused
        assert f"process {proc.pid} on {socket.gethostname()}" in refused, refused
        assert not (tmp_path / "other").exists()
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    kinds = [(r["step"], "event" in r) for r in records(run_dir)]
    assert len(kinds) == len(set(kinds)), kinds  # no second run's record among them
    assert_ok(run_train(env, *BASE, "train.steps=1", "checkpoint.every=1000",
                        f"train.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}"))


def test_full_disk_at_start_up_is_one_error_line_and_leaves_nothing(corpus_env, full_disk):
    env, _ = corpus_env
    line = error_line(run_train(env, *ONE, "train.steps=1",
                                f"train.run_dir={full_disk / 'run'}"))
    assert f"train.run_dir={full_disk / 'run'}: no space left on device" in line, line
    assert "free space" in line and sorted(os.listdir(full_disk)) == ["filler"]


@pytest.mark.slow
def test_file_size_limit_during_a_save_is_one_error_line(corpus_env, tmp_path):
    """`ulimit -f` of 150 KB (over the start-up probe's 64 KB), a model whose checkpoint
    needs 3 MB: one error line saying what to do, and no half-written step left."""
    import resource
    env, _ = corpus_env
    limit = 150_000

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    ckpt = tmp_path / "ckpt"
    result = subprocess.run(train_command(
        *ONE, "model.hidden_size=128", "train.steps=2", "checkpoint.every=1",
        f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}"), cwd=REPO, env=env,
        capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=limited)
    line = error_line(result)
    assert f"checkpoint.dir={ckpt}: file too large while saving step 1" in line, line
    assert "raise the file-size limit (ulimit -f)" in line, line
    assert not ckpt.exists() or not os.listdir(ckpt)


# --------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "missing data": ["data.path=/nonexistent/dir"],
    "malformed yaml": ["--config", "{tmp}/broken.yaml"],
    "config is a directory": ["--config", "{tmp}"],
    "unknown key": ["model.nonsense=1"],
    "impossible mesh 3 of 8": ["parallel.data=3", "runtime.cpu_devices=8"],
    "impossible mesh 2x1x2 of 8": ["parallel.data=2", "parallel.tensor=2",
                                   "runtime.cpu_devices=8"],
    "unwritable checkpoint dir": ["checkpoint.dir={tmp}/file.txt/ckpt",
                                  "train.run_dir={tmp}/new/run"],
    "run_dir is a file": ["train.run_dir={tmp}/file.txt"],
    "unwritable run_dir": ["train.run_dir={tmp}/file.txt/run"],
    "gpu target without a gpu": ["runtime.target=h100"],
    "val split shorter than seq_len": ["data.path={tmp}/one_file_corpus"],
    "out of memory before compiling": ["model.seq_len=300000", "train.eval_every=0",
                                       "parallel.data=2", "parallel.tensor=4"],
}


@pytest.fixture(scope="module")
def bad_input_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bad-input")


@pytest.fixture(scope="module")
def bad_input_results(corpus_env, bad_input_dir):
    """Runs every bad input at once (each fails before device work);
    name -> (rc, out, err)."""
    from jaxptd.data import prepare_corpus

    env, _ = corpus_env
    tmp = bad_input_dir
    (tmp / "broken.yaml").write_text("model:\n  num_layers: [1, 2\n  hidden_size: 64\n")
    (tmp / "file.txt").write_text("a regular file\n")
    (tmp / "book.txt").write_bytes(b"one short document " * 200)  # val: 20 tokens
    prepare_corpus([str(tmp / "book.txt")], tmp / "one_file_corpus", val_fraction=0.005)
    procs = {}
    for name, args in BAD_INPUTS.items():
        args = [f"train.run_dir={tmp / 'run'}"] + [a.format(tmp=tmp) for a in args]
        if args[1] == "--config":  # options before the overrides
            args = args[1:3] + args[:1] + args[3:]
        procs[name] = subprocess.Popen(train_command(*args), cwd=REPO, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(timed out)"
        results[name] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gives_one_error_line(bad_input_results, name):
    returncode, stdout, stderr = bad_input_results[name]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1, stderr[-3000:]
    assert "mesh" not in stdout and "compiled" not in stdout, stdout  # before device work


def test_bad_input_errors_name_what_to_change(bad_input_results, bad_input_dir):
    assert "runtime.target=h100" in bad_input_results["gpu target without a gpu"][2]
    assert "train.run_dir=" in bad_input_results["run_dir is a file"][2]
    assert "checkpoint.dir=" in bad_input_results["unwritable checkpoint dir"][2]
    assert not (bad_input_dir / "new").exists()  # the refused run's directories removed
    assert "split 'val'" in bad_input_results["val split shorter than seq_len"][2]
    memory = bad_input_results["out of memory before compiling"][2]
    assert " TB" in memory and "python -m jaxptd.plan" in memory, memory


def test_out_of_memory_at_run_time_is_one_line():
    from jaxptd.config import load_config
    from jaxptd.runtime.preflight import out_of_memory
    config = load_config(None, ["model.seq_len=4096"])
    xla = RuntimeError("INTERNAL: Error dispatching computation: Out of memory allocating "
                       "16330475327704 bytes.")
    message = out_of_memory(xla, config)
    assert "16.3 TB" in message and "model.seq_len=4096" in message and "\n" not in message
    assert out_of_memory(RuntimeError("INTERNAL: something else"), config) is None


def test_memory_check_refuses_only_beyond_the_planners_margin():
    from jaxptd.config import ConfigError, load_config
    from jaxptd.runtime.preflight import check_memory
    config = load_config(None, [])
    gpu = (80e9, "NVIDIA H100 memory")
    check_memory(config, 90e9, gpu)  # within the planner's 15%: left to XLA
    check_memory(config, 1e15, None)  # unknown device memory: nothing to compare
    with pytest.raises(ConfigError, match=r"puts 100.0 GB on each device, the devices have "
                                          r"80.0 GB \(NVIDIA H100 memory\)"):
        check_memory(config, 100e9, gpu)


def test_help_lists_every_config_key_with_its_default_and_meaning(corpus_env):
    import dataclasses
    from jaxptd.config import Config
    from jaxptd.config.reference import key_meanings
    meanings = key_meanings()
    result = subprocess.run(train_command("--help"), cwd=REPO, env=corpus_env[0], text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for section in dataclasses.fields(Config):
        for key in dataclasses.fields(section.default_factory):
            at = next((i for i, l in enumerate(lines)  # (meanings are indented deeper)
                       if l.startswith(f"  {section.name}.{key.name} ")), None)
            assert at is not None and f"default {key.default!r}" in lines[at], key.name
            meaning = meanings[f"{section.name}.{key.name}"].split()
            assert lines[at + 1].split()[:3] == meaning[:3], (key.name, lines[at + 1])
