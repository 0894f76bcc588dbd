"""The parser of XLA's optimized HLO text: modules, computations, instructions, and the
bytes of an HLO type. No JAX."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
              "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
              "f64": 64, "c64": 64, "c128": 128, "token": 0, "f8e4m3fn": 8, "f8e5m2": 8,
              "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8,
              "f8e8m0fnu": 8}
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
