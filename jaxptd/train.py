"""`python -m jaxptd.train --config FILE [section.key=value ...]`: the training loop, thin.

Order of work: config (all user errors caught here, before any device work) -> data ->
checkpoint directory -> processes (jaxptd/distributed.py) -> devices and mesh -> state
(restored or initialised into its shardings) -> loop of step / log / evaluate / save.
A user error prints one line `error: ...` on stderr and exits 2. SIGTERM or SIGUSR1 ends
the loop after a step all processes agree on, saves it and exits 0 (jaxptd/preemption.py).
"""
from __future__ import annotations

import argparse
import math
import sys

from jaxptd import distributed
from jaxptd import model as models
from jaxptd.checkpoint import CheckpointError, check_writable
from jaxptd.config import Config, ConfigError, load_config
from jaxptd.data import DataError, TokenDataset, resolve_corpus
from jaxptd.preemption import Preemption


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxptd.train", description=__doc__)
    parser.add_argument("--config", help="YAML file (values not given keep their defaults)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tensor=2")
    return parser.parse_args(argv)


def prepare(config: Config):
    """User-facing checks that need files but no devices; returns (train, val) datasets."""
    corpus = resolve_corpus(config.data.path)
    train, val = TokenDataset(corpus, "train"), TokenDataset(corpus, "val")
    reserved = models.reserved_ids(config.model)  # ids the architecture keeps (BERT's)
    if train.vocab_size > config.model.vocab_size - reserved:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}: must be >= the corpus vocabulary "
            f"{train.vocab_size} ({corpus})" + (f" + {reserved} ids model.arch="
                                                f"{config.model.arch} reserves" if reserved else ""))
    if config.checkpoint.every:
        check_writable(config.checkpoint_dir)
    return train, val


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
    """Mean validation loss over train.eval_batches fixed batches."""
    config = setup.config
    losses = [eval_step(params, global_batch(setup, val, config.train.seed, i))
              for i in range(config.train.eval_batches)]
    return float(sum(float(x) for x in losses) / len(losses))


def start(config: Config):
    """Processes, mesh, checkpointer and state (restored or new) -> (jax, setup, ckpt, state)."""
    jax, hosts = distributed.start(config)
    from jaxptd.checkpoint import Checkpointer, layout_metadata
    from jaxptd.config import check_device_count
    from jaxptd.mesh import describe, make_mesh
    from jaxptd.step import Setup

    check_device_count(config, jax.device_count(), "devices found")
    mesh = make_mesh(config.parallel)
    lead = jax.process_index() == 0
    if lead:
        print(distributed.describe_hosts(jax, hosts), flush=True)
        print(describe(mesh), flush=True)
    setup = Setup(config, mesh)
    ckpt = Checkpointer(config.checkpoint_dir, config.checkpoint.every, config.checkpoint.keep,
                        config.checkpoint.async_save,
                        layout_metadata(config, jax.process_count())
                        ) if config.checkpoint.every else None
    restored = ckpt.restore_latest(setup.abstract_state(logical=True),
                                   config.model.vocab_size) if ckpt else None
    if restored is None:
        return jax, setup, ckpt, setup.init_state(config.train.seed)
    if lead:
        print(f"resumed from step {restored[1]} in {ckpt.directory}", flush=True)
    return jax, setup, ckpt, setup.state_from_logical(restored[0])


def compile_step(setup, state, batch, timer, writer):
    """Compiles the step ahead of time and records its cost once -> (step, FLOPs/iter)."""
    from jaxptd import metrics
    from jaxptd.plan import recomputation, schedule_stats
    from jaxptd.step import build_train_step

    config = setup.config
    train_step = build_train_step(setup).lower(state, batch).compile()
    compile_s = timer.lap(1)
    flops = metrics.flops_per_iteration(config.model, config.train.global_batch, setup.vocab,
                                        recomputation(config))
    if writer:
        memory = train_step.memory_analysis()
        writer.write({"step": int(state["step"]), "event": "compiled",
                      "compile_time_s": compile_s,
                      "temp_bytes_per_device": getattr(memory, "temp_size_in_bytes", None),
                      "argument_bytes_per_device":
                          getattr(memory, "argument_size_in_bytes", None),
                      "flops_per_iteration": flops,
                      "bubble_fraction": schedule_stats(config)[0]})
    return train_step, flops


def run(config: Config, train: TokenDataset, val: TokenDataset) -> None:
    jax, setup, ckpt, state = start(config)
    preemption = Preemption()  # after jax.distributed, so its handlers are the last word
    from jaxptd import metrics
    from jaxptd.step import build_eval_step

    seed, start_step = config.train.seed, int(state["step"])
    lead = jax.process_index() == 0
    writer = metrics.Writer(config.train.run_dir, config.train.steps) if lead else None
    timer = metrics.StepTimer()
    first = global_batch(setup, train, seed, start_step)
    train_step, flops = compile_step(setup, state, first, timer, writer)
    eval_step = build_eval_step(setup)
    peak = metrics.peak_flops(jax.devices()[0].device_kind)
    tokens = config.train.global_batch * config.model.seq_len

    since = last = start_step
    for step in range(start_step, config.train.steps):
        batch = first if step == start_step else global_batch(setup, train, seed, step)
        state, out = train_step(state, batch)
        done = last = step + 1
        if done % config.train.log_every == 0 or done == config.train.steps:
            out = jax.device_get(out)  # synchronises: the timer covers finished work
            step_time = timer.lap(done - since)
            since = done
            record = {"step": done, "loss": float(out["loss"]), "lr": float(out["lr"]),
                      "grad_norm": float(out["grad_norm"]), "step_time_s": step_time,
                      **metrics.throughput(flops, tokens, step_time, jax.device_count(), peak)}
            if config.optimizer.loss_scale == "dynamic":
                record["loss_scale"] = float(out["loss_scale"])
            if writer:
                writer.write(record)
        saved = bool(ckpt) and ckpt.due(done) and ckpt.save(done, setup.state_to_logical(state))
        evaluated = config.train.eval_every and done % config.train.eval_every == 0
        if evaluated:
            val_loss = evaluate(setup, eval_step, state["params"], val)
            if writer:
                writer.write({"step": done, "val_loss": val_loss,
                              "val_ppl": math.exp(min(val_loss, 50.0))})
        if saved or evaluated:
            timer.lap(0)  # keep saving and evaluation out of the next step time
        if preemption.agreed():  # every process stops after the same step
            if lead:
                print(f"preempted ({preemption.received or 'another process'}): saving "
                      f"step {done} and exiting", flush=True)
            break
    if ckpt:
        if not ckpt.has(last):  # the last step (or the agreed preemption step)
            ckpt.save(last, setup.state_to_logical(state))
        ckpt.close()
    if writer:
        writer.close()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, args.overrides)
        train, val = prepare(config)
        run(config, train, val)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
