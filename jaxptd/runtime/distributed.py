"""Multi-process start-up: who the processes are, a roll-call, then `jax.distributed`.

Owns the process group of a run. One process per host (or per GPU) runs the same program;
JAX's multi-controller runtime (`jax.distributed`) joins them. `start(config)` must run
before any device work, after config validation. Where the process spec comes from, first
match wins:

1. config keys `runtime.coordinator`, `runtime.num_processes`, `runtime.process_id`;
2. environment JAXPTD_COORDINATOR, JAXPTD_NUM_PROCESSES, JAXPTD_PROCESS_ID (launch/local.sh);
3. SLURM's environment under `srun`: `jax.distributed.initialize()` with no arguments;
4. otherwise a single process, and `jax.distributed` is not started.

Invariants:

- Before `jax.distributed.initialize` every process reports to a roll-call served by
  process 0 on the coordinator's host at port (coordinator port - 1). JAX's own start-up
  timeout aborts without saying who is missing; the roll-call names the processes that
  never arrived within `runtime.init_timeout_s` and every process exits with an `error:`.
- `runtime.cpu_devices` is per process (default: data x pipe x context x tensor / processes); the
  device-count rule is checked by the caller against the global `jax.device_count()`.
- The roll-call's connections stay open for the run: jaxptd/runtime/peers.py watches the
  other processes over them (a death at once, silence after `runtime.heartbeat_timeout_s`)
  and ends this one with a line naming the lost process. jax.distributed's own heartbeat,
  which aborts the process with a C++ stack instead, gets twice that timeout: a backstop.
- The collectives' (gloo's) C++ code prints a connection line on stdout for every new
  communicator; unless `runtime.collective_logs` asks for them, a filter on file
  descriptor 1 removes those lines' pieces (and blank lines) and passes the rest through.
"""
from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass

from jaxptd.config import Config, ConfigError
from jaxptd.runtime.target import TARGETS

# gloo's line, written in pieces that threads interleave: "[Gloo] Rank 1 is connected to 3
# peer ranks. Expected number of connected peer ranks is : 3"
CHATTER = re.compile(rb"\[Gloo\] Rank ?\d*|\d* ?is connected to ?\d* ?(peer ranks\. ?)?|"
                     rb"(peer ranks\. ?)|Expected number of connected peer ranks is : ?\d*")
ENV = ("JAXPTD_COORDINATOR", "JAXPTD_NUM_PROCESSES", "JAXPTD_PROCESS_ID")
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")


class DistributedError(ConfigError):
    """A start-up failure a user can cause or fix (missing process, bad address)."""


@dataclass(frozen=True)
class Group:
    """The processes of a run as `start` joined them."""
    process: int  # this process's index (jax.process_index(), known before the backend is)
    hosts: dict  # {rank: host name}: every process's on process 0, this one's elsewhere
    links: dict  # {rank: socket} of the roll-call left open: process 0 to each, others to 0
    flush: object = None  # passes on what the stdout filter holds (before an os._exit)


@dataclass(frozen=True)
class ProcessSpec:
    coordinator: str  # host:port of process 0; "" for a single process
    num_processes: int
    process_id: int
    source: str  # where the spec came from: config, environment, slurm, single


def _int_env(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise DistributedError(f"{name}={os.environ[name]!r}: must be an integer") from None


def slurm_coordinator() -> str:
    """host:port that `jax.distributed.initialize()` derives from SLURM (first node)."""
    nodes = os.environ["SLURM_STEP_NODELIST"]
    cut = next((i for i, ch in enumerate(nodes) if ch in ",["), len(nodes))
    host = nodes[:cut]
    if cut < len(nodes) and nodes[cut] == "[":  # node[001-004,...]: the first index
        rest = nodes[cut + 1:]
        host += rest[:next((i for i, ch in enumerate(rest) if ch in ",-]"), len(rest))]
    port = int(os.environ["SLURM_JOB_ID"]) % 2**12 + (65535 - 2**12 + 1)
    return f"{host}:{port}"


def process_spec(config: Config) -> ProcessSpec:
    """Resolves the process group from config, JAXPTD_* environment, SLURM, or alone."""
    rt = config.runtime
    count = rt.num_processes or (_int_env(ENV[1]) if ENV[1] in os.environ else 0)
    if not count:
        if all(k in os.environ for k in SLURM_ENV) and int(os.environ["SLURM_NTASKS"]) > 1:
            return ProcessSpec(slurm_coordinator(), int(os.environ["SLURM_NTASKS"]),
                               int(os.environ["SLURM_PROCID"]), "slurm")
        return ProcessSpec("", 1, 0, "single")
    source = "config" if rt.num_processes else "environment"
    if count == 1:
        return ProcessSpec("", 1, 0, source)
    coordinator = rt.coordinator or os.environ.get(ENV[0], "")
    rank = rt.process_id
    if rank < 0:
        rank = _int_env(ENV[2]) if ENV[2] in os.environ else -1
    if ":" not in coordinator:
        raise DistributedError(f"runtime.coordinator={coordinator!r}: {count} processes need "
                               "host:port of process 0 (or JAXPTD_COORDINATOR)")
    if not 0 <= rank < count:
        raise DistributedError(f"runtime.process_id={rank}: must be in [0, {count}) (or set "
                               "JAXPTD_PROCESS_ID)")
    return ProcessSpec(coordinator, count, rank, source)


def _rollcall_address(coordinator: str) -> tuple[str, int]:
    host, port = coordinator.rsplit(":", 1)
    return host, int(port) - 1


def _read_line(conn: socket.socket) -> str:
    """One line, read a byte at a time: nothing after it is taken from the socket."""
    data = b""
    while not data.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        data += byte
    return data.decode().strip()


def _serve_rollcall(spec: ProcessSpec, timeout_s: int) -> tuple[dict, dict]:
    """Process 0: waits for every process's (id, host); names the missing ones.
    -> ({rank: host}, {rank: its connection, left open})."""
    _, port = _rollcall_address(spec.coordinator)
    server = socket.create_server(("", port), reuse_port=False)
    server.settimeout(1.0)
    arrived: dict[int, tuple[str, socket.socket]] = {}
    deadline = time.monotonic() + timeout_s
    with server:
        while len(arrived) < spec.num_processes - 1 and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.settimeout(10.0)
            rank, host = _read_line(conn).split()
            arrived[int(rank)] = (host, conn)
        missing = sorted(set(range(1, spec.num_processes)) - set(arrived))
        for _, conn in arrived.values():
            conn.sendall(b"missing\n" if missing else b"ok\n")
            if missing:
                conn.close()
    if missing:
        raise DistributedError(
            f"runtime.init_timeout_s={timeout_s}: processes {missing} of "
            f"{spec.num_processes} never arrived at {spec.coordinator} (arrived: "
            f"{[0] + sorted(arrived)})")
    return ({0: socket.gethostname(), **{r: h for r, (h, _) in arrived.items()}},
            {r: conn for r, (_, conn) in arrived.items()})


def _join_rollcall(spec: ProcessSpec, timeout_s: int) -> socket.socket:
    """Process > 0: reports to process 0 and waits until everyone has arrived.
    -> the connection to process 0, left open."""
    address = _rollcall_address(spec.coordinator)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection(address, timeout=2.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"runtime.init_timeout_s={timeout_s}: process {spec.process_id} found no "
                    f"process 0 at {spec.coordinator}") from None
            time.sleep(0.5)
    conn.sendall(f"{spec.process_id} {socket.gethostname()}\n".encode())
    conn.settimeout(timeout_s + 30)
    reply = _read_line(conn)
    if reply == "ok":
        return conn
    conn.close()
    raise DistributedError(f"runtime.init_timeout_s={timeout_s}: process "
                           f"{spec.process_id} gave up: not every process arrived "
                           "(process 0 names the missing ones)")


def start(config: Config):
    """Configures the platform, joins the process group; returns (jax, Group).

    Call before any other JAX work. Raises DistributedError naming missing processes.
    """
    import jax

    spec = process_spec(config)
    rt = config.runtime
    if rt.target != "auto":
        jax.config.update("jax_platforms",
                          "cpu" if TARGETS[rt.target].platform == "cpu" else "cuda")
    jax.config.update("jax_num_cpu_devices",
                      rt.cpu_devices or max(config.num_devices // spec.num_processes, 1))
    if spec.num_processes == 1:
        return jax, Group(0, {0: socket.gethostname()}, {})
    flush = None if rt.collective_logs else drop_collective_chatter()
    if spec.process_id == 0:
        hosts, links = _serve_rollcall(spec, rt.init_timeout_s)
    else:
        links = {0: _join_rollcall(spec, rt.init_timeout_s)}
        hosts = {spec.process_id: socket.gethostname(),
                 0: spec.coordinator.rsplit(":", 1)[0]}
    timeouts = dict(initialization_timeout=rt.init_timeout_s,  # peers.py's is the first
                    heartbeat_timeout_seconds=2 * rt.heartbeat_timeout_s)
    if spec.source == "slurm":
        jax.distributed.initialize(**timeouts)
    else:
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                                   **timeouts)
    return jax, Group(spec.process_id, hosts, links, flush)


def drop_collective_chatter():
    """Routes file descriptor 1 through a thread that drops gloo's connection lines
    (C++ writes there directly, so sys.stdout alone cannot filter them). At exit the real
    stdout is put back and the lines still in the pipe are passed on; -> the function
    that does so (for an exit that skips atexit)."""
    sys.stdout.flush()
    real = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as lines, os.fdopen(os.dup(real), "wb", 0) as out:
            for line in lines:
                kept = CHATTER.sub(b"", line)
                if kept.strip(b" 0123456789\n"):
                    out.write(kept if kept.endswith(b"\n") else kept + b"\n")

    thread = threading.Thread(target=pump, name="jaxptd-stdout-filter", daemon=True)
    thread.start()

    def restore():
        sys.stdout.flush()
        os.dup2(real, 1)  # closes the pipe's last write end: the pump reads to the end
        thread.join(timeout=5)

    atexit.register(restore)
    return restore


def lead_decides(jax, message: str | None) -> str | None:
    """Process 0's `message` (None: nothing to object) on every process, so that all stop
    with the same line where only process 0 could look (the run directory it alone
    writes). A collective: every process calls it at the same point."""
    if jax.process_count() == 1:
        return message
    import numpy as np
    from jax.experimental import multihost_utils
    text = (message or "").encode()[:4095]
    buffer = np.zeros(4096, np.uint8)  # [flag, UTF-8 text...]
    buffer[0] = message is not None
    buffer[1:1 + len(text)] = np.frombuffer(text, np.uint8)
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(buffer[1:]).rstrip(b"\0").decode(errors="replace") if buffer[0] else None


def describe_hosts(jax, hosts: dict[int, str]) -> str:
    """One line per process: its host and its local devices (printed by process 0)."""
    lines = [f"{jax.process_count()} processes, {jax.device_count()} devices "
             f"({jax.devices()[0].platform})"]
    for process in range(jax.process_count()):
        ids = [d.id for d in jax.devices() if d.process_index == process]
        lines.append(f"  process {process} on {hosts.get(process, '?')}: devices {ids}")
    return "\n".join(lines)
