"""Preemption: SIGTERM or SIGUSR1 ends the run cleanly at a step every process agrees on.

Owns the signal handlers of a training run. SLURM sends SIGTERM at cancellation and
preemption, and `sbatch --signal=USR1@T` sends SIGUSR1 T seconds before the time limit.
A handler only records the signal; the loop calls `agreed()` once per step, a collective
that ORs every process's flag, so all processes leave the loop after the same step even
when only one of them was signalled. The loop then saves that step and exits 0, and a
requeued job resumes from it.
"""
from __future__ import annotations

import signal

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers (call after jax.distributed starts, so they are the last)."""

    def __init__(self):
        self.received: str | None = None  # the name of the first signal seen
        for sig in SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, _frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every process when any process was signalled. All must call it."""
        import jax
        if jax.process_count() == 1:
            return self.received is not None
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        return bool(np.any(flags))
