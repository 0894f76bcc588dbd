"""What the conditional round form (parallel.round_form=cond) would take a step on 8 H100s
if each rank skipped its idle slots (issue 48's zero-bubble goals), from the compiled
program: a static reading, nothing run.

    python -m bench.cond_rounds [--layers L] [--only KIND ...] [--out FILE.json]

Each schedule (1f1b, zb-h1, zb-v) is compiled for H100 (no GPU: XLA's GPU compiler, the
run's options) at issue 48's depth, GPT-1.3B's width, (data 1, pipe 8, tensor 1), 32
microbatches of 2 sequences, `model.num_layers` 32 (--layers: a shallower proxy), twice:
in the cond form and in the GPU's lockstep form (steady: every slot kind some rank uses
runs on every rank). Columns:
- lockstep ms: the steady program's static cost (jaxptd/hlo/, the cost report's number);
- cond ms: the cond program's static cost, each conditional at its costlier branch (what
  the cost report prints for it: every rank runs every slot);
- per-rank ms: the cond program if each round lasted as long as its busiest rank, each
  rank's slots at the branch its row of the tables takes (the executor's slot
  conditionals and, inside a slot, the embedding's and head's on their virtual stages),
  plus the work outside any conditional (the same on every rank);
- busiest rank ms: the same with no lockstep: the rank whose slots take longest over the
  step (a lower bound for any run of these rounds);
- head spread: per-rank ms with the head's conditional replaced by its taken branch's
  time / p on every rank in the rounds that run it (an estimate: the all-to-all that
  spreading needs is not counted, nor is a head spread in this form built);
- no bubble: the same slots' work spread evenly over the ranks, nothing idle, the head
  spread: what no schedule of these slots can beat (the work outside the conditionals,
  plus every slot's taken branches / p);
- conds: conditionals a rank executes a step (its slots' / with those inside them, the
  rank that runs most);
- copies: copy kernels in the slot conditionals' branches, ms a step as if every run of
  a conditional took that branch (taken / idle).
The head runs whole on the last stage's rank in the cond form (a head spread over the
ranks needs every rank in a collective), on every rank's part of the rows in the steady
form (`scans.head_pieces`). A kernel costs max(FLOPs / peak, bytes / bandwidth);
collectives and the conditionals' own launch cost are not counted. Needs the CUDA compile
extra (`pip install -e '.[h100]'`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

from bench.h100_compile import CONFIG, DEEP
from bench.report import write_rows

SCHEDULES = {"1f1b": [], "zb-h1": ["parallel.schedule=zb-h1"],
             "zb-v": ["parallel.schedule=zb-v", "parallel.chunks=2"]}
FORMS = ("steady", "cond")


def compile_form(kind: str, form: str, layers: int):
    """(parsed program, compiled memory GiB, config) of one schedule in one round form."""
    from jaxptd import hlo
    from jaxptd.config import load_config
    from jaxptd.plan import compile_check
    from jaxptd.runtime.target import TARGETS
    from jaxptd.units import GiB

    overrides = [*DEEP, f"model.num_layers={layers}", *SCHEDULES[kind],
                 f"parallel.round_form={form}", "runtime.target=h100"]
    config = load_config(CONFIG, overrides)
    compiled, _ = compile_check.compile_step(config, TARGETS["h100"], 8)
    return (hlo.parse(compiled.as_text()), compile_check.memory(compiled)["total"] / GiB,
            config)


def _tag(instr) -> str:
    """Which conditional of the rounds instr is: 'f', 'b', 'w' (a slot), 'embed', 'head'
    (a piece inside a slot), '?' (another); the innermost scope in its op name."""
    from jaxptd.pipeline.executor import SLOT_SCOPE
    from jaxptd.pipeline.stage import EMBED_SCOPE, HEAD_SCOPE

    op = instr.op_name
    scopes = {SLOT_SCOPE + k: k for k in "fbw"} | {EMBED_SCOPE: "embed", HEAD_SCOPE: "head"}
    found = [(op.rfind(s), tag) for s, tag in scopes.items() if s in op]
    return max(found)[1] if found else "?"


def branch_costs(module, target) -> tuple:
    """Kernel seconds a step by the conditional branches they run in -> ({context: [seconds,
    copy seconds]}, {tag: executions a step}: a slot's by its tag, a conditional inside a
    slot's branches by 'slot:tag', as if every slot ran). A context is the path of (tag, taken) from
    the program's top: () outside any conditional; ('b', True), ('head', False) the idle
    branch of the head's conditional inside a B slot that runs. A conditional's first
    branch is the one taken where its predicate holds (true_computation)."""
    from jaxptd.hlo.cost import counts_as_kernel, kernel, walk

    seconds, executions = defaultdict(lambda: [0.0, 0.0]), defaultdict(float)

    def run(comp, count, context):
        def visit(c, instr, n):
            if counts_as_kernel(module, instr):
                k = kernel(module, c, instr, n)
                s = k.seconds(target.peak_bf16, target.hbm, target.peak_fp8) * n
                seconds[context][0] += s
                seconds[context][1] += s if k.category == "copy" else 0.0

        def branches(cond, names, n):
            tag = _tag(cond)
            # a slot's conditionals; inside one, its pieces' by the slot kind and tag
            executions[context[0][0] + ":" + tag if context else tag] += n
            for taken, name in zip((True, False), names):
                run(name, n, context + ((tag, taken),))
            return []
        walk(module, visit, comp, count, branches)
    run(None, 1.0, ())
    return dict(seconds), dict(executions)


def slot_costs(seconds: dict, executions: dict) -> dict:
    """Seconds one execution of each slot kind takes -> {kind: {'run': s, 'idle': s,
    piece: {taken: s}}}: its own kernels taken or idle, and each piece's conditional
    (the embedding's, the head's) at either branch inside a slot that runs."""
    slots = {}
    for kind in (k for k in "fbw" if executions.get(k)):
        n = executions[kind]
        own = {taken: seconds.get(((kind, taken),), [0.0])[0] / n for taken in (True, False)}
        pieces = {piece: {taken: sum(s[0] for c, s in seconds.items()
                                     if c[:2] == ((kind, True), (piece, taken))) / n
                          for taken in (True, False)} for piece in ("embed", "head")}
        slots[kind] = {"run": own[True], "idle": own[False], **pieces}
    return slots


def round_seconds(rounds, slots: dict, spread: bool = False) -> list:
    """[round][rank] seconds of the slot conditionals a rank runs in a round: each slot at
    its taken or idle branch, the pieces inside at their virtual stage's branch. spread:
    the head's conditional left out, and its taken branch's seconds / p on every rank in
    a round whose B slots run the head (an estimate of a head spread over the ranks)."""
    last = rounds.stages * rounds.chunks - 1
    head = slots["b"]["head"][True]
    if spread:
        slots = {k: {**c, "head": {True: 0.0, False: 0.0}} for k, c in slots.items()}
    table = []
    for t in range(rounds.num_rounds):
        row = []
        runs_head = any(rounds.b_valid[t][r] and rounds.stage(rounds.b_chunk[t][r], r) == last
                        for r in range(rounds.stages))
        for r in range(rounds.stages):
            total = head / rounds.stages if spread and runs_head else 0.0
            for kind, cost in slots.items():
                if not getattr(rounds, f"{kind}_valid")[t][r]:
                    total += cost["idle"]
                    continue
                stage = rounds.stage(getattr(rounds, f"{kind}_chunk")[t][r], r)
                total += cost["run"] + cost["embed"][stage == 0] + cost["head"][stage == last]
            row.append(total)
        table.append(row)
    return table


def cond_row(module, config, target) -> dict:
    """The per-rank reading of a cond program (module docstring's columns)."""
    from jaxptd.pipeline.executor import rounds_for

    par = config.parallel
    seconds, executions = branch_costs(module, target)
    slots = slot_costs(seconds, executions)
    rounds = rounds_for(par.schedule, par.pipe, par.microbatches, par.chunks, "cond")
    assert all(executions[k] == rounds.num_rounds for k in slots), (executions, rounds.num_rounds)
    table = round_seconds(rounds, slots)
    outside = seconds.get((), [0.0])[0]
    copies = {taken: sum(s[1] for c, s in seconds.items() if c and c[0][1] == taken)
              for taken in (True, False)}
    # conditionals inside a slot, a run of it; a rank's a step: its slots' and theirs
    inner = {k: sum(n for t, n in executions.items() if t.startswith(k + ":"))
             / executions[k] for k in slots}
    per_rank = [sum(inner[k] * getattr(rounds, f"{k}_valid")[t][r] for k in slots
                    for t in range(rounds.num_rounds)) for r in range(rounds.stages)]
    spread = round_seconds(rounds, slots, spread=True)
    busy = round_seconds(rounds, {k: {**c, "idle": 0.0} for k, c in slots.items()}, True)
    return {"per_rank_s": outside + sum(max(row) for row in table),
            "spread_head_s": outside + sum(max(row) for row in spread),
            "no_bubble_s": outside + sum(map(sum, busy)) / rounds.stages,
            "busiest_rank_s": outside + max(map(sum, zip(*table))),
            "outside_s": outside, "rounds": rounds.num_rounds,
            "slot_conds": sum(executions[k] for k in slots),
            "conds": sum(executions[k] for k in slots) + max(per_rank),
            "untagged": sorted({t for t in executions if t.split(":")[-1] == "?"}),
            "copies_taken_s": copies[True], "copies_idle_s": copies[False],
            "slots": slots}


def measure(kind: str, layers: int) -> dict:
    from jaxptd import hlo
    from jaxptd.runtime.target import TARGETS

    target = TARGETS["h100"]
    row = {"schedule": kind, "layers": layers}
    for form in FORMS:
        module, gib, config = compile_form(kind, form, layers)
        row[f"{form}_gib"] = gib
        row[f"{form}_s"] = sum(k.seconds(target.peak_bf16, target.hbm, target.peak_fp8)
                               * k.count for k in hlo.cost(module, target.peak_bf16,
                                                           target.hbm, target.peak_fp8))
        if form == "cond":
            row.update(cond_row(module, config, target))
    return row


def row_text(r: dict, base: dict | None) -> str:
    def ms(key):
        ratio = f" {r[key] / base[key]:4.2f}x" if base else ""
        return f"{r[key] * 1e3:7.1f}{ratio}"
    return (f"{r['schedule']:<6} {ms('steady_s'):>13} {r['steady_gib']:5.1f} "
            f"{ms('cond_s'):>13} {r['cond_gib']:5.1f} {ms('per_rank_s'):>13} "
            f"{ms('busiest_rank_s'):>13} {ms('spread_head_s'):>13} {ms('no_bubble_s'):>13}"
            f" {r['rounds']:4d} {r['slot_conds']:4.0f}/"
            f"{r['conds']:<4.0f} {r['copies_taken_s'] * 1e3:6.1f}/"
            f"{r['copies_idle_s'] * 1e3:<6.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="model.num_layers")
    parser.add_argument("--only", nargs="*", choices=list(SCHEDULES), help="these only")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args(argv)
    from jaxptd.plan.verify import start_cpu_compiler
    os.environ["JAX_PLATFORMS"] = "cpu"
    start_cpu_compiler(None)
    print(f"{'kind':<6} {'lockstep ms':>13} {'GiB':>5} {'cond ms':>13} {'GiB':>5} "
          f"{'per-rank ms':>13} {'busiest ms':>13} {'head spread':>13} {'no bubble':>13} "
          f"{'T':>4} {'conds':>9} {'copies ms':>13}")
    rows = []
    for kind in args.only or SCHEDULES:
        rows.append(measure(kind, args.layers))
        print(row_text(rows[-1], rows[0] if rows[0]["schedule"] == "1f1b" else None),
              flush=True)
    print("\nms: static time a step (module docstring), x: against 1f1b's; T: rounds; conds: "
          "slot conditionals / all executed a step; copies: in slot branches taken / idle.")
    print("reproduce: python -m bench.cond_rounds" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    if args.out:
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
