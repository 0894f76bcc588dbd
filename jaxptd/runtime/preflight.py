"""Checks before work starts: every user error a run can meet, found before it trains.

Owns the checks that need more than the config (config/rules.py has those): the corpus and its
splits against `model.seq_len`, the id that ends its documents in packed rows (`packing`),
the run and checkpoint directories (and their removal, while still empty, when the run
fails: `new_directories`), the platform's devices, and whether the model fits in the
devices' memory. Each failure is one
ConfigError / DataError / CheckpointError line naming the key, the value and the rule.

Memory: the planner's per-device total (`plan.device_memory_bytes`, the same model
`python -m jaxptd.plan` reports, so planner changes flow through) is compared before
compiling with the device's memory: `memory_stats()["bytes_limit"]` on an accelerator;
on CPU, where the simulated devices of a process share the host, the host's physical
memory divided among them. The planner matches the compiled step within 15% on the
tested layouts, so a run is refused only when the plan exceeds the memory by more than
that. XLA's own out-of-memory at compile or run time is turned into one line as well.
"""
from __future__ import annotations

import dataclasses
import os
import re
from contextlib import contextmanager

from jaxptd import model as models
from jaxptd.checkpoint.files import check_writable
from jaxptd.config import Config, ConfigError
from jaxptd.data import TokenDataset, resolve_corpus
from jaxptd.runtime.runlog import human_bytes

PLAN_MARGIN = 1.15  # the planner's tested agreement with XLA
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def check_files(config: Config):
    """The corpus, its splits and the directories; returns (train, val) datasets."""
    corpus = resolve_corpus(config.data.path)
    train, val = TokenDataset(corpus, "train"), TokenDataset(corpus, "val")
    reserved = models.reserved_ids(config.model)  # ids the architecture keeps (BERT's)
    if train.vocab_size > config.model.vocab_size - reserved:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}: must be >= the corpus vocabulary "
            f"{train.vocab_size} ({corpus})" + (f" + {reserved} ids model.arch="
                                                f"{config.model.arch} reserves"
                                                if reserved else ""))
    train.check_length(config.model.seq_len)
    if config.train.eval_every:
        val.check_length(config.model.seq_len, "or set train.eval_every=0")
    check_writable(config.train.run_dir, "train.run_dir")
    if config.checkpoint.every:
        check_writable(config.checkpoint_dir)
    return train, val


def packing(config: Config, train: TokenDataset) -> Config:
    """The config the run trains with: with data.pack, model.document_end set to the id
    ending the corpus's documents (a directory's meta.json eot_id; data.eod_id for a
    Megatron dataset, which records none). ConfigError when there is none, or when
    model.document_end or data.eod_id names another."""
    data, recorded = config.data, train.eot_id  # recorded: None for a Megatron dataset
    if recorded is not None and data.eod_id not in (-1, recorded):
        raise ConfigError(f"data.eod_id={data.eod_id}: the corpus {data.path} records its eot "
                          f"id {recorded} (meta.json); set data.eod_id=-1, it is for "
                          "Megatron data")
    if recorded is None and data.eod_id >= train.vocab_size:
        raise ConfigError(f"data.eod_id={data.eod_id}: the Megatron dataset {data.path} holds "
                          f"no id above {train.vocab_size - 1}, so it ends no document there")
    if not data.pack:
        return config
    eot = data.eod_id if recorded is None else recorded
    if eot < 0:
        raise ConfigError(f"data.pack=true: the Megatron dataset {data.path} does not record "
                          "which id ends its documents; set data.eod_id to its --append-eod "
                          "token's id")
    if config.model.document_end not in (-1, eot):
        raise ConfigError(f"model.document_end={config.model.document_end}: data.pack=true "
                          f"sets it to the corpus's eot id {eot}; set it to -1 or {eot}")
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 document_end=eot))


@contextmanager
def new_directories(config: Config):
    """Around a run: when it fails, removes the run and checkpoint directories (and their
    parents) that did not exist before it and are still empty, so that a run refused at
    start-up (a bad checkpoint.dir, a full disk) leaves no empty directory behind."""
    missing = set()
    for directory in (config.train.run_dir, config.checkpoint_dir):
        path = os.path.abspath(directory)
        while not os.path.exists(path):
            missing.add(path)
            path = os.path.dirname(path)
    try:
        yield
    except BaseException:
        for path in sorted(missing, key=len, reverse=True):  # the deepest first
            try:
                os.rmdir(path)  # only an empty directory
            except OSError:
                pass
        raise


def devices(jax, config: Config) -> list:
    """jax.devices(), or a ConfigError when the platform asked for is not there (JAX raises
    a RuntimeError or, when no backend at all remains, an AssertionError)."""
    try:
        return jax.devices()
    except Exception as e:  # noqa: BLE001 - a user error only for an explicit platform
        if config.runtime.target == "auto":
            raise
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else \
            "no backend could start"
        raise ConfigError(f"runtime.target={config.runtime.target}: no such devices on "
                          f"this machine ({reason}); use runtime.target=auto") from None


def device_memory(device, local_devices: int) -> tuple[float, str] | None:
    """(bytes one device may use, what that number is), None when unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind} memory"
    if device.platform == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return host / local_devices, f"host memory / {local_devices} local devices"
    return None


def check_memory(config: Config, planned: float, available: tuple[float, str] | None) -> None:
    """Refuses a run whose planned bytes per device exceed the device's by PLAN_MARGIN."""
    if available is None or planned <= available[0] * PLAN_MARGIN:
        return
    raise ConfigError(
        f"the planner puts {human_bytes(planned)} on each device, the devices have "
        f"{human_bytes(available[0])} ({available[1]}); "
        + _PLAN_HINT.format(seq_len=config.model.seq_len))


def check_compiled(config: Config, compiled, available: tuple[float, str] | None) -> None:
    """The compiled step's own memory (XLA's analysis) against the device's, before it runs."""
    memory = compiled.memory_analysis()
    if memory is None or available is None:
        return
    needed = sum(getattr(memory, f"{k}_size_in_bytes", 0) or 0
                 for k in ("argument", "output", "temp", "generated_code")) - \
        (getattr(memory, "alias_size_in_bytes", 0) or 0)
    if needed > available[0]:
        raise ConfigError(f"the compiled step needs {human_bytes(needed)} per device, the "
                          f"devices have {human_bytes(available[0])} ({available[1]}); "
                          + _PLAN_HINT.format(seq_len=config.model.seq_len))


_PLAN_HINT = ("`python -m jaxptd.plan` with the same config and overrides shows where the "
              "memory goes (model.seq_len={seq_len}), and its --search N_DEVICES finds a "
              "layout that fits")


def out_of_memory(error: BaseException, config: Config) -> str | None:
    """One line for XLA's out-of-memory error (None for any other error)."""
    text = str(error)
    if not any(marker in text for marker in OOM_MARKERS):
        return None
    asked = re.search(r"(\d{4,}) bytes", text)
    amount = f" of {human_bytes(float(asked.group(1)))}" if asked else ""
    return (f"out of memory: XLA could not allocate a buffer{amount} per device; "
            + _PLAN_HINT.format(seq_len=config.model.seq_len))

