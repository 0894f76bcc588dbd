"""The house's figures (issue 24): module sizes, long functions, function-local imports of
jaxptd's own modules, import cycles, and how often control enters each jaxptd file from
another while one training step is built and traced.

    python -m bench.house [--no-trace]

Static figures come from an ast walk of jaxptd/; the trace builds `Setup` and lowers one
step of configs/gpt_tiny.yaml on 8 simulated CPU devices under `sys.setprofile`, counting
calls whose caller is in another jaxptd file (hops through JAX are skipped), for an
unpipelined (2,1,4) and a 1F1B (2,2,2) layout. Deterministic: no timing.
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_LINES, LIMIT_FUNCTION = 400, 60


def modules() -> dict:
    """{dotted module name: path} of every module under jaxptd/."""
    found = {}
    for directory, _, names in os.walk(os.path.join(ROOT, "jaxptd")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imported(node, module: str, path: str, known: dict) -> list:
    """The jaxptd modules an import statement names (a submodule rather than its package
    when every name imported is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return subs if subs and len(subs) == len(node.names) else [base, *subs]


def static_figures() -> dict:
    known = modules()
    graph, local, long_functions, big = {}, collections.Counter(), [], []
    for module, path in known.items():
        source = open(path).read()
        tree = ast.parse(source)
        if source.count("\n") > LIMIT_LINES:
            big.append((module, source.count("\n")))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > LIMIT_FUNCTION:
                    long_functions.append((module, node.name))
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and any(
                            t.startswith("jaxptd") for t in imported(inner, module, path, known)):
                        local[module] += 1
        graph[module] = {t for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in imported(node, module, path, known) if t in known and t != module}
    return {"modules": len(known),
            "lines": sum(open(p).read().count("\n") for p in known.values()),
            "over_400_lines": sorted(big, key=lambda x: -x[1]),
            "functions_over_60_lines": long_functions, "local_imports": local,
            "cycles": cycles(graph)}


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def file_entries(overrides: list) -> collections.Counter:
    """Calls into each jaxptd file from another jaxptd file while a step is built and
    lowered."""
    import jax
    from jaxptd.config import load_config
    from jaxptd.parallel.mesh import make_mesh
    from jaxptd.train.step import Setup, build_train_step
    config = load_config(os.path.join(ROOT, "configs", "gpt_tiny.yaml"), overrides)
    mesh = make_mesh(config.parallel, jax.devices()[: config.num_devices])
    entries = collections.Counter()

    def profile(frame, event, _):
        name = frame.f_code.co_filename
        if event != "call" or "/jaxptd/" not in name:
            return
        caller = frame.f_back
        while caller is not None and "/jaxptd/" not in caller.f_code.co_filename:
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != name:
            entries[name.split("/jaxptd/")[1]] += 1
    sys.setprofile(profile)
    try:
        setup = Setup(config, mesh)
        batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                     jax.numpy.int32, sharding=setup.batch_sharding)
        build_train_step(setup).lower(setup.state_layout.abstract_state(), batch)
    finally:
        sys.setprofile(None)
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-trace", action="store_true", help="the static figures only")
    args = parser.parse_args()
    figures = static_figures()
    print(f"modules {figures['modules']}, lines {figures['lines']}")
    print(f"modules over {LIMIT_LINES} lines: {figures['over_400_lines']}")
    print(f"functions over {LIMIT_FUNCTION} lines: {figures['functions_over_60_lines']}")
    local = figures["local_imports"]
    print(f"function-local imports of jaxptd modules: {sum(local.values())} "
          f"({', '.join(f'{m} {n}' for m, n in local.most_common())})")
    print(f"import cycles: {figures['cycles']}")
    if not args.no_trace:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        for name, overrides in [
                ("unpipelined (2,1,4)", ["parallel.data=2", "parallel.tensor=4",
                                         "model.num_layers=2"]),
                ("1f1b (2,2,2)", ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                  "parallel.microbatches=4", "model.num_layers=4"])]:
            entries = file_entries(overrides)
            print(f"\n{name}: {sum(entries.values())} entries into {len(entries)} files")
            print("  " + ", ".join(f"{f} {n}" for f, n in entries.most_common()))
    print("\nreproduce: python -m bench.house")
    return 0


if __name__ == "__main__":
    sys.exit(main())
