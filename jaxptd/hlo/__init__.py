"""Reading a compiled XLA program: its scheduled HLO text, as the GPU compiler left it.

The package owns the static analysis the deviceless GPU check prints
(jaxptd/plan/compile_check.py): a parser of the optimized HLO text (`parse`), the static cost
report (`cost`), where asynchronous collectives start and finish and what runs between
(`collectives`), and the loops with the conditionals inside them (`loops`). Text in,
numbers out: no JAX, so the tests can feed it any program.

The cost report counts as shared/DESIGN.md describes (so its figures compare with the
H100 issue's): walk the scheduled program from ENTRY; a while body counts times its trip
count (`known_trip_count`, else the loop condition's constant); a conditional counts its
costlier branch; calls and non-collective async computations are entered; collectives are
listed, not timed, and so are the asynchronous copies between host and device memory
(copy-start, and the async fusions of a slice of a host buffer: `counts_as_kernel`).
Each kernel (fusion, custom call, copy, any other compute op) costs max(FLOPs / peak,
bytes / bandwidth). FLOPs: 2 x prod(result dims) x prod(contracting
dims) of every `dot` inside a fusion or cuBLAS call; cuDNN attention and the Pallas
flash-attention blocks (pallas_kernels/flash.py) forward 4 b h sq skv d, halved with a
causal mask, their backward 2.5 times that; nothing else.
Bytes: operands and results once each, except that a fusion operand read only through
(dynamic-)slice or gather (bitcasts and elementwise operations between) costs the slices, and a dynamic-update-slice
or a scatter costs its update, not the buffer it writes into. It shows structure, not speed: nothing is
autotuned.

Modules: `text` (the parser), `cost` (the kernels a step launches and their static cost;
`walk`, the traversal the others share), `schedule` (collectives and what overlaps them,
loops and the conditionals inside them).
"""
from jaxptd.hlo.cost import Kernel, cost, kernel, trip_count, walk
from jaxptd.hlo.schedule import Collective, Loop, collectives, loops
from jaxptd.hlo.text import (COLLECTIVES, DTYPE_BITS, Computation, Instr, Module, arrays,
                             nbytes, parse)

__all__ = ["COLLECTIVES", "DTYPE_BITS", "Collective", "Computation", "Instr", "Kernel", "Loop",
           "Module", "arrays", "collectives", "cost", "kernel", "loops", "nbytes", "parse",
           "trip_count", "walk"]
