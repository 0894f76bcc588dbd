"""The node-local checkpoint tier (issue #51): frequent saves of each process's blocks of
the train state to its own node's storage, each also copied to a peer process on another
node, beside the persistent tier (store.py); restored when newer than that tier's newest.

Owns `LocalTier` and its directory. Under `checkpoint.local_dir` (`{process}` replaced by
the process index, so that processes on one machine can stand for nodes) each process
writes only its own directory:

    process-<p>/<step>/own/    the blocks process p's devices held at <step> (blocks.py)
    process-<p>/<step>/peer/   those of process (p - shift) % n, sent over at the save
      blocks.bin               the blocks' bytes
      manifest.json            blocks.py's manifest, and owner, processes, the run
                               (checkpoint.dir), the size and CRC-32 of blocks.bin

`shift` is the number of processes on process 0's host (ranks are numbered host by host,
as srun and launch/local.sh do), so the copy lies on the next host; 1 when every process
shares one host; no copy with one process.

Invariants:

- Each part is written under `<step>/<part>.partial-<pid>` and renamed once written and
  flushed, so a process killed mid-save leaves no part that restore reads (the next start
  removes the leftover). The copy to the host and the exchange with the peer (a
  collective) run in the step's thread on every process; background threads write the
  files while training goes on, the own part's before the exchange begins (a peer lost in
  it costs not this copy), one save in flight; a fault exit gives them SETTLE_S to finish
  (watchdog.AT_FAULT). A failed write is one warning line: the run goes on with the steps
  already written and the persistent tier.
- Restore is a collective that agrees on everything through allgathers, so a damaged or
  missing part never hangs a process: each process reports the parts it can read (cheap
  checks: manifest, size); the newest step above the persistent tier's newest whose every
  owner's blocks are readable (its own copy first, else its peer's) is loaded (CRC-32
  checked; a damaged part is one warning line, then the next copy or an older step); a
  peer's copy goes back to its owner by the inverse exchange; every process places its
  blocks in the saved layout, then in the run's: any parallel layout over the same
  processes and devices (another count restores from the persistent tier). The steps
  after the one restored, from either tier, are removed: an abandoned history, whose parts
  must never stand beside a new save's of the same step.

Orbax's emergency checkpointing (orbax.checkpoint.experimental.emergency) is not used: its
local tier keeps whole data-parallel replicas, none on the primary one and no copy on a
peer, so it restores nothing when the state is sharded over the replica axis (ZeRO-1,
FSDP), has no local tier at data = 1, and one node's lost directory loses the local step
(tried on CPU processes: the commit that added this module says how).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import weakref
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxptd.checkpoint import ModelMismatch
from jaxptd.checkpoint.blocks import exchange, from_blocks, host_blocks, mesh_of, pack, \
    split, unpack
from jaxptd.checkpoint.checksums import leaf_name
from jaxptd.checkpoint.files import check_writable, complete_steps, read_json
from jaxptd.checkpoint.store import read_target, resize
from jaxptd.runtime import watchdog
from jaxptd.runtime.runlog import LOG, one_line

BLOCKS, MANIFEST, PARTS = "blocks.bin", "manifest.json", ("own", "peer")
MAX_STEPS = 16  # steps each process reports at a restore (more than checkpoint.local_keep)
ABSENT, READABLE, DAMAGED = 0, 1, 2  # a part's status in the restore's table
SETTLE_S = 10.0  # a fault exit's wait for a save's files (the others end within seconds)


class LocalTier:
    """Saves every `every` steps into this process's directory under `template`, keeps
    `keep`, restores the newest step complete across the processes' copies. `run`: the
    persistent checkpoint directory, which names the run (another run's steps are not
    restored)."""

    def __init__(self, template: str, every: int, keep: int, run: str):
        self.template, self.every, self.keep, self.run = template, every, keep, run
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.directory = os.path.join(check_writable(
            self.root(self.process), "checkpoint.local_dir"), f"process-{self.process}")
        os.makedirs(self.directory, exist_ok=True)
        self.shift = _peer_shift(self.processes)
        self._writers: list[threading.Thread] = []
        self._failure: str | None = None
        self._notes: set[str] = set()
        watchdog.AT_FAULT.append(weakref.WeakMethod(self._settle))

    def root(self, process: int) -> str:
        """The local directory of `process` (as that process names it)."""
        return os.path.abspath(self.template.replace("{process}", str(process)))

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def steps(self) -> list[int]:
        """The steps this process holds parts of, ascending."""
        return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

    def save(self, step: int, state) -> None:
        """Copies this process's blocks of the logical `state` to the host and to its peer
        (a collective: every process, the same step), then writes both in the background."""
        self.wait()
        sent = host_blocks(state, {"step": step, "processes": self.processes, "run": self.run,
                                   "owner": self.process})
        self._start(step, "own", unpack(sent))
        if self.shift:
            self._start(step, "peer", unpack(exchange(sent, self.shift)))

    def _start(self, step: int, part: str, packed: tuple) -> None:
        writer = threading.Thread(target=self._write, args=(step, part, *packed), daemon=True,
                                  name=f"jaxptd-local-save-{part}")
        writer.start()
        self._writers.append(writer)

    def _write(self, step: int, part: str, manifest: dict, data: np.ndarray) -> None:
        final = os.path.join(self.directory, str(step), part)
        partial = f"{final}.partial-{os.getpid()}"
        try:
            _write_part(partial, manifest, data)
            if os.path.isdir(final):  # a part of an abandoned history (restore skipped it)
                shutil.rmtree(final)
            os.replace(partial, final)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            self._failure = f"local checkpoint step {step} not saved in {self.directory} " \
                f"({one_line(e)}); training goes on with the steps already there"

    def wait(self) -> None:
        """Waits for the save in flight; reports a failed one in one warning line."""
        for writer in self._writers:
            writer.join()
        self._writers = []
        if self._failure:
            LOG.warning(self._failure)
            self._failure = None

    def close(self) -> None:
        self.wait()

    def _settle(self) -> None:
        """On a fault exit: the save in flight gets SETTLE_S to finish its files (its
        blocks are on the host, its peer's too: the step survives the fault)."""
        deadline = time.monotonic() + SETTLE_S
        for writer in self._writers:
            writer.join(max(0.0, deadline - time.monotonic()))

    def discard_after(self, step: int) -> None:
        """Removes this process's steps after `step`, the one the run resumes from: an
        abandoned history's (damaged or incomplete ones the restore skipped), which a later
        save of the same step must not meet beside its new parts. Another run's stay."""
        for newer in (s for s in self.steps() if s > step):
            step_dir = os.path.join(self.directory, str(newer))
            manifests = [_check_part(os.path.join(step_dir, part))[0] for part in PARTS]
            if all(m is None or m["run"] == self.run for m in manifests):
                shutil.rmtree(step_dir, ignore_errors=True)
                LOG.info(f"local checkpoint {step_dir} removed: after the step resumed from")

    def restore_newer(self, abstract_state, vocab_size: int, than: int):
        """(logical state in `abstract_state`'s shardings, step) of the newest step above
        `than` whose blocks every process can get; None when there is none. A collective.
        Raises ModelMismatch when the step holds another model's leaves."""
        for step in self.steps():  # parts of saves killed before their rename
            step_dir = os.path.join(self.directory, str(step))
            for name in os.listdir(step_dir):
                if ".partial-" in name:
                    shutil.rmtree(os.path.join(step_dir, name), ignore_errors=True)
        found = self._scan()
        while True:
            table = _gather(_encode(found))  # [processes, MAX_STEPS, 3]
            self._warn_damaged(table, than)
            plan = _plan(table, self.processes, self.shift, than)
            if plan is None:
                return None
            step, sources = plan
            loaded, failed = self._load(step, sources)
            if not _gather(np.array([len(failed)], np.int64)).any():
                return self._assemble(step, sources, loaded, abstract_state, vocab_size), step
            for part in failed:  # the next round's table shows them: _warn_damaged
                found[step][part] = DAMAGED

    def _scan(self) -> dict[int, dict]:
        """{step: {part: status}} of this process's newest steps (the cheap checks)."""
        found = {}
        for step in self.steps()[-MAX_STEPS:]:
            found[step] = {}
            for part in PARTS:
                path = os.path.join(self.directory, str(step), part)
                if not os.path.isdir(path):
                    continue
                manifest, problem = _check_part(path)
                other = problem is None and self._other(manifest)
                if other:
                    self._note(f"local checkpoints in {self.directory} skipped: {other}")
                found[step][part] = ABSENT if other else DAMAGED if problem else READABLE
        return found

    def _other(self, manifest: dict) -> str | None:
        """Why a readable part is not this run's to restore (None: it is)."""
        if manifest["run"] != self.run:
            return f"written by another run (checkpoint.dir={manifest['run']})"
        if manifest["processes"] != self.processes or \
                not set(manifest["mesh"]["devices"]) <= {d.id for d in jax.devices()}:
            return f"written by {manifest['processes']} processes with devices " \
                f"{manifest['mesh']['devices']}, not these (the persistent tier restores " \
                "into any count)"
        return None

    def _note(self, line: str) -> None:
        """`line` as a warning, once."""
        if line not in self._notes:
            self._notes.add(line)
            LOG.warning(line)

    def _warn_damaged(self, table: np.ndarray, than: int) -> None:
        """One line for each damaged part of a step above `than` (process 0's is shown)."""
        for process, rows in enumerate(table):
            for step, *codes in rows:
                for part, code in zip(PARTS, codes):
                    if code == DAMAGED and step > than:
                        self._note(f"local checkpoint step {step}: the {part} copy in "
                                   f"{self.root(process)}/process-{process} is damaged; "
                                   "skipped")

    def _load(self, step: int, sources: list[str]):
        """({part: (manifest, blocks)} of the parts this process serves, [damaged parts])."""
        owners = {"own": self.process, "peer": (self.process - self.shift) % self.processes}
        loaded, failed = {}, []
        for part, owner in owners.items():
            if sources[owner] != part or (part == "peer" and not self.shift):
                continue
            path = os.path.join(self.directory, str(step), part)
            manifest, problem = _check_part(path)
            data = None if problem else np.fromfile(os.path.join(path, BLOCKS), np.uint8)
            if data is not None and zlib.crc32(data) != manifest["crc32"]:
                problem = f"{BLOCKS}: data does not match its CRC-32"
            if problem:  # this process's own log says why; process 0 says where
                LOG.warning(f"local checkpoint {path} is damaged ({problem}); skipped")
                failed.append(part)
            else:
                loaded[part] = (manifest, data)
        return loaded, failed

    def _assemble(self, step, sources, loaded, abstract_state, vocab_size):
        """The agreed parts, every process's own blocks back with it, in `abstract_state`."""
        peers = sources.count("peer")
        own = loaded.get("own")
        if peers:  # the peers' copies go back to their owners
            manifest, data = loaded.get("peer", ({}, None))
            sent = pack(manifest, [data]) if data is not None else np.zeros(0, np.uint8)
            back = exchange(sent, -self.shift)
            own = unpack(back) if sources[self.process] == "peer" else own
        manifest, data = own
        mesh, blocks = mesh_of(manifest["mesh"]), split(manifest, data)
        targets = {leaf_name(p): (p, want) for p, want in
                   jax.tree_util.tree_leaves_with_path(abstract_state)}
        saved = {leaf["name"] for leaf in manifest["leaves"]}
        if saved != set(targets):
            raise ModelMismatch(f"local checkpoint step {step} has leaves "
                                f"{sorted(saved ^ set(targets))[:3]} that this run does not")
        placed = {}
        for leaf in manifest["leaves"]:
            path, want = targets[leaf["name"]]
            placed[leaf["name"]] = _place(from_blocks(leaf, mesh, blocks[leaf["name"]]), path,
                                          want, vocab_size)
        LOG.info(f"local checkpoint step {step}: {self.processes - peers} processes' blocks "
                 f"from their own copies, {peers} from their peers'")
        return jax.tree_util.tree_map_with_path(lambda p, _: placed[leaf_name(p)],
                                                abstract_state)


def restore_newest(local: LocalTier | None, ckpt, abstract_state, vocab_size: int):
    """(state, step, where) of the local tier's newest complete step when it is newer
    than the persistent tier's (`ckpt`, a store.Checkpointer, or None), else of the
    persistent tier's newest readable step; None when neither holds one. A collective."""
    newest = max(complete_steps(ckpt.directory), default=0) if ckpt else 0
    restored = local.restore_newer(abstract_state, vocab_size, newest) if local else None
    if restored is not None:
        if ckpt:  # as restore_latest does: no later save meets a killed one's leftovers
            ckpt.remove_half_written()
        where = f"the local tier (checkpoint.local_dir={local.template})"
    else:
        restored = ckpt.restore_latest(abstract_state, vocab_size) if ckpt else None
        where = ckpt.directory if restored else None
    if local:
        local.discard_after(restored[1] if restored else 0)
    return None if restored is None else (*restored, where)


def _peer_shift(processes: int) -> int:
    """Processes from one to its peer: those on process 0's host; 1 when all share one."""
    if processes == 1:
        return 0
    host = np.int64(zlib.crc32(socket.gethostname().encode()))
    hosts = np.asarray(multihost_utils.process_allgather(host)).reshape(-1)
    same = int((hosts == hosts[0]).sum())
    return 1 if same == processes else same


def _write_part(directory: str, manifest: dict, data: np.ndarray) -> None:
    """blocks.bin, then its manifest (with its size and CRC-32), both flushed to disk."""
    os.makedirs(directory)  # (and its step's directory)
    with open(os.path.join(directory, BLOCKS), "wb") as f:
        f.write(data.data)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({**manifest, "size": int(data.size), "crc32": zlib.crc32(data)}, f)
        f.flush()
        os.fsync(f.fileno())


def _check_part(path: str):
    """(manifest, None) when `path`'s manifest reads and blocks.bin has its size, else
    (None, why not)."""
    try:
        manifest = read_json(os.path.join(path, MANIFEST))
        size = os.path.getsize(os.path.join(path, BLOCKS))
        if not {"run", "processes", "owner", "leaves", "mesh", "size", "crc32"} <= \
                manifest.keys():
            return None, f"{MANIFEST}: incomplete"
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return None, one_line(e)
    if size != manifest["size"]:
        return None, f"{BLOCKS}: {size} bytes, expected {manifest['size']}"
    return manifest, None


def _encode(found: dict) -> np.ndarray:
    """[MAX_STEPS, 3] int64 rows (step, own status, peer status); -1 pads."""
    table = np.full((MAX_STEPS, 3), -1, np.int64)
    for row, step in enumerate(sorted(found)[-MAX_STEPS:]):
        table[row] = [step] + [found[step].get(p, ABSENT) for p in PARTS]
    return table


def _gather(array: np.ndarray) -> np.ndarray:
    """[processes, ...] of every process's `array` (a collective)."""
    if jax.process_count() == 1:
        return array[None]
    return np.asarray(multihost_utils.process_allgather(array))


def _plan(table: np.ndarray, processes: int, shift: int, than: int):
    """(step, [per owner: "own" or "peer"]) of the newest step above `than` whose every
    owner's blocks are readable, own copy first; None when no step is."""
    status = {}
    for process, rows in enumerate(table):
        for step, *codes in rows:
            for part, code in zip(PARTS, codes):
                status[(int(step), process, part)] = code
    for step in sorted({s for s, _, _ in status if s > than}, reverse=True):
        sources = []
        for owner in range(processes):
            if status.get((step, owner, "own")) == READABLE:
                sources.append("own")
            elif shift and status.get((step, (owner + shift) % processes, "peer")) == READABLE:
                sources.append("peer")
            else:
                break
        if len(sources) == processes:
            return step, sources
    return None


def _place(x: jax.Array, path, want, vocab_size: int) -> jax.Array:
    """A restored leaf in the run's sharding (and padded vocabulary rows, as store.py)."""
    if x.shape == tuple(want.shape):
        return jax.device_put(x, want.sharding)
    target = read_target(path, want, x.shape, vocab_size)
    return resize(jax.device_put(x, target.sharding), want)
