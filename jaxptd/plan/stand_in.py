"""A GPU step that keeps state in host memory, compiled without a GPU: CPU devices stand in
for the target's devices while the step is lowered, and XLA's GPU compiler compiles what
was lowered for the target's topology devices.

Owns why and how. XLA's topology devices (jaxptd/runtime/target.py, `topology_devices`)
have no memory spaces, so JAX drops a sharding's memory kind on them: a step that offloads
(offload.optimizer, offload.activations) compiles there as one memory, the host's bytes
among the device's. CPU devices have a pinned_host memory: the step lowered on as many of
them for 'cuda' (`lowering_platforms`) carries its memory kinds and placement annotations,
and the GPU compiler puts those buffers in host memory as it would on the GPU (the
memory analysis's host_* sizes), the device's own bytes apart. Each CPU device stands at
the place of the topology device with its id, so the lowered shardings name the same
devices. The CPU devices must number the topology's: `jax_num_cpu_devices`, set before
JAX's backend starts (`plan.verify.start_cpu_compiler`); where it runs with fewer,
`available` says so and the caller compiles as one memory.
"""
from __future__ import annotations

import numpy as np

from jaxptd.runtime.target import compile_lowered


def available(count: int) -> bool:
    """Whether this process has `count` CPU devices to stand in with (it starts JAX's CPU
    backend)."""
    import jax
    try:
        return len(jax.devices("cpu")) >= count
    except RuntimeError:  # a process whose JAX runs on GPUs alone (JAX_PLATFORMS=cuda)
        return False


def mesh_for(topology_mesh):
    """The mesh of CPU devices standing in for a mesh of topology devices: the CPU device
    whose id is the topology device's, at each place, with the same axes."""
    import jax
    from jax.sharding import Mesh
    by_id = {d.id: d for d in jax.devices("cpu")}
    grid = np.vectorize(lambda d: by_id[d.id], otypes=[object])(topology_mesh.devices)
    return Mesh(grid, topology_mesh.axis_names, axis_types=topology_mesh.axis_types)


class Compiled:
    """What compile_check reads of a compiled step (`as_text`, `memory_analysis`), for a
    program XLA compiled without JAX's wrapper around it."""

    def __init__(self, executable):
        self._executable = executable

    def as_text(self) -> str:
        return self._executable.hlo_modules()[0].to_string()

    def memory_analysis(self):
        return self._executable.get_compiled_memory_stats()


def compile_for(lowered, topology_mesh, options: dict | None) -> Compiled:
    """A step lowered on the stand-ins of topology_mesh (`mesh_for`, with
    `lowering_platforms=('cuda',)`) compiled by XLA's GPU compiler for the mesh's devices,
    one replica and a partition each in the mesh's order (as JAX assigns a mesh's
    devices), with the step's XLA options (runtime/target.py's retries on options this
    XLA does not know). JAX has no public call that compiles a program for devices other
    than those it was lowered for: this one goes through its compiler module."""
    from jax._src import compiler
    from jax._src.lib import xla_client

    devices = list(topology_mesh.devices.flat)
    client = devices[0].client

    def compile_fn(lowered, options):
        build = compiler.get_compile_options(
            num_replicas=1, num_partitions=len(devices),
            device_assignment=np.array(devices, dtype=object).reshape(1, -1),
            env_options_overrides=dict(options), backend=client)
        return Compiled(client.compile(lowered.compiler_ir("stablehlo"),
                                       executable_devices=xla_client.DeviceList(
                                           tuple(devices)),
                                       compile_options=build))
    return compile_lowered(lowered, options, compile_fn)
