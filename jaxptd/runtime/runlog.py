"""The run directory and what a run says: console lines, the text log, the metrics files.

Owns what goes into `train.run_dir`:

- `config.yaml`: the resolved config of the latest start that trains (every key, defaults
  included; `--config` accepts it back), and `starts/<step>-<UTC time>.yaml`, the same
  for every start, kept: what the checkpoints from that step on were trained with. A
  start that trains nothing writes neither;
- `train.log`: every console line and warning with a timestamp, and the libraries'
  logged warnings (Orbax's absl, asyncio) and exceptions ignored in their threads, which
  would otherwise fill the console;
- `metrics.jsonl`: one JSON record per step and kind (training, validation, compile);
  with several processes a training record has their host times (jaxptd/runtime/
  stragglers.py) and the console a warning line naming a process that lags the others;
- `tensorboard/`: event files, tags grouped as train/, val/ and perf/;
- Weights & Biases, when `train.wandb_project` is set and `wandb` is installed.

Also how jaxptd writes a size or an error inside one line, for every module that prints
(`human_bytes`, `one_line`).

Only process 0 writes or prints; the other processes' objects are silent.

Invariants:

- Resuming at step k first drops the records past step k (and compile records from k on)
  from metrics.jsonl and the TensorBoard files, so a step trained twice is logged once.
- The console gets one progress line per log step (never erased: a history), one line per
  finished checkpoint, and a summary at the end; warnings go to stderr as `warning: ...`.
- config.yaml and the resumed metrics.jsonl are replaced whole (storage.atomic_write):
  a failure leaves the old ones, never a truncated file. Every write happens in the
  calling thread (TensorBoard's too), so a storage failure (a full disk) is one
  StorageError there, which the entry point prints as one `error:` line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time

from jaxptd.runtime import storage

LOG = logging.getLogger("jaxptd")
PERF_KEYS = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "compile_time_s",
             "temp_bytes_per_device", "argument_bytes_per_device", "flops_per_iteration",
             "bubble_fraction", "host_time_s_min", "host_time_s_median", "host_time_s_max",
             "host_time_slowest")  # host_time_*: runtime/stragglers.py's, several processes


def human_bytes(count: float) -> str:
    """A byte count in decimal units: '512 B', '1.5 GB' (one decimal from KB on)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def one_line(error: BaseException, limit: int = 160) -> str:
    """An error as one short line: whitespace collapsed, object reprs dropped."""
    text = re.sub(r"<[^<>]*>", "", " ".join(str(error).split())) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ConsoleFormat(logging.Formatter):
    def format(self, record):
        message = record.getMessage()
        return message if record.levelno < logging.WARNING else \
            f"{record.levelname.lower()}: {message}"


class _Console(logging.StreamHandler):
    """Records with low <= level < high to sys.<name>, looked up at each record (so a
    redirected or captured stream is followed)."""

    def __init__(self, name: str, low: int, high: int):
        super().__init__(getattr(sys, name))
        self.stream_name = name
        self.setFormatter(_ConsoleFormat())
        self.addFilter(lambda record: low <= record.levelno < high)

    def emit(self, record):
        self.stream = getattr(sys, self.stream_name)
        super().emit(record)


def setup_logging(run_dir: str | None = None, lead: bool = True) -> None:
    """Console handlers on process 0 (info to stdout, warnings to stderr) and the
    timestamped train.log in `run_dir`. Other loggers' records (Orbax's absl, asyncio)
    go to the file only: a failed save is reported in one line, not in their tracebacks."""
    LOG.handlers.clear()
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    root = logging.getLogger()
    root.handlers.clear()
    root.addHandler(logging.NullHandler())  # not logging's last resort, which prints
    if run_dir:
        sys.unraisablehook = _unraisable_to(os.path.join(run_dir, "train.log") if lead
                                            else None)
    if not lead:  # silent: not logging's last resort, which prints warnings on stderr
        LOG.addHandler(logging.NullHandler())
        return
    LOG.addHandler(_Console("stdout", logging.INFO, logging.WARNING))
    LOG.addHandler(_Console("stderr", logging.WARNING, logging.CRITICAL + 1))
    if run_dir:
        path = os.path.join(run_dir, "train.log")
        for logger, name, level in ((LOG, "", logging.INFO), (root, "%(name)s ", logging.WARNING)):
            handler = _LogFile(path, raising=logger is LOG)
            handler.setFormatter(logging.Formatter(f"%(asctime)s {name}%(levelname)s %(message)s"))
            handler.setLevel(level)
            logger.addHandler(handler)


class _LogFile(logging.FileHandler):
    """train.log, created at its first record. A storage failure (a full disk) writing one
    of jaxptd's own lines in the main thread is raised there as a StorageError (one
    `error:` line from the entry point); elsewhere (Orbax's threads) the record is
    dropped without the logging module's traceback: the run's next write reports it."""

    def __init__(self, path: str, raising: bool):
        super().__init__(path, delay=True)
        self.raising = raising

    def handleError(self, record):
        failure = storage.storage_error(sys.exc_info()[1], self.baseFilename,
                                        "writing the run's log")
        if failure is None:
            super().handleError(record)
        elif self.raising and threading.current_thread() is threading.main_thread():
            raise failure


def _unraisable_to(path: str | None):
    """A sys.unraisablehook writing to `path` (None: nowhere). Orbax's abandoned asyncio
    tasks after a failed save raise such exceptions at exit, tracebacks on the console
    otherwise. The file is opened per record: logging may be shut down by then."""
    def hook(unraisable):
        if path is None:
            return
        try:
            with open(path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} exception ignored in "
                        f"{unraisable.object!r}: {unraisable.exc_type.__name__}: "
                        f"{unraisable.exc_value}\n")
        except Exception:  # noqa: BLE001 - nothing may escape an unraisable hook
            pass
    return hook


setup_logging()  # until a run sets up its directory: warnings on stderr


STARTS = "starts"  # <run_dir>/starts/: each start's resolved config, never overwritten


def write_config(run_dir: str, config, start_step: int) -> None:
    """The resolved config as YAML into config.yaml (replaced atomically) and into a new
    record of this start, starts/<start_step>-<UTC time>.yaml."""
    import yaml
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    record, n = os.path.join(run_dir, STARTS, f"{start_step}-{stamp}.yaml"), 0
    while os.path.exists(record):  # two starts within a second: neither record is lost
        n += 1
        record = os.path.join(run_dir, STARTS, f"{start_step}-{stamp}-{n}.yaml")
    path = os.path.join(run_dir, "config.yaml")
    with storage.guard(path, "writing the run's config"):
        os.makedirs(os.path.dirname(record), exist_ok=True)
        storage.atomic_write(record, text)
        storage.atomic_write(path, text)


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics key: val/..., perf/... or train/..."""
    if key.startswith("val_"):
        return f"val/{key[4:]}"
    return f"perf/{key}" if key in PERF_KEYS else f"train/{key}"


def _kind(record: dict) -> str:
    return "event" if "event" in record else "val" if "val_loss" in record else "train"


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl ([] when there is none), each with an int step."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                record["step"] = int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
            records.append(record)
    return records


def trained_to(run_dir: str) -> int:
    """The last step metrics.jsonl in `run_dir` records training for (0: none)."""
    return max((r["step"] for r in read_records(os.path.join(run_dir, "metrics.jsonl"))
                if _kind(r) == "train"), default=0)


class MetricsLog:
    """metrics.jsonl, TensorBoard and (optionally) Weights & Biases; `lead` false: silent."""

    def __init__(self, config, resume_step: int, lead: bool):
        self.lead = lead
        self.path = os.path.join(config.train.run_dir, "metrics.jsonl")
        self.records = self._kept(resume_step) if lead else []
        self.tensorboard = self.wandb = None
        if not lead:
            return
        with storage.guard(self.path, "writing the metrics"):
            storage.atomic_write(self.path, "".join(json.dumps(r) + "\n"
                                                    for r in self.records))
            self.tensorboard = _TensorBoard(os.path.join(config.train.run_dir, "tensorboard"),
                                            resume_step + 1 if resume_step else None)
        if config.train.wandb_project:
            self.wandb = _start_wandb(config)

    def _kept(self, resume_step: int) -> list[dict]:
        """The records of steps up to `resume_step` (compile records: before it)."""
        return [r for r in read_records(self.path) if r["step"] < resume_step or (
            r["step"] == resume_step and _kind(r) != "event")]

    def has(self, step: int, kind: str) -> bool:
        """Whether a record of `kind` (train, val, event) exists for `step`."""
        return any(r["step"] == step and _kind(r) == kind for r in self.records)

    def best_val(self) -> tuple[float, int] | None:
        vals = [(r["val_loss"], r["step"]) for r in self.records if "val_loss" in r]
        return min(vals) if vals else None

    def write(self, record: dict) -> None:
        if not self.lead:
            return
        self.records.append(record)
        scalars = {tag(k): v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        with storage.guard(self.path, "writing the metrics"):
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.tensorboard.add(scalars, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            with storage.guard(self.path, "writing the metrics"):
                self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class _TensorBoard:
    """Event files for TensorBoard, written in the caller's thread: tensorboardX's
    SummaryWriter writes from a thread of its own, where a full disk ends that thread
    with a traceback and leaves the next write blocked on its full queue for ever. A
    record's scalars are written and flushed together; a resumed run's first events tell
    TensorBoard to drop those of the steps from `purge_step` on (SummaryWriter's way)."""

    def __init__(self, directory: str, purge_step: int | None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        os.makedirs(directory, exist_ok=True)
        self.writer = EventsWriter(os.path.join(directory, "events"))
        if purge_step is not None:
            self.writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.write_event(Event(step=purge_step, session_log=SessionLog(
                status=SessionLog.START)))
        self.writer.flush()

    def add(self, scalars: dict[str, float], step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar
        for name, value in scalars.items():
            self.writer.write_event(Event(wall_time=time.time(), step=step,
                                          summary=scalar(name, value)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _start_wandb(config):
    try:
        import wandb
    except ImportError:
        LOG.warning(f"train.wandb_project={config.train.wandb_project}: wandb is not "
                    "installed (pip install wandb); logging to TensorBoard only")
        return None
    return wandb.init(project=config.train.wandb_project, dir=config.train.run_dir,
                      config=config.to_dict())


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else \
        f"{rest // 60}:{rest % 60:02d}"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


class Progress:
    """Progress lines: step/total, elapsed, time left (from the steps of this run so far),
    loss and tokens/s."""

    def __init__(self, total: int, start_step: int, tokens_per_step: int, began: float):
        self.total, self.start_step, self.tokens = total, start_step, tokens_per_step
        self.began = began  # time.monotonic() when the run started: start-up included
        self.first = None  # when the first step of this run started

    def start_steps(self) -> None:
        self.first = time.monotonic()

    def line(self, record: dict) -> str:
        now, done = time.monotonic(), record["step"]
        per_step = (now - self.first) / max(done - self.start_step, 1)
        width = len(str(self.total))
        parts = [f"step {done:>{width}}/{self.total} ({100 * done / self.total:3.0f}%)",
                 f"loss {record['loss']:.4f}", f"{_count(record['tokens_per_s'])} tok/s",
                 f"elapsed {_clock(now - self.began)}",
                 f"left {_clock(per_step * (self.total - done))}"]
        if record.get("mfu") is not None:
            parts.insert(3, f"MFU {100 * record['mfu']:.1f}%")
        if "moe_load" in record:  # the busiest expert over the mean, the worst layer's
            parts.insert(2, f"expert load {record['moe_load']:.2f}x mean")
        return "  ".join(parts)

    def summary(self, last: int, metrics: MetricsLog, where: str) -> str:
        trained = last - self.start_step
        best = metrics.best_val()
        best_text = f"best val loss {best[0]:.4f} (step {best[1]})" if best else \
            "no validation"
        steps = f"{trained} step{'' if trained == 1 else 's'}"
        return (f"done: step {last}/{self.total}, {steps} ({_count(trained * self.tokens)}"
                f" tokens) trained in {_clock(time.monotonic() - self.began)}; {best_text}; "
                f"files in {where}")
