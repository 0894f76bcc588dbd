"""The other processes of a run: a process that dies, freezes or fails ends the job at once.

Owns the connections the roll-call leaves open (jaxptd/runtime/distributed.py): every
process > 0 keeps its TCP connection to process 0 for the whole run, a star. One thread a
process reads them and writes lines:

- `beat`, every runtime.heartbeat_timeout_s / 10 (at most every second), both ways;
- `bye CODE`, a process leaving on purpose with exit status CODE (`leave`);
- `lost RANK REASON`, a fault: sent by the process that found one (`tell`, for its own
  watchdog's), and relayed by process 0 to every other.

Verdicts (each ends this process through `fail`, jaxptd/runtime/watchdog.py, and process
0 relays it first):

- a connection closed without `bye`: that process died (SIGKILL, a crash, its host gone),
  found at once (the kernel closes a dead process's sockets);
- nothing heard for runtime.heartbeat_timeout_s: that process is stopped or frozen, or its
  network is cut;
- `bye CODE` with CODE != 0 and this process still running GRACE_S later: that process
  failed alone (a process that fails with the same error as every other leaves first).

Measured before this watch (jax 0.10.2, 4 CPU processes, heartbeat 30 s): a SIGKILLed
process 1 ended the others 17.7 s later, process 0 within 1 s, a SIGSTOPped process 27.6
s later, each by jax.distributed's coordination service aborting the process (SIGABRT,
a C++ stack on stderr, the lost process named inside a multi-line status). JAX offers no
public hook into that, so its heartbeat stays only as the backstop (twice this one's
timeout); this watch names the process in one line, at once for a death.
"""
from __future__ import annotations

import selectors
import socket
import threading
import time

GRACE_S = 5.0  # how long a process that left with an error may be followed before a verdict


class PeerWatch:
    """Watches `links` ({rank: connected socket}: process 0 holds one for every other
    process, the others one to process 0) and calls `fail(reason)` on a verdict.

    Args:
      me: this process's index; hosts: {rank: host name} (for the lines; may be partial).
      timeout_s: runtime.heartbeat_timeout_s.
      fail: Watchdog.fail, which never returns (the watch stops before it calls one).
    """

    def __init__(self, links: dict[int, socket.socket], me: int, hosts: dict[int, str],
                 timeout_s: float, fail):
        self.links, self.me, self.hosts, self.timeout_s = dict(links), me, hosts, timeout_s
        self.fail = fail
        self.interval = min(1.0, timeout_s / 10)
        now = time.monotonic()
        self.heard = {rank: now for rank in self.links}
        self.left: dict[int, tuple[int, float]] = {}  # rank -> (exit status, when)
        self._buffers = {rank: b"" for rank in self.links}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxptd-peers", daemon=True)
        self._thread.start()

    def name(self, rank: int) -> str:
        host = self.hosts.get(rank)
        return f"process {rank}" + (f" on {host}" if host else "")

    def silent(self) -> str:
        """'; silent: process 1 on node-b for 10 s' for the watched processes not heard for
        three beats (a hung step's likely cause), '' when there is none."""
        now = time.monotonic()
        quiet = [f"{self.name(rank)} for {now - heard:.0f} s" for rank, heard in
                 self.heard.items() if rank not in self.left and now - heard > 3 * self.interval]
        return f"; silent: {', '.join(quiet)}" if quiet else ""

    def tell(self, reason: str) -> None:
        """This process failed (its watchdog): the others end with `reason`."""
        self._send(self.links, f"lost {self.me} {reason}")

    def leave(self, code: int) -> None:
        """This process leaves on purpose with exit status `code`: the watch ends."""
        self._stop.set()
        self._send(self.links, f"bye {code}")
        self._thread.join(timeout=2)
        for sock in self.links.values():
            sock.close()

    def _send(self, links: dict[int, socket.socket], line: str) -> None:
        data = (" ".join(line.split()) + "\n").encode()
        with self._send_lock:
            for sock in links.values():
                try:
                    sock.sendall(data)
                except OSError:
                    pass  # its reader finds out why

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for rank, sock in self.links.items():
            sock.settimeout(self.interval)
            selector.register(sock, selectors.EVENT_READ, rank)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send(self.links, "beat")
                next_beat = now + self.interval
            for key, _ in selector.select(timeout=self.interval / 2):
                self._read(key.data, key.fileobj, selector)
            if not self._stop.is_set():
                self._check(time.monotonic())

    def _read(self, rank: int, sock: socket.socket, selector) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            data = b""
        if not data:
            selector.unregister(sock)
            if rank not in self.left and not self._stop.is_set():
                self._verdict(rank, f"{self.name(rank)} died (its connection closed without "
                                    "a goodbye: killed, crashed or its host lost)")
            return
        self.heard[rank] = time.monotonic()
        *lines, self._buffers[rank] = (self._buffers[rank] + data).split(b"\n")
        for line in lines:
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "bye":
                self.left[rank] = (int(rest or 0), time.monotonic())
            elif word == "lost":
                lost, _, reason = rest.partition(" ")
                self._verdict(int(lost), reason, told_by=rank)

    def _check(self, now: float) -> None:
        for rank in self.links:
            code, when = self.left.get(rank, (None, now))
            if code is None and now - self.heard[rank] > self.timeout_s:
                self._verdict(rank, f"{self.name(rank)} sent nothing for "
                                    f"{now - self.heard[rank]:.0f} s (runtime.heartbeat_timeout_s"
                                    f"={self.timeout_s:g}: stopped, frozen or cut off)")
            elif code and now - when > GRACE_S:
                self._verdict(rank, f"{self.name(rank)} exited with status {code}")

    def _verdict(self, lost: int, reason: str, told_by: int | None = None) -> None:
        """Process 0 relays the verdict to every process but the lost one and the teller;
        then this process ends."""
        if self.me == 0:
            if told_by is not None and "; silent: " not in reason:
                reason += self.silent()  # what only process 0 sees
            others = {r: s for r, s in self.links.items() if r not in (lost, told_by)}
            self._send(others, f"lost {lost} {reason}")
        self._stop.set()
        self.fail(reason)
