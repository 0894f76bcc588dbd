"""The device mesh: axes (data, fsdp, pipe, expert, context, tensor), laid onto hosts as
PTD-P prescribes.

Owns the mesh-axis names and the device order. Devices are ordered by (process, local id)
and reshaped to [data, fsdp, pipe, expert, context, tensor], so the tensor axis is innermost: a
tensor-parallel group is `tensor` consecutive devices of one process (one host), never
spanning hosts (PTD-P Takeaway #1). Context parallelism comes next (Megatron-Core's order
puts it right after tensor too): its ranks pass every layer's keys and values round a ring,
2 b s/c k d bytes per step and c - 1 steps a layer, far more than the pipeline's one
activation per microbatch and stage, so it takes the next-fastest links (the rest of the
node, or the neighbouring nodes); pipe comes next and may cross hosts; the data-parallel
ranks are outermost. They form two axes: `fsdp`, the g = parallel.fsdp_size ranks of one FSDP
sharding group (consecutive data ranks: with tensor = pipe = 1 and g = GPUs per node, one
node), and `data`, the d / g groups that replicate each other (HSDP); without FSDP g = 1.
Expert parallelism takes a third part of the data ranks, `expert` (parallel.expert = e): the
ranks that split a mixture of experts' routed experts between them and exchange tokens by
all-to-all every MoE layer, twice forward and twice backward, each a microbatch's routed
tokens; so they sit inside pipe, next to context (Megatron-Core's order, tp-cp-ep-dp-pp),
on the fast links a node has when tensor x context x expert fits in it. The data axis then
holds d / (g e) groups. BATCH names all three: the batch is split over all d data ranks in
(data, fsdp, expert) order. Axis types are Auto: the training step is a fully manual shard_map,
and GSPMD handles what lies outside it.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxptd.config import ConfigError, ParallelConfig

DATA, FSDP, PIPE, EXPERT, CONTEXT, TENSOR = "data", "fsdp", "pipe", "expert", "context", "tensor"
AXES = (DATA, FSDP, PIPE, EXPERT, CONTEXT, TENSOR)
BATCH = (DATA, FSDP, EXPERT)  # every data-parallel rank
TOKENS = (*BATCH, CONTEXT)  # the axes a step's tokens are split over: rows, sequence


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """Builds the (data, fsdp, pipe, expert, context, tensor) mesh over `devices` (default: all).

    Raises ConfigError when the axis sizes do not multiply to the device count, or when a
    tensor group would span processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (parallel.data, parallel.pipe, parallel.context, parallel.tensor)
    total = int(np.prod(shape))
    if total != len(devices):
        raise ConfigError(
            "parallel.data x parallel.pipe x parallel.context x parallel.tensor = "
            f"{' x '.join(map(str, shape))} = {total}: must equal the device count "
            f"{len(devices)}")
    devices.sort(key=lambda d: (d.process_index, d.id))
    local = sum(1 for d in devices if d.process_index == devices[0].process_index)
    if local % parallel.tensor:
        raise ConfigError(
            f"parallel.tensor={parallel.tensor}: must divide the devices per process ({local}) "
            "so a tensor-parallel group stays inside one host"
        )
    g, e = parallel.fsdp_size, parallel.expert
    grid = np.array(devices, dtype=object).reshape(
        (parallel.data // (g * e), g, parallel.pipe, e, parallel.context, parallel.tensor))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh: Mesh) -> str:
    """One line per process: its devices' coordinates in the mesh (printed by rank 0)."""
    lines = [f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices"]
    by_process: dict[int, list[str]] = {}
    for coord in np.ndindex(mesh.devices.shape):
        device = mesh.devices[coord]
        by_process.setdefault(device.process_index, []).append(f"{device.id}@{coord}")
    for process, entries in sorted(by_process.items()):
        lines.append(f"  process {process}: " + " ".join(entries))
    return "\n".join(lines)
