"""The kernels a compiled step launches and their static cost (the package docstring
says how it counts), and `walk`, the traversal of the scheduled program the other
analyses share."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jaxptd.hlo.text import COLLECTIVES, STRUCTURAL, Computation, Instr, Module, arrays, nbytes


# The op names of pallas_kernels/flash.py's calls (JAX's Pallas flash attention): the
# kernels' own names, and the scope flash.py puts a causal block under.
FLASH_CALL = r"/mha_(forward|backward)/pallas_call"
FLASH_CAUSAL = "flash_causal"


@dataclass
class Kernel:
    """One kernel of the program, launched `count` times a step."""
    name: str
    computation: str
    category: str  # gemm | attention | fill | stack write | copy | other
    phase: str  # forward | backward | rounds | update (from the op's jax name: `phase`)
    flops: float
    bytes: float
    count: float
    is_layer: bool  # the op belongs to a transformer layer (layers.Block: '(Block)' or
    # 'Block/' in its jax name, as a layer is applied alone or inside its module)
    fp8: bool = False  # a GEMM whose every dot takes two 8-bit float operands
    op_name: str = ""  # the jax op that made it (its metadata)

    def seconds(self, peak: float, bandwidth: float, fp8_peak: float | None = None) -> float:
        """max(FLOPs / peak, bytes / bandwidth), an FP8 GEMM's FLOPs at fp8_peak (given)."""
        rate = fp8_peak if self.fp8 and fp8_peak else peak
        return max(self.flops / rate, self.bytes / bandwidth)


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


def _dots(module: Module, comp: Computation) -> list:
    """(computation, dot) of every dot in a fused computation and what it calls (nested
    GEMM fusions)."""
    return [(comp, i) for i in comp.instrs if i.opcode == "dot"] + \
        [d for i in comp.instrs for c in i.called() if c in module.computations
         for d in _dots(module, module[c])]


def _fp8(comp: Computation, instr: Instr) -> bool:
    """Whether a dot (or GEMM call) takes 8-bit float operands, both of them: an operand
    converted up from FP8 inside the fusion makes it a 16-bit GEMM."""
    return all(comp.by_name[o].type.startswith("f8") for o in instr.operands[:2]
               if o in comp.by_name)


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


def _flash_flops(comp: Computation, call: Instr) -> float:
    """A Pallas flash-attention block (pallas_kernels/flash.py, JAX's Triton kernels): q and
    k its first operands [b, n, heads, d], [b, m, heads, d]; 4 x b heads n m d forward,
    halved under flash.py's causal scope; the backward 2.5 x that."""
    (b, n, heads, d), m = (_first_dims(comp.by_name[call.operands[0]].type),
                           _first_dims(comp.by_name[call.operands[1]].type)[1])
    flops = 4.0 * b * heads * n * m * d / (2 if f"/{FLASH_CAUSAL}/" in call.op_name else 1)
    return flops * (2.5 if "/mha_backward/" in call.op_name else 1.0)


# Elementwise operations: a fused kernel computes an element of one only where an element
# of its result is needed
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
               "convert", "select", "compare", "and", "or", "not", "xor", "clamp",
               "shift-left", "shift-right-arithmetic", "shift-right-logical"}
SLICES = ("slice", "dynamic-slice", "gather")


def _sliced(users: dict, name: str) -> list | None:
    """The slices (SLICES) that every use of fused value `name` leads to through bitcasts
    and elementwise operations (only their elements are read), None if some use reads
    more. E.g. the sign of a gradient sum's first element, which the pipeline's
    `varying.after` makes an index depend on: a slice of an add of two whole sums, which
    reads one element of each."""
    found = []
    for r in {u.name: u for u in users.get(name, [])}.values():
        if r.opcode in SLICES and r.operands[0] == name:
            found.append(r)
            continue
        more = _sliced(users, r.name) if r.opcode == "bitcast" or r.opcode in ELEMENTWISE \
            else None
        if not more:
            return None
        found += more
    return found or None


def _fusion_bytes(module: Module, comp: Computation, fusion: Instr) -> float:
    """Operands and results once, but slices read and updates written (module docstring)."""
    body = module[fusion.attr("calls")]
    users: dict = {}
    for i in body.instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = body.root
    outputs = [body.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    # the buffer an update (dynamic-update-slice: operand 1) writes into in place, and an
    # operand a scatter (its updates: operand 2) does (a scatter into a buffer made inside
    # the fusion writes it whole)
    written = {"dynamic-update-slice": 1, "scatter": 2}
    in_place = [o for o in outputs if o.opcode == "dynamic-update-slice" or (
        o.opcode == "scatter" and body.by_name[o.operands[0]].opcode == "parameter")]
    updated = {o.operands[0] for o in in_place}
    total = 0.0
    for param in (i for i in body.instrs if i.opcode == "parameter"):
        if param.name in updated:
            continue  # the buffer written in place: its update counts, below
        slices = _sliced(users, param.name)
        if slices:
            total += sum(nbytes(r.type) for r in slices)
        else:
            total += nbytes(comp.by_name[fusion.operands[int(param.args)]].type)
    return total + sum(nbytes(body.by_name[o.operands[written[o.opcode]]].type)
                       if o in in_place else nbytes(o.type) for o in outputs)


# The name scope of a pipeline's rounds (pipeline/executor.py), which `phase` reads.
ROUNDS_SCOPE = "pipeline_rounds"


def phase(op_name: str) -> str:
    """forward, backward (autodiff's transpose), rounds (outside the gradient, in a
    pipeline's rounds: storing values in their slot buffers and reading them out, the sends,
    summing the microbatches' gradients) or update (the rest: the optimizer, the gradient
    norm). Counted as update, the rounds' slot copies made a pipelined step's optimizer look
    several times costlier than the same optimizer on one device."""
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "rounds" if f"{ROUNDS_SCOPE}/" in op_name else "update"


def kernel(module: Module, comp: Computation, instr: Instr, count: float) -> Kernel:
    """One kernel's category, FLOPs and bytes (module docstring)."""
    flops, category, fp8 = 0.0, "other", False
    plain = nbytes(instr.type) + sum(nbytes(comp.by_name[o].type) for o in instr.operands
                                     if o in comp.by_name)
    if instr.opcode == "fusion":
        body = module[instr.attr("calls")]
        dots = _dots(module, body)
        flops, moved = sum(_dot_flops(c, d) for c, d in dots), _fusion_bytes(module, comp, instr)
        fp8 = bool(dots) and all(_fp8(c, d) for c, d in dots)
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
        elif target == "__gpu$xla.gpu.triton" and re.search(FLASH_CALL, instr.op_name):
            flops, category = _flash_flops(comp, instr), "attention"
        elif target.startswith("__cublas"):
            flops, category, fp8 = _gemm_call_flops(comp, instr), "gemm", _fp8(comp, instr)
        elif instr.opcode == "copy":
            category = "copy"
    op_name = instr.op_name
    return Kernel(instr.name, comp.name, category, phase(op_name), flops, moved, count,
                  re.search(r"\bBlock\b", op_name) is not None, fp8, op_name)


def collective_started(module: Module, instr: Instr) -> str | None:
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
        elif op == "call" or (op == "async-start" and not collective_started(module, instr)):
            walk(module, visit, instr.called()[0], count, branches)


# XLA's layout of a buffer in host memory (a pinned_host value: offloaded state or layer
# inputs), e.g. f16[8,20,512,12288]{3,2,1,0:S(5)}
HOST_MEMORY = ":S(5)}"


def counts_as_kernel(module: Module, instr: Instr) -> bool:
    """Whether instr is a kernel the device's SMs run: not structure, a loop or call, a
    collective, an asynchronous copy between host and device memory (a copy-start, or
    the async fusion XLA wraps a slice read from a host buffer or an update written into
    one in), which the copy engines move over the host link beside the kernels, or a
    buffer allocated and left unwritten (`lax.empty`'s AllocateBuffer call)."""
    host_transfer = instr.opcode in ("fusion-start", "fusion-done") and HOST_MEMORY in instr.type
    return not (instr.opcode in STRUCTURAL or instr.opcode in ("while", "conditional", "call",
                                                               "async-start", "copy-start")
                or instr.base in COLLECTIVES or host_transfer
                or instr.attr("custom_call_target") == "AllocateBuffer")


def cost(module: Module, peak: float, bandwidth: float, fp8_peak: float | None = None) -> list:
    """Every kernel the step launches (Kernel, with its launches a step) in program order,
    of each conditional its costlier branch (Kernel.seconds: FP8 GEMMs at fp8_peak)."""
    def kernels_of(comp: str | None, count: float) -> list:
        found = []

        def visit(c, instr, n):
            if counts_as_kernel(module, instr):
                found.append(kernel(module, c, instr, n))
        walk(module, visit, comp, count, costlier)
        return found

    def costlier(_, names, count):
        seconds = [sum(k.seconds(peak, bandwidth, fp8_peak) * k.count
                       for k in kernels_of(n, count))
                   for n in names]
        return [names[seconds.index(max(seconds))]]
    return kernels_of(None, 1.0)
