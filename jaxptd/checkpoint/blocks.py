"""A process's blocks of the global arrays of a train state, and their way between
processes: to the host as one buffer, from one process to another (a collective), and
back into global arrays in any sharding. The local checkpoint tier (local.py) writes and
reads them.

A part is what one process's devices hold: a manifest (JSON: per leaf its name, shape,
dtype, spec and the distinct blocks, each as [start, stop] per dimension; the mesh's axis
names, shape and device ids) and one uint8 buffer of the blocks, leaf after leaf, block
after block. `pack` puts both in one buffer (an 8-byte length, the manifest, the blocks),
`host_blocks` a state's part straight into one.

`exchange` hands every process's buffer to the process `shift` further on (mod the count),
spread over the local devices as rows of a [devices, width] uint8 array in rounds of at
most CHUNK bytes a device, and moved by `jax.device_put` onto the mesh with each device
replaced by the same-numbered device of that process: one compiled transfer for the
whole state, bounded device memory, bytes that arrive as they left.
"""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxptd.checkpoint.checksums import leaf_name

CHUNK = 1 << 28  # bytes a device carries in one round of an exchange
HEADER = 8  # bytes of the manifest's length at the head of a packed part


def host_blocks(state, extra: dict) -> np.ndarray:
    """This process's part of `state` (global arrays, NamedShardings over one mesh), packed:
    the manifest (with `extra`'s entries) and the distinct blocks its devices hold, copied
    once into one uint8 buffer."""
    leaves, datas = [], []
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        indices = {}
        for shard in x.addressable_shards:
            indices.setdefault(_bounds(shard.index, x.shape), shard.data)
        datas += [np.asarray(data).reshape(-1).view(np.uint8) for data in indices.values()]
        leaves.append({"name": leaf_name(path), "shape": list(x.shape), "dtype": str(x.dtype),
                       "spec": [list(e) if isinstance(e, tuple) else e
                                for e in x.sharding.spec],
                       "blocks": [[list(b) for b in index] for index in indices]})
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    record = {"names": list(mesh.axis_names), "shape": list(mesh.devices.shape),
              "devices": [int(d.id) for d in mesh.devices.flat]}
    return pack({**extra, "leaves": leaves, "mesh": record}, datas)


def pack(manifest: dict, datas: list[np.ndarray]) -> np.ndarray:
    """One uint8 buffer: the manifest's length, the manifest (JSON), then `datas` (uint8)."""
    text = json.dumps(manifest).encode()
    buffer = np.empty(HEADER + len(text) + sum(d.size for d in datas), np.uint8)
    buffer[:HEADER] = np.frombuffer(np.int64(len(text)).tobytes(), np.uint8)
    buffer[HEADER:HEADER + len(text)] = np.frombuffer(text, np.uint8)
    offset = HEADER + len(text)
    for data in datas:
        buffer[offset:offset + data.size] = data
        offset += data.size
    return buffer


def unpack(buffer: np.ndarray) -> tuple[dict, np.ndarray]:
    """(manifest, blocks: a view into `buffer`) of a packed part."""
    size = int(buffer[:HEADER].view(np.int64)[0])
    return json.loads(bytes(buffer[HEADER:HEADER + size])), buffer[HEADER + size:]


def exchange(buffer: np.ndarray, shift: int) -> np.ndarray:
    """Sends `buffer` (uint8) to process (p + shift) % n; -> the buffer process
    (p - shift) % n sent. A collective: every process calls it, with any buffer size."""
    n, p, local = jax.process_count(), jax.process_index(), jax.local_device_count()
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(buffer.size))).reshape(-1)
    width = max(1, min(CHUNK, math.ceil(int(sizes.max()) / local)))
    devices = [sorted((d for d in jax.devices() if d.process_index == q), key=lambda d: d.id)
               for q in range(n)]
    rows = NamedSharding(Mesh(np.array(sum(devices, []), object), ("rows",)), P("rows"))
    moved = NamedSharding(Mesh(np.array(sum(devices[shift % n:] + devices[:shift % n], []),
                                        object), ("rows",)), P("rows"))
    received = []
    for start in range(0, int(sizes.max()), local * width):
        piece = buffer[start:start + local * width]  # [local devices x width], padded
        if piece.size < local * width:
            piece = np.concatenate([piece, np.zeros(local * width - piece.size, np.uint8)])
        piece = piece.reshape(local, width)
        sent = jax.make_array_from_callback(
            (n * local, width), rows, lambda index: piece[index[0].start - p * local][None])
        arrived = jax.device_put(sent, moved)  # row i: on process i // local + shift
        received += [np.asarray(s.data).reshape(-1) for s in
                     sorted(arrived.addressable_shards, key=lambda s: s.index[0].start)]
    return np.concatenate(received or [np.zeros(0, np.uint8)])[:sizes[(p - shift) % n]]


def from_blocks(leaf: dict, mesh: Mesh, blocks: dict) -> jax.Array:
    """The global array of a manifest's `leaf` in its saved spec over `mesh`, each device's
    block from `blocks` ({block bounds: array}, this process's)."""
    shape = tuple(leaf["shape"])
    sharding = NamedSharding(mesh, P(*[tuple(e) if isinstance(e, list) else e
                                       for e in leaf["spec"]]))
    return jax.make_array_from_callback(shape, sharding,
                                        lambda index: blocks[_bounds(index, shape)])


def split(manifest: dict, data: np.ndarray) -> dict:
    """{leaf name: {block bounds: array}} of a part (views into `data`)."""
    out, offset = {}, 0
    for leaf in manifest["leaves"]:
        dtype = jnp.dtype(leaf["dtype"])
        out[leaf["name"]] = {}
        for block in leaf["blocks"]:
            shape = [stop - start for start, stop in block]
            nbytes = math.prod(shape) * dtype.itemsize
            out[leaf["name"]][tuple(map(tuple, block))] = \
                data[offset:offset + nbytes].view(dtype).reshape(shape)
            offset += nbytes
    return out


def mesh_of(record: dict) -> Mesh:
    """The mesh of a manifest's record over this run's devices (the caller checked that
    they are all here)."""
    by_id = {d.id: d for d in jax.devices()}
    devices = np.array([by_id[i] for i in record["devices"]], dtype=object)
    return Mesh(devices.reshape(record["shape"]), tuple(record["names"]))


def _bounds(index: tuple, shape: tuple) -> tuple:
    """A shard's index (slices) as ((start, stop), ...) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))
