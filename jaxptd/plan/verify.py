"""`python -m jaxptd.plan --verify` on simulated CPU devices: the real step compiled
(never run) beside the plan.

Owns starting JAX for it (`cpu_backend`, `start_cpu_compiler`: before anything else
starts JAX, which is why JAX and the step are imported inside the functions) and
`verify`, which puts XLA's memory and cost analyses beside the plan's numbers.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from jaxptd.config import Config, ConfigError
from jaxptd.plan import compile_check
from jaxptd.plan.planner import recomputation
from jaxptd.train.metrics import recomputed_flops

MAX_VERIFY_DEVICES = 1024


def verify(config: Config, report: dict, dump: str | None = None) -> dict:
    """Compiles (never runs) the real step on simulated CPU devices from abstract,
    sharded arguments and puts XLA's analyses beside the plan: its memory, and with the
    step dumped into `dump` (cpu_backend) the device peak, its temporaries live at
    once but for those a GPU program keeps in host memory (_in_host_memory). The backend
    must already have config.num_devices devices (cpu_backend sets jax_num_cpu_devices first)."""
    # JAX on use: cpu_backend configures it first (the module docstring)
    import jax
    import jax.numpy as jnp
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.model import batch_width
    from jaxptd.train.step import Setup, build_train_step

    if len(jax.devices()) < config.num_devices:
        raise ConfigError(f"--verify needs {config.num_devices} devices, the backend has "
                          f"{len(jax.devices())}")
    mesh = make_mesh(config.parallel, jax.devices()[: config.num_devices])
    setup = Setup(config, mesh)
    batch = jax.ShapeDtypeStruct((config.train.global_batch, batch_width(config.model)),
                                 jnp.int32, sharding=setup.batch_sharding)
    try:
        abstract = setup.state_layout.abstract_state()
        compiled = build_train_step(setup).lower(abstract, batch).compile()
    except Exception as e:  # noqa: BLE001 -- reported, e.g. pipe > 1 before the executor
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"--verify: compiling the step failed: {type(e).__name__}: "
                          f"{first[:300]}") from None
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = {k: float(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in
           ("argument", "output", "alias", "temp", "generated_code", "host_argument",
            "host_output", "host_alias", "host_temp")}
    xla["total"] = sum(xla[k] + xla[f"host_{k}"] for k in ("argument", "output", "temp")) \
        - xla["alias"] - xla["host_alias"] + xla["generated_code"]
    arguments, device, total = _planned_on_cpu(config, report)
    peaks = compile_check.live_peaks(dump, _in_host_memory(config, setup))
    return {"xla_memory": xla, "xla_flops": float(cost.get("flops", 0.0)),
            "xla_device_peak": peaks and peaks["device"], "planned_device": device,
            "planned_arguments": arguments, "planned_temp": total - arguments,
            "planned_total": total, "memory_ratio": total / xla["total"],
            "planned_flops_loop_bodies": _loop_body_flops(config, report)}


def _in_host_memory(config: Config, setup):
    """dims -> whether the CPU program's buffer of those dimensions is one a GPU program
    keeps in host memory, by its shape: unpipelined, with offload.optimizer the stacked
    layer gradients [L, ...] (shaped like the state's layer leaves), with
    offload.activations the stacked layer inputs [L, b, s, h] ([L, b, s/t, h] with SP;
    L: the stack's elements, model.units)."""
    import jax
    par, model = config.parallel, config.model
    grads = {tuple(leaf.sharding.shard_shape(leaf.shape))
             for leaf in jax.tree.leaves(setup.state_layout.abstract_state()["params"]["layers"])}
    split = par.tensor if par.sequence_parallel else 1
    inputs = (model.units, config.microbatch_size, model.seq_len // split,
              model.hidden_size)

    def in_host(dims) -> bool:
        return par.pipe == 1 and ((config.offload.optimizer and tuple(dims) in grads) or (
            config.offload.activations and tuple(dims) == inputs))
    return in_host


def _planned_on_cpu(config: Config, report: dict) -> tuple[float, float, float]:
    """(the state's bytes, the device's, all bytes) a device of the CPU program the check
    compiles holds by the plan (made for the CPU program: PlanInputs.platform "cpu"). On CPU
    the host and device memory kinds are one memory: the state is the argument wherever
    it lives, and what a GPU program keeps in host memory (offloaded layer inputs and
    gradients) are temporaries like the rest."""
    device, host = report["memory_bytes_per_device"], report["host_memory_bytes_per_device"]
    state = host if config.offload.optimizer else device
    return (state["weights"] + state["optimizer"], device["total"],
            device["total"] + host["total"])


def _loop_body_flops(config: Config, report: dict) -> float:
    """What XLA's cost analysis counts: it counts a while loop's body once, so the
    microbatch scan and the layer scan contribute one microbatch through one element of
    the stack, a layer or a unit of model.moe_every (forward, backward and what model.remat
    recomputes; Appendix) plus the logit
    layer (6 b s h V), per device (a context rank's s/c tokens). A step that reduces
    gradients inside the last microbatch's backward runs that microbatch outside the scan:
    two microbatches."""
    from jaxptd.model import get  # JAX on use: cpu_backend configures it first
    m_cfg, par = config.model, config.parallel
    tokens = config.microbatch_size * m_cfg.seq_len
    per_token = get(m_cfg).forward_flops(m_cfg, m_cfg.padded_vocab(par.tensor))
    layer = m_cfg.unit * (3 * per_token["layer"]
                          + recomputed_flops(m_cfg, per_token, recomputation(config)))
    bodies = 2 if config.peels_last_microbatch else 1
    return bodies * tokens * (layer + 3 * per_token["head"]) / (par.tensor * par.context)


def cpu_backend(config: Config) -> str | None:
    """Starts JAX on config.num_devices simulated CPU devices for --verify, XLA dumping the
    step (its buffers' live ranges give the device peak) into a directory removed at
    exit, which it returns (None where JAX already runs: no device peak). The step is
    compiled afresh: a step from the persistent compilation cache dumps nothing."""
    if config.num_devices > MAX_VERIFY_DEVICES:
        raise ConfigError(f"--verify: {config.num_devices} devices is more than "
                          f"{MAX_VERIFY_DEVICES} simulated CPU devices can compile")
    dump = dump_dir()
    start_cpu_compiler(dump)
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", config.num_devices)
    jax.config.update("jax_enable_compilation_cache", False)
    return dump


def dump_dir() -> str | None:
    """A new directory for XLA's dump of the step (its memory report and buffers' live
    ranges), removed at exit (left behind, the dumps of H100 compiles once filled a CI
    machine's disk); None where JAX already runs (XLA reads its flags once, when it starts)."""
    if "jax" in sys.modules:
        return None
    dump = tempfile.mkdtemp(prefix="jaxptd-xla-")
    atexit.register(shutil.rmtree, dump, True)
    return dump


def start_cpu_compiler(dump: str | None, cpu_devices: int = 1) -> None:
    """Before JAX starts: CPU devices only (the GPU ones are XLA's topology devices), as
    many as cpu_devices (the stand-ins of an offloading step: stand_in.py), and XLA told
    where to dump the step's memory report (`dump`, None: nowhere)."""
    if "jax" in sys.modules:
        return
    if dump:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                            compile_check.dump_flags(dump)])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", cpu_devices)


