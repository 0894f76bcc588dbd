"""Preemption and interrupts: a signal ends the run cleanly at a step every process agrees on.

Owns the signal handlers of a training run. SLURM sends SIGTERM at cancellation and
preemption, and `sbatch --signal=USR1@T` sends SIGUSR1 T seconds before the time limit;
Ctrl-C sends SIGINT. A handler only records the signal; the loop calls `agreed()` once per
step, a collective that ORs every process's flag, so all processes leave the loop after
the same step even when only one of them was signalled. The loop then saves that step;
the run exits 0 after SIGTERM/SIGUSR1 (a requeued job resumes) and 130 after SIGINT (the
shell's code for an interrupted command).

A second SIGINT exits at once, without saving: the first one gives SIGINT back its default
action, so the kernel ends the process even while the main thread is inside a long XLA
call (where a Python handler would wait for the call to return). CPython runs one handler
for signals that arrive before it runs, so "second" means after the first was handled,
which the notice it prints shows.
"""
from __future__ import annotations

import signal
import sys

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED = 130  # 128 + SIGINT


class Preemption:
    """Installs the handlers (call after jax.distributed starts, so they are the last).
    `lead`: this process prints the notice of the first SIGINT."""

    def __init__(self, lead: bool = True):
        self.lead = lead
        self.received: str | None = None  # the name of the first signal seen
        self.interrupted = False  # SIGINT seen here
        self._any_interrupted = False  # SIGINT seen by some process (after agreed())
        for sig in SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            self.interrupted = True
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next one ends the process
            if self.lead:
                print("interrupted: the current step is saved before exiting; interrupt "
                      "again to exit at once without saving", file=sys.stderr, flush=True)
        self.received = self.received or signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        """The exit status after the loop: 130 when any process saw SIGINT, else 0."""
        return INTERRUPTED if self._any_interrupted or self.interrupted else 0

    def agreed(self) -> bool:
        """True on every process when any process was signalled. All must call it."""
        import jax
        code = 2 if self.interrupted else 1 if self.received else 0
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            code = int(np.max(multihost_utils.process_allgather(np.int32(code))))
        self._any_interrupted = code == 2
        return code > 0
