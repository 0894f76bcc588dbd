"""Stragglers: each process's own time a step, over the processes, and the one that lags.

Owns the per-process entries of a multi-process run's training records and the warning
that names a process persistently slower than the rest.

What is timed: a process's host time a step, the time it takes to read its rows of the
batch and to dispatch the step (`add`). The step itself cannot be timed a process apart:
its collectives make every process wait for the slowest, so all of them see the same
step time. A process with a slow disk, a busy or throttled CPU or a slow interpreter
is late with its part and shows here; a device slower than the others shows only in
everyone's step time.

At each log step (`report`, a collective: every process calls it) the mean host time of
the steps since the last one is gathered from every process, and the record gets
`host_time_s_min`, `host_time_s_median`, `host_time_s_max` and `host_time_slowest` (the
process with the max). A process is named (`straggler`) when, over the last
`runtime.straggler_window` log steps, its median host time is at least
`runtime.straggler_ratio` x the median process's and longer by at least FLOOR of the
step time (a few milliseconds of a long step slow nothing); the warning is given once
until that process stops lagging.
"""
from __future__ import annotations

import collections

import numpy as np

FLOOR = 0.05  # the least excess host time worth a warning, as a fraction of the step time


def straggler(history, ratio: float, step_time: float) -> tuple[int, float, float] | None:
    """(process, its median host time, the median process's) of the process lagging over
    `history` ([log steps][processes] host times, seconds); None when none lags."""
    medians = np.median(np.asarray(history, np.float64), axis=0)  # [processes]
    typical = float(np.median(medians))
    slowest = int(np.argmax(medians))
    worst = float(medians[slowest])
    if worst >= ratio * typical and worst - typical >= FLOOR * step_time:
        return slowest, worst, typical
    return None


class Stragglers:
    """Host times of this process, gathered over all of them at each log step.

    Args:
      jax: the module (process_count, multihost_utils); runtime: RuntimeConfig
      (straggler_ratio: 0 no warning; straggler_window); hosts: {rank: host} for the line.
    """

    def __init__(self, jax, runtime, hosts: dict[int, str]):
        self.jax, self.hosts = jax, hosts
        self.ratio, self.window = runtime.straggler_ratio, runtime.straggler_window
        self.history = collections.deque(maxlen=self.window)
        self.total, self.steps = 0.0, 0
        self.named = None  # the process the last warning named, while it lags

    def add(self, seconds: float) -> None:
        """One step's host time on this process."""
        self.total += seconds
        self.steps += 1

    def report(self, step_time: float) -> tuple[dict, str | None]:
        """-> (the record's entries, a warning line or None); {} with one process."""
        if self.jax.process_count() == 1:
            return {}, None
        from jax.experimental import multihost_utils
        mine = self.total / max(self.steps, 1)
        self.total, self.steps = 0.0, 0
        return self.judge(np.asarray(multihost_utils.process_allgather(np.float32(mine)),
                                     np.float64).reshape(-1), step_time)

    def judge(self, times: np.ndarray, step_time: float) -> tuple[dict, str | None]:
        """`report` given every process's host time ([processes], seconds)."""
        self.history.append(times)
        entries = {"host_time_s_min": float(times.min()),
                   "host_time_s_median": float(np.median(times)),
                   "host_time_s_max": float(times.max()),
                   "host_time_slowest": int(np.argmax(times))}
        found = straggler(self.history, self.ratio, step_time) \
            if self.ratio and len(self.history) == self.window else None
        if found is None or found[0] == self.named:
            self.named = found and found[0]
            return entries, None
        self.named, (rank, worst, typical) = found[0], found
        host = self.hosts.get(rank)
        return entries, (
            f"process {rank}{f' on {host}' if host else ''} lags the others: its host time "
            f"a step (reading its batch rows, dispatching the step) has a median of "
            f"{worst:.3g} s over the last {self.window} log steps against {typical:.3g} s "
            f"for the median process ({worst / max(typical, 1e-9):.1f}x; "
            f"runtime.straggler_ratio={self.ratio:g}), and every step waits for it")
