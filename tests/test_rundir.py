"""The run directory: one run holds it at a time (a killed one no longer does), and a run
that restores nothing never starts over an earlier run's history.

In-process and file-level; the end-to-end runs of the same rules are in test_train.py and
(several processes) test_multihost.py.
"""
import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from helpers import REPO
from jaxptd.runtime import runlog
from jaxptd.checkpoint.files import TMP_MARK
from jaxptd.config import load_config
from jaxptd.runtime.rundir import (LOCK_NAME, RunDirError, RunLock, moved_record,
                                   unrestored_history)


def config_in(tmp_path, *extra):
    return load_config(None, [f"train.run_dir={tmp_path / 'run'}",
                              f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    config = config_in(tmp_path)
    for directory in ("run", "ckpt"):
        (tmp_path / directory).mkdir()
    with RunLock(config) as first:
        first.acquire(jax)
        holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(RunDirError, match=rf"train.run_dir={tmp_path / 'run'} is in use by "
                                              rf"another run \(process {os.getpid()} on "):
            RunLock(config).acquire(jax)
        only_ckpt = config_in(tmp_path, f"train.run_dir={tmp_path / 'other'}")
        (tmp_path / "other").mkdir()
        with pytest.raises(RunDirError, match="checkpoint.dir=.* is in use"):
            RunLock(only_ckpt).acquire(jax)
        assert not (tmp_path / "other" / LOCK_NAME).exists()  # released on refusal
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    with RunLock(config) as again:
        again.acquire(jax)


def test_a_killed_runs_lock_does_not_block(tmp_path):
    """The holder is SIGKILLed: its lock file stays, naming it, but locks nothing."""
    config = config_in(tmp_path)
    (tmp_path / "run").mkdir()
    code = ("import sys, time; from jaxptd.runtime.rundir import _lock; _lock(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run" / LOCK_NAME)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"process {holder.pid} on"):
            RunLock(config).acquire(jax)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RunLock(config) as lock:
        lock.acquire(jax)
        assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_run_restoring_nothing_never_starts_over_a_history(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                               for s in (1, 2, 3)) + '{"step": 4, "lo')
    config = config_in(tmp_path)
    assert unrestored_history(config) is None  # killed before its first save: retrained
    (ckpt / "2.corrupt").mkdir(parents=True)
    (ckpt / f"3{TMP_MARK}-1").mkdir()  # a killed save: not history
    refusal = unrestored_history(config)
    assert "only damaged steps set aside (2.corrupt)" in refusal, refusal
    assert "trained to step 3" in refusal and "move the .corrupt steps" in refusal
    (ckpt / "2.corrupt").rename(tmp_path / "aside")
    assert unrestored_history(config) is None  # moved out: starting over is asked for
    runlog.write_config(str(run), config, 0)  # the earlier run kept its checkpoints in ckpt
    (ckpt / "2").mkdir()
    elsewhere = config_in(tmp_path, f"checkpoint.dir={tmp_path / 'new'}")
    refusal = unrestored_history(elsewhere)
    assert f"keeps its checkpoints in {ckpt}" in refusal, refusal
    assert f"set checkpoint.dir={ckpt}" in refusal


def test_a_copied_run_directorys_config_warns_where_the_run_would_write(tmp_path):
    """`--config COPY/config.yaml` of a copied run directory names the recorded run_dir and
    the overrides that continue the copy; the directory's own config and other YAML files
    are silent."""
    original = config_in(tmp_path)
    os.makedirs(original.train.run_dir)
    runlog.write_config(original.train.run_dir, original, 0)
    record = os.path.join(original.train.run_dir, "config.yaml")
    assert moved_record(record, load_config(record)) is None
    copy = tmp_path / "copy"
    os.rename(original.train.run_dir, copy)
    warning = moved_record(str(copy / "config.yaml"), load_config(str(copy / "config.yaml")))
    assert warning and f"train.run_dir={tmp_path / 'run'}, the directory it records" in warning \
        and f"add train.run_dir={copy} checkpoint.dir={copy / 'checkpoints'}" in warning
    moved = load_config(str(copy / "config.yaml"), [f"train.run_dir={copy}"])
    assert moved_record(str(copy / "config.yaml"), moved) is None
    (tmp_path / "plain.yaml").write_text("train:\n  steps: 3\n")
    assert moved_record(str(tmp_path / "plain.yaml"), original) is None
