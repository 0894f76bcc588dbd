"""`python -m jaxptd.plan`: plan a PTD-P run before it runs, and check the plan against XLA.

The planner, a package of one owner per module (none imports JAX until a function
needs it; --verify configures JAX first):

    inputs.py   PlanInputs: the hardware (jaxptd/runtime/target.py's record, the flags' numbers
                in it), the time model's sustained FLOP/s (None: the kernel model), the
                platform planned for
    counts.py   the real model's parameter count and per-device shards, from
                `jax.eval_shape` of the initialiser and the logical sharding rules (no
                mesh, no memory, so a 3072-GPU config plans on a laptop)
    model.py    the memory model: parameters, activations, device and host bytes
    timing.py   the time model: bubble, communication volumes, links, step time, training
                days, context parallelism's traffic, overlap, balance and attention work,
                expert parallelism's all-to-all
    kernels.py  the compute model on a GPU target: GEMMs at the measured ceiling and
                their wave quantization, other kernels at the HBM rate, launches; or
                from a compiled step's static kernel costs
    program.py  what the step does: its recomputation, the schedule's bubble and buffers
                from the simulator and the lowering, flash attention, the head's spread
    planner.py  one plan: memory and time for a config -> the report
    search.py   --search N: the layouts and memory options that fit, ranked
    verify.py   --verify: the real step compiled (never run) on simulated CPU devices,
                XLA's memory and cost analyses beside the plan
    report.py   the text report, the search table, the memory picture
    cli.py      the command line (__main__.py runs it); --verify for a GPU --target
                compiles for it without one (jaxptd/plan/compile_check.py)

Device memory is --memory-gb per device, host memory --host-memory-gb per node shared by
--gpus-per-node devices (offloading puts optimizer state and layer inputs there); a plan
fits when both do. `device_memory_bytes` is the one place a run's pre-flight check gets
the per-device total from.
"""
from jaxptd.plan.cli import main
from jaxptd.plan.counts import real_counts
from jaxptd.plan.inputs import PlanInputs
from jaxptd.plan.planner import (device_memory_bytes, executed_flops, plan, recomputation,
                                 schedule_stats)
from jaxptd.plan.verify import verify

__all__ = ["PlanInputs", "device_memory_bytes", "executed_flops", "main", "plan", "real_counts",
           "recomputation", "schedule_stats", "verify"]
