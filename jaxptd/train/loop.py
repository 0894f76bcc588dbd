"""`python -m jaxptd.train --config FILE [section.key=value ...]`: the training loop, thin.

Order of work: config -> preflight (corpus, both splits against model.seq_len, data.pack's
eot id into model.document_end, the run and checkpoint directories: all user errors caught
before any device work) -> processes (jaxptd/runtime/distributed.py) -> devices, and the
planner's memory against theirs -> the run's directories locked (jaxptd/runtime/rundir.py)
-> mesh -> state (restored, or initialised into its shardings where that overwrites no
earlier run's history) -> config.yaml and its starts/ record, when there is a step to train
-> compile (XLA's memory against the devices') -> loop of step / log / evaluate / save ->
summary. A run refused before it wrote anything leaves no directory it created behind.

A user error prints one line `error: ...` on stderr and exits 2; so do an out-of-memory
and a storage failure (a full disk, a file-size limit) in any of the run's writers
(jaxptd/runtime/storage.py: checkpoints, config, log, metrics, the corpus prepared on first
use). SIGTERM or SIGUSR1 ends the loop after a step all processes agree on, saves it
and exits 0; SIGINT (Ctrl-C) does the same and exits 130, and a second SIGINT exits at
once (jaxptd/runtime/preemption.py); a hung step or a lost process, with status 75 (runtime/
watchdog.py). What the run prints and writes into train.run_dir is runtime/runlog.py's.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from jaxptd.runtime import distributed, preflight, resize, rundir, runlog
from jaxptd.runtime.stragglers import Stragglers
from jaxptd.runtime.watchdog import watch
from jaxptd.train import metrics
from jaxptd import model as models
from jaxptd.model import sequence
from jaxptd.checkpoint import CheckpointError, ModelMismatch
from jaxptd.checkpoint.files import layout_metadata
from jaxptd.checkpoint.integrity import newest_complete
from jaxptd.config import Config, ConfigError, changed_keys, check_device_count, load_config
from jaxptd.config.reference import describe_keys
from jaxptd.config.resume import ASKED, model_mismatch, refused_change
from jaxptd.data import DataError, TokenDataset
from jaxptd.parallel.mesh import describe, make_mesh
from jaxptd.runtime.preemption import INTERRUPTED, Preemption
from jaxptd.runtime.runlog import LOG, human_bytes
from jaxptd.runtime.rundir import RunLock
from jaxptd.runtime.storage import StorageError


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.train",
        description="Trains a model: a YAML config (--config) with section.key=value\n"
                    "overrides, on the devices JAX finds (simulated CPU devices included);\n"
                    "resumes from the newest checkpoint in checkpoint.dir.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override any as section.key=value):\n" + describe_keys())
    parser.add_argument("--config", help="YAML file (values not given keep their defaults)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tensor=2")
    parser.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                        choices=ASKED, help="resume although KEY differs from the checkpoint's "
                        f"(refused otherwise; one of {', '.join(ASKED)})")
    return parser.parse_args(argv)


def global_batch(setup, dataset: TokenDataset, seed: int, step: int):
    """Batch `step` as a global array in the architecture's rows; each process reads and
    builds only the rows its devices hold."""
    import jax

    config = setup.config
    shape = (config.train.global_batch, models.batch_width(config.model))
    cache = {}

    def rows(index):
        span = index[0].indices(shape[0])
        if span not in cache:
            tokens = dataset.batch(seed, step, shape[0], config.model.seq_len,
                                   rows=range(*span))
            cache[span] = models.make_batch(tokens, seed, step, span[0], config.model)
        return cache[span]

    return jax.make_array_from_callback(shape, setup.batch_sharding, rows)


def evaluate(setup, eval_step, params, val: TokenDataset) -> float:
    """Mean validation loss over train.eval_batches fixed batches: over all their targets
    that take loss, so packed rows' batch means are weighted by their counted targets (as
    Megatron pools the sums and counts of its evaluation batches)."""
    config = setup.config
    seed, batches = config.train.seed, range(config.train.eval_batches)
    losses = [float(eval_step(params, global_batch(setup, val, seed, i))) for i in batches]
    if not sequence.packed(config.model):
        return sum(losses) / len(losses)
    counts = [int(sequence.counted_targets(val.batch(seed, i, config.train.global_batch,
                                                     config.model.seq_len), config.model))
              for i in batches]
    return sum(loss * n for loss, n in zip(losses, counts)) / max(sum(counts), 1)


def start(jax, hosts: dict, config: Config, lock: RunLock, allowed: tuple[str, ...] = ()):
    """Devices, the run's directories locked, mesh, checkpointer and state (restored or
    new), once the processes joined (distributed.start) -> (config, setup, ckpt, state,
    the devices' memory); the config is the one the run trains with (`continue_schedule`)."""
    from jaxptd.plan import device_memory_bytes  # the whole planner: on use (--help)
    from jaxptd.train.step import Setup  # optax and the pipeline executor: on use (--help)

    devices = preflight.devices(jax, config)  # the first use of the backend
    check_device_count(config, len(devices), "devices found")
    available = preflight.device_memory(jax.local_devices()[0], jax.local_device_count())
    preflight.check_memory(config, device_memory_bytes(config, devices[0].platform), available)
    lock.acquire(jax)  # before anything is written into the run's directories
    runlog.setup_logging(config.train.run_dir, jax.process_index() == 0)
    if jax.process_index() == 0:
        LOG.info(distributed.describe_hosts(jax, hosts))
    given = config  # as the user gave it; the run's own keeps the schedule it continues
    config, notes = continue_schedule(given, allowed)
    mesh = make_mesh(config.parallel)
    LOG.info(describe(mesh))
    if config.data.pack:
        LOG.info(f"packed rows (data.pack): documents end at eot id "
                 f"{config.model.document_end}; attention stays inside each document and "
                 "positions restart after it")
    setup = Setup(config, mesh)
    return (config, setup, *restore(jax, setup, given, notes), available)


def continue_schedule(config: Config, allowed: tuple[str, ...] = ()):
    """(config, notes) with the learning-rate schedule of the newest complete step in
    checkpoint.dir kept (config.continued) and its microbatch size at another
    parallel.data (runtime/resize.py); the config itself when there is none, or it is
    step 0 (`hf import`'s: no step trained on any schedule yet). Raises ConfigError for a
    change of a key the run may change only when asked (config.refused_change)."""
    step, saved = newest_complete(config.checkpoint_dir)
    refusal = refused_change(saved, config, allowed) if saved else None
    if refusal:
        raise ConfigError(refusal)
    return resize.resumed(config, saved) if saved and step else (config, ())


def restore(jax, setup, given: Config, notes: tuple[str, ...] = ()):
    """(checkpointer, local tier, state): the newest readable step in checkpoint.dir, or in
    checkpoint.local_dir where newer (checkpoint/local.py), also with checkpoint.every=0
    (which only stops saving), or a new state where starting over writes over no earlier
    run's history (rundir.unrestored_history). `given`: the config as the user gave it,
    whose changes against the restored step's are named."""
    from jaxptd.checkpoint.local import LocalTier, restore_newest  # JAX: on use (--help)
    from jaxptd.checkpoint.precision import restore_switching_fp8
    from jaxptd.checkpoint.store import Checkpointer  # Orbax: on use (--help)
    config, ck = setup.config, setup.config.checkpoint
    ckpt = Checkpointer(config.checkpoint_dir, ck.every, ck.keep, ck.async_save,
                        layout_metadata(config, jax.process_count())
                        ) if ck.every or os.path.isdir(config.checkpoint_dir) else None
    local = LocalTier(ck.local_dir, ck.local_every, ck.local_keep, os.path.abspath(
        config.checkpoint_dir)) if ck.local_dir else None
    try:  # (into the state the checkpoint holds: model.fp8=delayed's histories or not)
        restored = restore_switching_fp8(lambda target: restore_newest(local, ckpt, target, (
            config.model.vocab_size)), setup, saved := newest_complete(config.checkpoint_dir)[1])
    except ModelMismatch as e:  # name the keys that changed, not the leaf that shows it
        detail = model_mismatch(saved, given) if saved else None
        raise CheckpointError(f"checkpoint.dir={config.checkpoint_dir}: {detail or e}") from None
    if restored is None:
        refusal = distributed.lead_decides(jax, rundir.unrestored_history(config)
                                           if jax.process_index() == 0 else None)
        if refusal:
            raise rundir.RunDirError(refusal)
        return ckpt, local, setup.state_layout.init_state(config.train.seed)
    LOG.info(f"resumed from step {restored[1]} in {restored[2]}")
    changes = changed_keys(((ckpt and ckpt.layout(restored[1])) or {}).get("config", {}), given)
    if changes:
        LOG.warning(f"step {restored[1]} was trained with other settings; continuing with "
                    f"the new ones: {', '.join(changes)}")
    for note in notes:
        LOG.warning(note)
    return ckpt, local, setup.state_layout.state_from_logical(restored[0])


def compile_step(setup, state, batch, timer, metrics_log=None, available=None):
    """Compiles the step ahead of time, checks its memory against `available` (bytes,
    where from) and records its cost once in `metrics_log` (each when given)
    -> (step, FLOPs/iter). bench/gpu_train.py compiles through here too."""
    from jaxptd.plan import recomputation, schedule_stats  # the planner: on use (--help)
    from jaxptd.train.step import build_train_step  # optax, the pipeline: on use (--help)

    config = setup.config
    train_step = setup.compile(build_train_step(setup).lower(state, batch))
    compile_s = timer.lap(1)
    preflight.check_compiled(config, train_step, available)
    flops = metrics.flops_per_iteration(config.model, config.train.global_batch, setup.vocab,
                                        recomputation(config))
    memory = train_step.memory_analysis()
    record = {"step": int(state["step"]), "event": "compiled", "compile_time_s": compile_s,
              "temp_bytes_per_device": getattr(memory, "temp_size_in_bytes", None),
              "argument_bytes_per_device": getattr(memory, "argument_size_in_bytes", None),
              "flops_per_iteration": flops, "bubble_fraction": schedule_stats(
                  config, setup.target.platform)[0], "fp8": config.model.fp8}
    if metrics_log is not None:
        metrics_log.write(record)
    LOG.info(f"compiled the step in {compile_s:.1f} s: "
             f"{human_bytes(record['argument_bytes_per_device'] or 0)} of state and "
             f"{human_bytes(record['temp_bytes_per_device'] or 0)} of temporaries per device,"
             f" pipeline bubble {record['bubble_fraction']:.3f}" + (
                 f"; the layers' linears in FP8 (model.fp8={config.model.fp8}), MFU still "
                 "against the bf16 peak" if config.model.fp8 != "none" else ""))
    return train_step, flops


class Run:
    """One training run's loop state: what each step needs and what it reports."""

    def __init__(self, config: Config, train: TokenDataset, val: TokenDataset):
        self.began = time.monotonic()
        self.config, self.train, self.val = config, train, val
        self.watchdog = self.metrics_log = None

    def start(self, lock: RunLock, allowed: tuple[str, ...] = ()) -> None:
        """Joins the processes, watches them and this one (watchdog.py), then `start`."""
        from jaxptd.train.step import build_eval_step  # optax, the pipeline: on use (--help)
        config = self.config
        self.jax, group = distributed.start(config)
        self.lead = group.process == 0  # the backend starts in `start`: user errors first
        self.watchdog = watch(config, group)
        self.config, self.setup, self.ckpt, self.local, self.state, self.available = \
            start(self.jax, group.hosts, config, lock, allowed)
        self.preemption = Preemption(self.lead)  # after jax.distributed: the last handlers
        self.start_step = self.last = self.watchdog.step = int(self.state["step"])
        self.tokens = config.train.global_batch * config.model.seq_len
        self.timer = metrics.StepTimer()
        self.stragglers = Stragglers(self.jax, config.runtime, group.hosts)
        self.peak = self.setup.target.peak_bf16
        self.eval_step = build_eval_step(self.setup)

    def log_step(self, done: int, since: int, out, flops: float) -> None:
        """Waits for step `done` and logs it: metrics record and a progress line."""
        out = self.jax.device_get(out)  # synchronises: the timer covers finished work
        step_time = self.timer.lap(done - since)
        record = {"step": done, "loss": float(out["loss"]), "lr": float(out["lr"]),
                  "grad_norm": float(out["grad_norm"]), "step_time_s": step_time,
                  **metrics.throughput(flops, self.tokens, step_time,
                                       self.jax.device_count(), self.peak)}
        if self.config.optimizer.loss_scale == "dynamic":
            record["loss_scale"] = float(out["loss_scale"])
        if "moe" in out:  # each layer's balance losses, expert load and drops
            record.update(metrics.moe_record(out["moe"], self.config.model,
                                             self.config.train.global_batch))
        entries, lagging = self.stragglers.report(step_time)  # a collective
        record.update(entries)
        self.metrics_log.write(record)
        LOG.info(self.progress.line(record))
        if lagging:
            LOG.warning(lagging)

    def evaluate(self, done: int) -> None:
        self.watchdog.slow(f"the evaluation at step {done}")
        val_loss = evaluate(self.setup, self.eval_step, self.state["params"], self.val)
        record = {"step": done, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        self.metrics_log.write(record)
        LOG.info(f"step {done}: validation loss {val_loss:.4f}, perplexity "
                 f"{record['val_ppl']:.2f}")

    def save(self, step: int, persistent: bool = True) -> None:  # and the local tier, if due
        self.watchdog.slow(f"saving step {step}")
        logical = self.setup.state_layout.state_to_logical(self.state)
        if persistent:
            self.ckpt.save(step, logical)
        if self.local and self.local.due(step):
            self.local.save(step, logical)

    def report_saves(self) -> None:
        for step, seconds, size in self.ckpt.completed() if self.ckpt else ():
            LOG.info(f"checkpoint: step {step} saved in {seconds:.1f} s ({human_bytes(size)})"
                     f" to {self.ckpt.directory}/{step}")

    def loop(self) -> None:
        """Trains from the start step to train.steps or an agreed signal."""
        config, ckpt = self.config, self.ckpt
        seed, log_every, eval_every = config.train.seed, config.train.log_every, \
            config.train.eval_every
        first = global_batch(self.setup, self.train, seed, self.start_step)
        train_step, flops = compile_step(self.setup, self.state, first, self.timer,
                                         self.metrics_log, self.available)
        if self._evaluation_missed():
            self.evaluate(self.start_step)
        self.timer.lap(0)
        self.progress.start_steps()
        since = self.start_step
        for step in range(self.start_step, config.train.steps):
            began = time.perf_counter()
            batch = first if step == self.start_step else \
                global_batch(self.setup, self.train, seed, step)
            self.state, out = train_step(self.state, batch)
            self.stragglers.add(time.perf_counter() - began)  # this process's own part
            done = self.last = step + 1
            if done % log_every == 0 or done == config.train.steps:
                self.log_step(done, since, out, flops)
                since = done
            saved = bool(ckpt) and ckpt.due(done)
            local = bool(self.local) and self.local.due(done)
            if saved or local:
                self.save(done, saved)
            evaluated = eval_every and done % eval_every == 0
            if evaluated:
                self.evaluate(done)
            if saved or local or evaluated:
                self.timer.lap(0)  # keep saving and evaluation out of the next step time
            self.report_saves()
            self.watchdog.beat(done)
            if self.preemption.agreed():  # every process stops after the same step
                LOG.info(f"{self._stop_reason()}: saving step {done} and exiting"
                         if config.checkpoint.every else f"{self._stop_reason()}: exiting "
                         "(nothing saved: checkpoint.every=0)")
                break

    def _evaluation_missed(self) -> bool:
        """Whether the evaluation due at the restored step never ran (the run stopped
        between saving and evaluating): process 0's metrics decide, for every process."""
        every, step = self.config.train.eval_every, self.start_step
        missed = bool(step and every and step % every == 0) and \
            not self.metrics_log.has(step, "val")
        if self.jax.process_count() == 1:
            return missed
        from jax.experimental import multihost_utils
        return bool(multihost_utils.broadcast_one_to_all(np.int32(missed)))

    def _stop_reason(self) -> str:
        signal_name = self.preemption.received or "a signal on another process"
        interrupted = self.preemption.exit_code == INTERRUPTED  # here or elsewhere
        return f"{'interrupted' if interrupted else 'preempted'} ({signal_name})"

    def finish(self) -> None:
        """The last step saved (or the agreed preemption step), files closed, summary."""
        self.watchdog.slow("the final save")
        if self.ckpt:
            if self.config.checkpoint.every and not self.ckpt.has(self.last):
                self.save(self.last)
            self.ckpt.close()
            self.report_saves()
        if self.local:
            self.local.close()
        self.metrics_log.close()
        LOG.info(self.progress.summary(self.last, self.metrics_log, self._files()))

    def _files(self) -> str:
        where = f"{self.config.train.run_dir} (config.yaml, train.log, metrics.jsonl, " \
                "tensorboard/)"
        if self.ckpt:
            where += f", checkpoints in {self.ckpt.directory}"
        return where

    def __call__(self) -> int:
        config = self.config
        if self.start_step >= config.train.steps:
            LOG.info(f"nothing to train: the checkpoint in {self.ckpt.directory} is at step "
                     f"{self.start_step} and train.steps={config.train.steps}; raise "
                     "train.steps to continue this run (its learning rate stays at "
                     f"optimizer.min_lr after step {config.decay_length} unless "
                     "optimizer.decay_steps says otherwise), or use a new train.run_dir "
                     "(and checkpoint.dir) to start another")
            self.ckpt.close()
            return 0
        if self.lead:  # the run continues this directory's history, or has none
            runlog.write_config(config.train.run_dir, config, self.start_step)
        self.metrics_log = runlog.MetricsLog(config, self.start_step, self.lead)
        self.progress = runlog.Progress(config.train.steps, self.start_step, self.tokens,
                                        self.began)
        self.loop()
        self.finish()
        return self.preemption.exit_code


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config, run, code = None, None, 1  # 1 while an unexpected error propagates
    try:
        config = load_config(args.config, args.overrides)
        moved = rundir.moved_record(args.config, config)
        if moved:
            LOG.warning(moved)
        with preflight.new_directories(config), RunLock(config) as lock:
            train, val = preflight.check_files(config)
            config = preflight.packing(config, train)  # what the step, logs and saves see
            run = Run(config, train, val)
            run.start(lock, tuple(args.allow_change))
            code = run()
    except (ConfigError, DataError, CheckpointError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted before training started: nothing saved", file=sys.stderr)
        code = INTERRUPTED
    except Exception as e:  # noqa: BLE001 - only XLA's out-of-memory is a user error here
        message = preflight.out_of_memory(e, config) if config else None
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        code = 2
    finally:
        if run is not None and run.watchdog is not None:  # the other processes are told
            run.watchdog.leave(code)
    return code
