"""End to end through `python -m jaxptd.train` in subprocesses: metrics and checkpoints of a
short run, a real SIGKILL and a bitwise-identical resume, a half-written checkpoint ignored,
one-line errors for bad input, and (slow) convergence of the default config below the
corpus's unigram entropy.

Every run gets its own run_dir and checkpoint.dir under tmp; the built-in stdlib corpus is
prepared once per session into a session cache ($JAXPTD_CACHE). Every subprocess has a
timeout, so a hang fails instead of blocking CI.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxptd.data import resolve_corpus, unigram_entropy

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


@pytest.fixture(scope="session")
def corpus_env(tmp_path_factory):
    """(environment for the subprocesses, prepared stdlib corpus directory)."""
    cache = tmp_path_factory.mktemp("jaxptd-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXPTD_CACHE", str(cache))
        corpus = resolve_corpus("pystdlib")
    return {**os.environ, "JAXPTD_CACHE": str(cache)}, corpus


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


def test_half_written_checkpoint_is_ignored(corpus_env, reference, tmp_path):
    env, _ = corpus_env
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference[1] / "3", ckpt / "3")
    junk = ckpt / f"9{TMP_MARK}-1234"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "manifest.ocdbt").write_bytes(os.urandom(256))
    (junk / "_CHECKPOINT_METADATA").write_text("{not json")

    result = run_train(env, *BASE, f"train.steps={STEPS}", *dirs(tmp_path, "run"))
    assert_ok(result)
    assert "resumed from step 3" in result.stdout, result.stdout[-3000:]
    expected = {s: v for s, v in losses(reference[0]).items() if s > 3}
    assert losses(tmp_path / "run") == expected


# --------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "missing data": ["data.path=/nonexistent/dir"],
    "malformed yaml": ["--config", "{tmp}/broken.yaml"],
    "unknown key": ["model.nonsense=1"],
    "impossible mesh 3 of 8": ["parallel.data=3", "runtime.cpu_devices=8"],
    "impossible mesh 2x1x2 of 8": ["parallel.data=2", "parallel.tensor=2",
                                   "runtime.cpu_devices=8"],
    "unwritable checkpoint dir": ["checkpoint.dir={tmp}/file.txt/ckpt"],
}


@pytest.fixture(scope="module")
def bad_input_results(corpus_env, tmp_path_factory):
    """Runs every bad input at once (each fails before device work); name -> (rc, err)."""
    env, _ = corpus_env
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "broken.yaml").write_text("model:\n  num_layers: [1, 2\n  hidden_size: 64\n")
    (tmp / "file.txt").write_text("a regular file\n")
    procs = {}
    for name, args in BAD_INPUTS.items():
        args = [a.format(tmp=tmp) for a in args] + [f"train.run_dir={tmp / 'run'}"]
        procs[name] = subprocess.Popen(train_command(*args), cwd=REPO, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += "\n(timed out)"
        results[name] = (proc.returncode, err)
    return results


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gives_one_error_line(bad_input_results, name):
    returncode, stderr = bad_input_results[name]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1, stderr[-3000:]


# --------------------------------------------------------------------------- convergence


@pytest.mark.slow
def test_default_config_learns_below_unigram_entropy(corpus_env, tmp_path):
    env, corpus = corpus_env
    result = run_train(env, "--config", "configs/gpt_tiny.yaml",
                       f"train.run_dir={tmp_path / 'run'}",
                       f"checkpoint.dir={tmp_path / 'ckpt'}", timeout=900)
    assert_ok(result)
    vals = [r for r in records(tmp_path / "run") if "val_loss" in r]
    assert vals, result.stdout[-3000:]
    entropy = unigram_entropy(corpus, "val")
    assert vals[-1]["val_loss"] < entropy - 0.5, (vals[-1], entropy)
