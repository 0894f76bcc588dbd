"""What the schedule of a compiled step runs when: every collective with what is in flight
between its start and its done, and every loop with the conditionals its body holds."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxptd.hlo.cost import collective_started, counts_as_kernel, kernel, trip_count, walk
from jaxptd.hlo.text import COLLECTIVES, DTYPE_BITS, Computation, Instr, Module, arrays, nbytes


@dataclass
class Collective:
    """One asynchronous (or synchronous) collective and what runs while it is in flight."""
    name: str
    kind: str  # all-reduce, all-gather, reduce-scatter, collective-permute, send, recv, ...
    computation: str
    bytes: float
    count: float  # times a step
    overlap: tuple  # what runs between start and done: 'gemm', 'attention', 'loop'
    kernels: tuple  # the Kernels scheduled between start and done (not inside loops/calls)
    op_name: str
    group: int | None = None  # ranks in each of its replica groups (None: not written)

    def link_bytes(self) -> float:
        """Bytes one rank moves over its links in a ring of `group` ranks, from `bytes`
        (what it delivers): an all-gather receives (g - 1) / g of its output, a
        reduce-scatter sends g - 1 parts the size of its output, an all-reduce twice
        (g - 1) / g of its buffer, an all-to-all (g - 1) / g; a permute, send or recv, or
        a collective of unknown group, its bytes."""
        g = self.group
        if not g or self.kind not in _RING:
            return self.bytes
        return self.bytes * _RING[self.kind](g)

    def in_flight_s(self, peak: float, bandwidth: float, fp8_peak: float | None = None
                    ) -> float:
        """Static seconds of the kernels in flight (each Kernel.seconds): whether they can
        hide the transfer, where `overlap` says only what kind of work is there."""
        return sum(k.seconds(peak, bandwidth, fp8_peak) for k in self.kernels)


_RING = {"all-gather": lambda g: (g - 1) / g, "reduce-scatter": lambda g: g - 1,
         "all-reduce": lambda g: 2 * (g - 1) / g, "all-to-all": lambda g: (g - 1) / g}


def _group_size(module: Module, start: Instr) -> int | None:
    """Ranks in each replica group of the collective `start` starts (its own attribute,
    or the wrapped collective's of an async-start): {{0,1},{2,3}} or the iota form
    [groups,size]<=[...]; None where none is written."""
    instr = module[start.attr("calls")].root if start.opcode == "async-start" else start
    m = re.search(r"replica_groups=(?:\[\d+,(\d+)\]<=|\{\{([\d,]*)\})", instr.attrs)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else len(m.group(2).split(","))


def _between(comp: Computation, start: int, done: int | None) -> list:
    """Instructions scheduled after the start and before the done (wrapping around the
    loop body when the done comes first: the collective crosses an iteration)."""
    if done is None:
        return comp.instrs[start + 1:]
    if done > start:
        return comp.instrs[start + 1:done]
    return comp.instrs[start + 1:] + comp.instrs[:done]


def _compute_in(module: Module, comp: Computation, instrs) -> set:
    """The kinds of real compute among instructions: gemm, attention, loop."""
    kinds = set()
    for instr in instrs:
        if instr.opcode == "while":
            kinds.add("loop")
        elif instr.opcode in ("conditional", "call"):
            for name in instr.called():
                kinds |= _compute_in(module, module[name], module[name].instrs)
        elif counts_as_kernel(module, instr):
            category = kernel(module, comp, instr, 1).category
            if category in ("gemm", "attention"):
                kinds.add(category)
    return kinds


def collectives(module: Module) -> list:
    """Every collective the step runs (every branch of a conditional), with its overlap."""
    found = []

    def visit(comp, instr, count):
        kind = collective_started(module, instr)
        if kind is None:
            if instr.base in COLLECTIVES and not instr.opcode.endswith("-done"):
                found.append(Collective(instr.name, instr.base, comp.name, nbytes(instr.type),
                                        count, (), (), instr.op_name,
                                        _group_size(module, instr)))  # synchronous
            return
        position = comp.instrs.index(instr)
        done = next((j for j, i in enumerate(comp.instrs)
                     if i.opcode.endswith("-done") and instr.name in i.operands), None)
        between = _between(comp, position, done)
        found.append(Collective(
            instr.name, kind, comp.name, _message_bytes(module, instr), count,
            tuple(sorted(_compute_in(module, comp, between))),
            tuple(kernel(module, comp, i, 1) for i in between if counts_as_kernel(module, i)),
            instr.op_name, _group_size(module, instr)))
    walk(module, visit)
    return found


def _message_bytes(module: Module, start: Instr) -> float:
    """Bytes a collective delivers: an async computation's result, an all-reduce's
    (possibly combined) operands, else the largest array of the start's tuple (a send's
    data beside its token, a gather's output beside its input)."""
    if start.opcode == "async-start":
        return nbytes(module[start.attr("calls")].root.type)
    if start.base == "all-reduce":
        return nbytes(start.type)
    return max(math.prod(dims) * DTYPE_BITS[d] / 8 for d, dims in arrays(start.type))




@dataclass(frozen=True)
class Loop:
    """A while loop: how often it runs, and what its body holds (nested loops apart)."""
    name: str
    computation: str
    body: str
    trip: int
    count: float  # times the loop itself runs a step
    conditionals: int
    collectives: int
    kernels: int  # kernels per iteration (outside nested loops)


def loops(module: Module) -> list:
    """Every while loop of the step, outermost first."""
    found = []

    def visit(comp, instr, count):
        if instr.opcode != "while":
            return
        body = module[instr.attr("body")]
        found.append(Loop(instr.name, comp.name, body.name, trip_count(module, instr), count,
                          _count(module, body, lambda i: i.opcode == "conditional"),
                          _count(module, body, lambda i: collective_started(module, i)
                                 is not None),
                          _count(module, body, lambda i: counts_as_kernel(module, i))))
    walk(module, visit)
    return found


def _count(module: Module, comp: Computation, test) -> int:
    """Instructions of a computation (and its calls and branches, not nested loops) that
    pass `test`."""
    total = 0
    for instr in comp.instrs:
        total += bool(test(instr))
        if instr.opcode in ("conditional", "call"):
            total += sum(_count(module, module[c], test) for c in instr.called())
    return total
