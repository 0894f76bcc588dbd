"""Reading a compiled XLA program: its scheduled HLO text, as the GPU compiler left it.

Owns the static analysis the deviceless GPU check prints (jaxptd/compile_check.py): a
parser of the optimized HLO text (`parse`), the static cost report (`cost`), where
asynchronous collectives start and finish and what runs between (`collectives`), and the
loops with the conditionals inside them (`loops`). Text in, numbers out: no JAX, so the
tests can feed it any program.

The cost report counts as shared/DESIGN.md describes (so its figures compare with the
H100 issue's): walk the scheduled program from ENTRY; a while body counts times its trip
count (`known_trip_count`, else the loop condition's constant); a conditional counts its
costlier branch; calls and non-collective async computations are entered; collectives are
listed, not timed. Each kernel (fusion, custom call, copy, any other compute op) costs
max(FLOPs / peak, bytes / bandwidth). FLOPs: 2 x prod(result dims) x prod(contracting
dims) of every `dot` inside a fusion or cuBLAS call; cuDNN attention forward
4 b h sq skv d, halved with a causal mask, its backward 2.5 times that; nothing else.
Bytes: operands and results once each, except that a fusion operand read only through
(dynamic-)slice or gather costs the slices, and a dynamic-update-slice costs its update,
not the buffer it writes into. It shows structure, not speed: nothing is autotuned.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
              "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
              "f64": 64, "c64": 64, "c128": 128, "token": 0}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
# Ops that are no kernel of their own (they name, pack or order values).
STRUCTURAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
              "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
              "copy-done", "send-done", "recv-done", "async-done", "async-update"}
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all", "collective-broadcast", "ragged-all-to-all", "send", "recv"}


@dataclass
class Instr:
    name: str
    type: str  # the result type's text: an array or a tuple
    opcode: str
    operands: list  # operand instruction names
    args: str  # the text inside the parentheses (a parameter's number, a constant's value)
    attrs: str  # everything after the operand list

    def attr(self, key: str) -> str | None:
        """The value of `key=` (a name, a {...} group or a "string"), None if absent."""
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|\"[^\"]*\"|%?[\w.\-]+)", self.attrs)
        return None if m is None else m.group(1).strip('"').lstrip("%")

    def called(self) -> list:
        """Computations this instruction runs (fusion body, loop body, branches, ...)."""
        names = re.findall(r"\b(?:calls|to_apply|body|condition|true_computation|"
                           r"false_computation)=%?([\w.\-]+)", self.attrs)
        branches = self.attr("branch_computations")
        if branches:
            names += [b.strip().lstrip("%") for b in branches.strip("{}").split(",")]
        return names

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def backend_config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})\s*$", self.attrs)
        if not m:
            return {}
        try:
            return json.loads(m.group(1))
        except json.JSONDecodeError:
            return {}

    @property
    def base(self) -> str:
        """The opcode without -start/-done (all-reduce-start -> all-reduce)."""
        return re.sub(r"-(start|done)$", "", self.opcode)


@dataclass
class Computation:
    name: str
    instrs: list = field(default_factory=list)
    by_name: dict = field(default_factory=dict)

    @property
    def root(self) -> Instr:
        return self.instrs[-1] if self._root is None else self.by_name[self._root]

    _root: str | None = None


@dataclass
class Module:
    computations: dict
    entry: str

    def __getitem__(self, name: str) -> Computation:
        return self.computations[name]


def arrays(type_text: str) -> list:
    """[(dtype, dims)] of every array in a type (one for an array, several for a tuple)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x))
            for d, dims in _ARRAY.findall(type_text) if d in DTYPE_BITS]


def nbytes(type_text: str) -> float:
    return sum(math.prod(dims) * DTYPE_BITS[d] / 8 for d, dims in arrays(type_text))


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _instruction(line: str) -> tuple[Instr, bool] | None:
    m = _LINE.match(line)
    if m is None:
        return None
    rest = m.group(3)
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode, close = rest[:paren].strip(), _balanced(rest, paren)
    args = rest[paren + 1:close - 1]
    attrs = rest[close:].lstrip(", ")
    return Instr(m.group(2), type_text, opcode, re.findall(r"%([\w.\-]+)", args), args,
                 attrs), bool(m.group(1))


def parse(text: str) -> Module:
    """The computations of an HLO module's text (compiled.as_text())."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = Computation(m.group(2))
                if m.group(1):
                    entry = current.name
            continue
        if line.strip() == "}":
            computations[current.name], current = current, None
            continue
        parsed = _instruction(line)
        if parsed:
            instr, is_root = parsed
            current.instrs.append(instr)
            current.by_name[instr.name] = instr
            if is_root:
                current._root = instr.name
    assert entry is not None, "no ENTRY computation in the HLO text"
    return Module(computations, entry)


# --------------------------------------------------------------------------- cost


@dataclass
class Kernel:
    """One kernel of the program, launched `count` times a step."""
    name: str
    computation: str
    category: str  # gemm | attention | fill | stack write | copy | other
    phase: str  # forward | backward | update (from the op's jax name)
    flops: float
    bytes: float
    count: float
    is_layer: bool  # the op belongs to a transformer layer (Block)

    def seconds(self, peak: float, bandwidth: float) -> float:
        return max(self.flops / peak, self.bytes / bandwidth)


def trip_count(module: Module, loop: Instr) -> int:
    """A while loop's trip count: XLA's known_trip_count, else its condition's constant."""
    known = loop.backend_config().get("known_trip_count", {}).get("n")
    if known is not None:
        return int(known)
    values = [int(i.args) for i in module[loop.attr("condition")].instrs
              if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.args.strip())]
    return max(values, default=1)


def _first_dims(type_text: str) -> tuple:
    return arrays(type_text)[0][1]


def _dot_flops(comp: Computation, dot: Instr) -> float:
    """2 x prod(result dims) x prod(contracting dims) of one dot."""
    lhs = comp.by_name[dot.operands[0]]
    contracting = (dot.attr("lhs_contracting_dims") or "{}").strip("{}")
    size = math.prod(_first_dims(lhs.type)[int(d)] for d in contracting.split(",") if d)
    return 2.0 * math.prod(_first_dims(dot.type)) * size


def _dots_flops(module: Module, comp: Computation) -> float:
    """FLOPs of every dot in a fused computation and what it calls (nested GEMM fusions)."""
    return sum(_dot_flops(comp, i) if i.opcode == "dot" else 0.0 for i in comp.instrs) + \
        sum(_dots_flops(module, module[c]) for i in comp.instrs for c in i.called()
            if c in module.computations)


def _gemm_call_flops(comp: Computation, call: Instr) -> float:
    """A cuBLAS custom call: its dot dimension numbers are in the backend config."""
    dims = call.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs = _first_dims(comp.by_name[call.operands[0]].type)
    size = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(_first_dims(call.type)) * size


def _attention_flops(call: Instr) -> float:
    """cuDNN flash attention: 4 x the [b, h, sq, skv] intermediate x d forward, halved
    when causal; the backward 2.5 x that."""
    config = call.backend_config().get("cudnn_fmha_backend_config", {})
    scores = [int(x) for x in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    flops = 4.0 * math.prod(scores) * _first_dims(call.type)[-1] if scores else 0.0
    if config.get("mask_type") == "CAUSAL":
        flops /= 2
    return flops * (2.5 if "Backward" in (call.attr("custom_call_target") or "") else 1.0)


def _fusion_bytes(module: Module, comp: Computation, fusion: Instr) -> float:
    """Operands and results once, but slices read and updates written (module docstring)."""
    body = module[fusion.attr("calls")]
    users: dict = {}
    for i in body.instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = body.root
    outputs = [body.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    updated = {o.operands[0] for o in outputs if o.opcode == "dynamic-update-slice"}
    total = 0.0
    for param in (i for i in body.instrs if i.opcode == "parameter"):
        readers = users.get(param.name, [])
        if param.name in updated:
            continue  # the buffer written in place: its update counts, below
        if readers and all(r.opcode in ("slice", "dynamic-slice", "gather") for r in readers):
            total += sum(nbytes(r.type) for r in readers)
        else:
            total += nbytes(comp.by_name[fusion.operands[int(param.args)]].type)
    return total + sum(nbytes(body.by_name[o.operands[1]].type)
                       if o.opcode == "dynamic-update-slice" else nbytes(o.type)
                       for o in outputs)


def _phase(op_name: str) -> str:
    """forward, backward (autodiff's transpose) or update (outside the gradient)."""
    if "transpose(" in op_name:
        return "backward"
    return "forward" if "jvp(" in op_name else "update"


def kernel(module: Module, comp: Computation, instr: Instr, count: float) -> Kernel:
    """One kernel's category, FLOPs and bytes (module docstring)."""
    flops, category = 0.0, "other"
    plain = nbytes(instr.type) + sum(nbytes(comp.by_name[o].type) for o in instr.operands
                                     if o in comp.by_name)
    if instr.opcode == "fusion":
        body = module[instr.attr("calls")]
        flops, moved = _dots_flops(module, body), _fusion_bytes(module, comp, instr)
        outputs = body.root.operands if body.root.opcode == "tuple" else [body.root.name]
        if flops:
            category = "gemm"
        elif not instr.operands:
            category = "fill"
        elif any(body.by_name[o].opcode == "dynamic-update-slice" for o in outputs):
            category = "stack write"
    else:
        moved = plain
        target = instr.attr("custom_call_target") or ""
        if target.startswith("__cudnn$fmha"):
            flops, category = _attention_flops(instr), "attention"
        elif target.startswith("__cublas"):
            flops, category = _gemm_call_flops(comp, instr), "gemm"
        elif instr.opcode == "copy":
            category = "copy"
    op_name = instr.op_name
    return Kernel(instr.name, comp.name, category, _phase(op_name), flops, moved, count,
                  "Block/" in op_name)


def _is_collective_start(module: Module, instr: Instr) -> str | None:
    """The collective an instruction starts (None if it starts none)."""
    if instr.opcode == "async-start":
        wrapped = module[instr.attr("calls")].root
        return wrapped.base if wrapped.base in COLLECTIVES else None
    if instr.opcode in ("send", "recv") or (instr.opcode.endswith("-start")
                                            and instr.base in COLLECTIVES):
        return instr.base
    return None


def walk(module: Module, visit, comp: str | None = None, count: float = 1.0,
         branches=None) -> None:
    """Calls visit(computation, instruction, count) for every instruction the scheduled
    program runs, `count` times a step: loop bodies times their trip count, calls and
    non-collective async computations entered, and of a conditional the branches that
    `branches(conditional, names, count)` returns (default: all of them)."""
    comp = module[comp or module.entry]
    for instr in comp.instrs:
        visit(comp, instr, count)
        op = instr.opcode
        if op == "while":
            walk(module, visit, instr.attr("body"), count * trip_count(module, instr), branches)
        elif op == "conditional":
            names = instr.called()
            for name in names if branches is None else branches(instr, names, count):
                walk(module, visit, name, count, branches)
        elif op == "call" or (op == "async-start" and not _is_collective_start(module, instr)):
            walk(module, visit, instr.called()[0], count, branches)


def _counts_as_kernel(module: Module, instr: Instr) -> bool:
    return not (instr.opcode in STRUCTURAL or instr.opcode in ("while", "conditional", "call",
                                                               "async-start", "copy-start")
                or instr.base in COLLECTIVES)


def cost(module: Module, peak: float, bandwidth: float) -> list:
    """Every kernel the step launches (Kernel, with its launches a step) in program order,
    of each conditional its costlier branch."""
    def kernels_of(comp: str | None, count: float) -> list:
        found = []

        def visit(c, instr, n):
            if _counts_as_kernel(module, instr):
                found.append(kernel(module, c, instr, n))
        walk(module, visit, comp, count, costlier)
        return found

    def costlier(_, names, count):
        seconds = [sum(k.seconds(peak, bandwidth) * k.count for k in kernels_of(n, count))
                   for n in names]
        return [names[seconds.index(max(seconds))]]
    return kernels_of(None, 1.0)


# --------------------------------------------------------------------------- overlap


@dataclass
class Collective:
    """One asynchronous (or synchronous) collective and what runs while it is in flight."""
    name: str
    kind: str  # all-reduce, all-gather, reduce-scatter, collective-permute, send, recv, ...
    computation: str
    bytes: float
    count: float  # times a step
    overlap: tuple  # what runs between start and done: 'gemm', 'attention', 'loop'
    between: int  # kernels scheduled between start and done
    op_name: str


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
        elif _counts_as_kernel(module, instr):
            category = kernel(module, comp, instr, 1).category
            if category in ("gemm", "attention"):
                kinds.add(category)
    return kinds


def collectives(module: Module) -> list:
    """Every collective the step runs (every branch of a conditional), with its overlap."""
    found = []

    def visit(comp, instr, count):
        kind = _is_collective_start(module, instr)
        if kind is None:
            if instr.base in COLLECTIVES and not instr.opcode.endswith("-done"):
                found.append(Collective(instr.name, instr.base, comp.name, nbytes(instr.type),
                                        count, (), 0, instr.op_name))  # synchronous
            return
        position = comp.instrs.index(instr)
        done = next((j for j, i in enumerate(comp.instrs)
                     if i.opcode.endswith("-done") and instr.name in i.operands), None)
        between = _between(comp, position, done)
        found.append(Collective(
            instr.name, kind, comp.name, _message_bytes(module, instr), count,
            tuple(sorted(_compute_in(module, comp, between))),
            sum(_counts_as_kernel(module, i) for i in between), instr.op_name))
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


# --------------------------------------------------------------------------- loops


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
                          _count(module, body, lambda i: _is_collective_start(module, i)
                                 is not None),
                          _count(module, body, lambda i: _counts_as_kernel(module, i))))
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
