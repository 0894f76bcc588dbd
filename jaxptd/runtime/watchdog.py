"""The fault path of a run: a hung step or a lost process ends the job; it never hangs.

Owns how a run ends on a fault (`Watchdog.fail`), from any thread: one line naming the
step, the process that failed and the process that stops (`error: ...` on stderr;
process 0's also in train.log), every Python thread's stack (faulthandler) in
<train.run_dir>/stacks/step-<N>-process-<K>.txt, then exit status FAULT = 75 (sysexits'
EX_TEMPFAIL: try again) at once, through os._exit: no atexit handler runs, so no shutdown
barrier waits for the lost process (only AT_FAULT's, which wait a bounded time). launch/slurm/train.sbatch requeues a job whose step
ends so; the relaunched run resumes from the newest checkpoint.

Owns the progress watchdog too: each process watches its own loop. A training step must
finish within `runtime.watchdog_factor` x the median of the last WINDOW step times, and
never less than `runtime.watchdog_min_s`; the start-up (restore, compile, the first step)
and each evaluation and checkpoint save (`slow`) get `runtime.watchdog_first_s`. A frozen
or lost peer shows here as a step that never finishes (every process waits in the step's
collectives), a hang inside this process as well. `runtime.watchdog_factor=0` turns the
watchdog off. Should the Python thread not get to run (a C call holding the interpreter
lock), faulthandler's own thread ends the process at twice the limit (status 1, the
stacks on stderr).

`watch` starts both watches of a run's process: this watchdog and, with several
processes, the watch of the others (jaxptd/runtime/peers.py), which ends this process when
another dies or freezes, and which tells the others of this one's fault, so they stop at
once with the same line rather than at their own limits. `Watchdog.leave` ends them both.
"""
from __future__ import annotations

import collections
import faulthandler
import os
import statistics
import sys
import threading
import time

from jaxptd.runtime.peers import PeerWatch
from jaxptd.runtime.runlog import LOG

FAULT = 75  # the exit status of a run ended by a fault (a relaunch resumes it)
WINDOW = 100  # recent step times whose median sets the step limit
POLL_S = 0.25  # how often the watchdog's thread looks
SETTLE_S = 3.0  # how long an unexpected error waits for the peer watch's verdict
# What runs before the fault exit, which skips atexit: weak references to callables, each
# bounding its own wait (checkpoint/local.py's files of a save in flight, so that a save
# every process has copied survives the fault).
AT_FAULT: list = []


def watch(config, group) -> "Watchdog":
    """The watchdog of this process (from step 0 until the run sets `step`) and, when
    `group` (distributed.Group) has links to other processes, their watch."""
    watchdog = Watchdog(config.runtime, config.train.run_dir, group.process, 0,
                        group.process == 0, group.flush)
    if group.links:
        watchdog.peers = PeerWatch(group.links, group.process, group.hosts,
                                   config.runtime.heartbeat_timeout_s, watchdog.fail)
    return watchdog


class Watchdog:
    """The progress watchdog of this process and its fault exit.

    Args:
      runtime: the config's RuntimeConfig (watchdog_factor, watchdog_min_s, watchdog_first_s).
      run_dir: where stacks/ goes.
      process: this process's index; `lead`: it writes train.log (process 0).
      step: the step the run starts from (the last step finished; `beat` moves it).
      flush: called before the exit (passes on what the stdout filter holds), or None.
    """

    def __init__(self, runtime, run_dir: str, process: int, step: int, lead: bool,
                 flush=None):
        self.factor, self.min_s, self.first_s = (runtime.watchdog_factor,
                                                 runtime.watchdog_min_s,
                                                 runtime.watchdog_first_s)
        self.run_dir, self.process, self.lead, self.flush = run_dir, process, lead, flush
        self.step = step  # the last step finished
        self.times = collections.deque(maxlen=WINDOW)  # seconds of recent steps
        self.since = time.monotonic()  # when the work now watched began
        self.doing = "the start-up (restore, compile, the first step)"  # None: a step
        self.peers = None  # the PeerWatch of a run of several processes
        self._exiting = threading.Lock()
        self._stop = threading.Event()
        self._limit = self._work_limit()
        if self.factor:
            threading.Thread(target=self._watch, name="jaxptd-watchdog", daemon=True).start()
            self._arm()

    def limit(self) -> tuple[float, str]:
        """(seconds, why) the work now running may take (set by the main thread)."""
        return self._limit

    def _work_limit(self) -> tuple[float, str]:
        if self.doing is not None or not self.times:
            return self.first_s, f"runtime.watchdog_first_s={self.first_s}"
        median = statistics.median(self.times)
        return max(self.min_s, self.factor * median), (
            f"runtime.watchdog_factor={self.factor:g} x the median step {median:.3g} s, at "
            f"least runtime.watchdog_min_s={self.min_s}")

    def beat(self, step: int) -> None:
        """Step `step` finished (the loop's iteration, its save and evaluation included)."""
        now = time.monotonic()
        if self.doing is None:
            self.times.append(now - self.since)
        self.step, self.since, self.doing = step, now, None
        self._limit = self._work_limit()
        self._arm()

    def slow(self, what: str) -> None:
        """Long work begins (an evaluation, a save): `runtime.watchdog_first_s` until the next
        beat. `what` names it in the fault line: 'saving step 6'."""
        self.since, self.doing = time.monotonic(), what
        self._limit = self._work_limit()
        self._arm()

    def leave(self, code: int) -> None:
        """This process ends with exit status `code`: the watches stop, the others are told.
        An unexpected error (code 1) in a run of several processes often follows another's
        death (a collective failing): the peer watch gets SETTLE_S to end this process with
        the line naming that one first."""
        if self.peers is not None and code == 1:
            time.sleep(SETTLE_S)
        self._stop.set()
        if self.factor:
            faulthandler.cancel_dump_traceback_later()
        if self.peers is not None:
            self.peers.leave(code)

    def _arm(self) -> None:
        """The C-level backstop: at twice the limit from now, stacks on stderr, exit 1."""
        if self.factor:
            faulthandler.dump_traceback_later(2 * self.limit()[0] + 1, exit=True)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            limit, why = self.limit()
            if time.monotonic() - self.since > limit:
                what = self.doing or f"step {self.step + 1}"
                suspects = self.peers.silent() if self.peers is not None else ""
                self.fail(f"process {self.process}: {what} did not finish within {limit:.0f} s"
                          f" ({why}){suspects}", origin=True)

    def fail(self, reason: str, origin: bool = False) -> None:
        """Ends the process on a fault: never returns. `reason` names the process that failed
        and why; `origin`: this process found it (the others are told)."""
        if not self._exiting.acquire(blocking=False):  # another thread is already ending it
            while True:
                time.sleep(60)
        faulthandler.cancel_dump_traceback_later()
        if origin and self.peers is not None:
            self.peers.tell(reason)
        path = os.path.join(self.run_dir, "stacks",
                            f"step-{self.step + 1}-process-{self.process}.txt")
        line = (f"{reason}; process {self.process} stops at step {self.step + 1} with exit "
                f"status {FAULT} for a restart (thread stacks: {_write_stacks(path, reason)})")
        if self.lead:
            LOG.error(line)
        else:
            print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.flush is not None:
            self.flush()
        for finish in (ref() for ref in AT_FAULT):
            if finish is not None:
                finish()
        os._exit(FAULT)


def _write_stacks(path: str, reason: str) -> str:
    """Every Python thread's stack into `path` under a header line -> path, or why not."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {reason}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        return path
    except OSError as e:
        return f"not written: {path}: {e.strerror}"
