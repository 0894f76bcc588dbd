"""Preemption and interrupts: a signal ends the run cleanly at a step every process agrees on.

Owns the signal handlers of a training run. SLURM sends SIGTERM at cancellation and
preemption, and `sbatch --signal=USR1@T` sends SIGUSR1 T seconds before the time limit;
Ctrl-C sends SIGINT. A handler only records the signal; the loop calls `agreed()` once per
step, a collective that ORs every process's flag, so all processes leave the loop after
the same step even when only one of them was signalled. The loop then saves that step;
the run exits 0 after SIGTERM/SIGUSR1 (a requeued job resumes) and 130 after SIGINT (the
shell's code for an interrupted command). A second SIGINT exits at once, without saving.
"""
from __future__ import annotations

import os
import signal
import sys

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED = 130  # 128 + SIGINT


class Preemption:
    """Installs the handlers (call after jax.distributed starts, so they are the last)."""

    def __init__(self):
        self.received: str | None = None  # the name of the first signal seen
        self.interrupts = 0  # SIGINTs seen here
        self._interrupted = False  # some process saw SIGINT (known after agreed())
        for sig in SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                print("interrupted again: exiting now, without saving", file=sys.stderr,
                      flush=True)
                os._exit(INTERRUPTED)
        self.received = self.received or signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        """The exit status after the loop: 130 when any process saw SIGINT, else 0."""
        return INTERRUPTED if self._interrupted or self.interrupts else 0

    def agreed(self) -> bool:
        """True on every process when any process was signalled. All must call it."""
        import jax
        code = 2 if self.interrupts else 1 if self.received else 0
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            code = int(np.max(multihost_utils.process_allgather(np.int32(code))))
        self._interrupted = code == 2
        return code > 0
