"""The package's layout against the house limits (DESIGN.md, issue 47), read from the source
with `ast` alone (nothing of jaxptd is imported, nor bench/house.py, which prints the same
figures): no import cycle between jaxptd's modules, type-only imports included; at most
MAX_TOP_MODULES modules directly in jaxptd/; a package's __init__.py only re-exports
(a docstring, imports, `__all__`); no module over MAX_LINES lines, no function over
MAX_FUNCTION_LINES; a function-local import of a jaxptd module says why it is local in a
comment on its line or the line above (a JAX-free path, a fast --help); no comment or
docstring under jaxptd/ or pallas_kernels/ quotes a measured figure (issue 47: they go
stale; BENCHMARKS.md and the git log hold them).

The import graph: module-level imports, those under `if TYPE_CHECKING:` and in class
bodies included, function bodies not (their imports run on use). `from jaxptd.pkg import
mod` is an edge to the module jaxptd.pkg.mod, `from jaxptd.pkg import name` (not a
module) and `import jaxptd.pkg` an edge to the package's __init__.py. A package's own
__init__ being run first by an import of one of its modules is not an edge: otherwise every
package that re-exports its modules would be a cycle with each of them.
"""
from __future__ import annotations

import ast
import graphlib
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxptd"
MAX_LINES, MAX_FUNCTION_LINES, MAX_TOP_MODULES = 400, 60, 6


def _modules() -> dict[str, pathlib.Path]:
    """{dotted name: path} of every module under jaxptd/ (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[dotted.removesuffix(".__init__")] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _where(module: str, node: ast.AST) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{node.lineno}"


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The jaxptd modules an import statement is an edge to (module docstring)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    base = node.module or ""
    if node.level:  # relative: from the module's package (a package: itself)
        package = module.split(".")
        if not MODULES[module].name == "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    targets = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.add(sub if sub in MODULES else base)
    return targets & MODULES.keys()


def _module_level(body: list[ast.stmt]):
    """The statements a module's import runs: its body and the blocks inside it (if,
    try, with, class bodies), not function bodies."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                yield from _module_level([n for n in block if isinstance(n, ast.AST)])


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, tree in TREES.items():
        edges = set()
        for node in _module_level(tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(module, node)
        graph[module] = edges - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle of the graph (its modules, sorted) in a list, or [] where there is none
    (graphlib's topological sort names one it meets)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return [sorted(set(error.args[1]))]
    return []


def _comment_lines(path: pathlib.Path) -> set[int]:
    """The lines of a file that hold a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {token.start[0] for token in tokens if token.type == tokenize.COMMENT}


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_the_graph_and_cycle_finder_see_what_they_should():
    """The helpers against a made-up graph and the package's own known edges, so that the
    tests below cannot pass by seeing nothing."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph = _import_graph()
    assert "jaxptd.config.schema" in graph["jaxptd.config"]  # from jaxptd.config.schema import
    assert "jaxptd.arch.interface" in graph["jaxptd.arch.gpt"]
    assert sum(map(len, graph.values())) > len(graph)


def test_no_import_cycle_between_jaxptd_modules():
    cycles = _cycles(_import_graph())
    assert not cycles, "an import cycle (type-only imports included): " + " <-> ".join(
        cycles[0] if cycles else [])


def test_few_modules_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in jaxptd/: {top}"


def _re_exports_only(node: ast.stmt, first: bool) -> bool:
    """A docstring, an import, `__all__`, or `if TYPE_CHECKING:` around imports."""
    if first and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str):
        return True
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
    if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                               "typing.TYPE_CHECKING"):
        return not node.orelse and all(isinstance(n, (ast.Import, ast.ImportFrom))
                                       for n in node.body)
    return False


def test_package_inits_only_re_export():
    problems = [f"{_where(module, node)}: {ast.unparse(node).splitlines()[0][:70]}"
                for module, tree in TREES.items() if MODULES[module].name == "__init__.py"
                for i, node in enumerate(tree.body) if not _re_exports_only(node, i == 0)]
    assert not problems, "a package's __init__.py holds only a docstring, imports and " \
        "__all__ (put the rest in a named module):\n" + "\n".join(problems)


def test_modules_are_short():
    long = {str(MODULES[m].relative_to(ROOT)): n for m in MODULES
            if (n := len(MODULES[m].read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_functions_are_short():
    long = [f"{_where(module, f)} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for module, tree in TREES.items() for f in _functions(tree)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _statement_runs(function: ast.AST):
    """Every list of statements inside a function (its body, and the blocks within)."""
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def test_function_local_imports_of_jaxptd_say_why():
    """A comment on the import's lines or the line above; an import right below an
    explained one (a block of them under one comment) is explained with it."""
    unexplained = []
    for module, tree in TREES.items():
        comments = _comment_lines(MODULES[module])
        for function in _functions(tree):
            for block in _statement_runs(function):
                explained = False
                for before, node in zip([None, *block], block):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)):
                        explained = False
                        continue
                    explained = bool(comments & set(range(node.lineno - 1,
                                                          node.end_lineno + 1))) or (
                        explained and before.end_lineno == node.lineno - 1)
                    if not explained and _targets(module, node):
                        unexplained.append(f"{_where(module, node)} {ast.unparse(node)}")
    assert not unexplained, "function-local imports of jaxptd modules without a comment " \
        "saying why they are local (on their line or the line above; or move them to the " \
        "top of the module):\n" + "\n".join(sorted(set(unexplained)))


# a benchmark figure: a size in GiB, a time in ms, or a before -> after pair of measurements
FIGURE = re.compile(r"\b\d+(\.\d+)? ?(GiB|ms)\b|\b\d+\.\d+ -> \d+\.\d+")
SOURCES = (PACKAGE, ROOT / "pallas_kernels")


def _prose(source: str):
    """(first line, text) of each comment block (consecutive comment lines, one text) and
    each module, class and function docstring of a module's source."""
    blocks = []  # [first line, last line, text]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line, text = token.start[0], token.string.lstrip("#")
            if blocks and blocks[-1][1] == line - 1:
                blocks[-1][1:] = [line, f"{blocks[-1][2]}\n{text}"]
            else:
                blocks.append([line, line, text])
    yield from ((first, text) for first, _, text in blocks)
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, owners) and ast.get_docstring(node, clean=False) is not None:
            yield node.body[0].lineno, node.body[0].value.value


def _figures(source: str) -> list[int]:
    """The lines of a module's comments and docstrings where a figure (FIGURE) starts, one
    wrapped onto the next line too ("152.3 ->" above "152.4 ms")."""
    found = set()
    for first, text in _prose(source):
        lines = [line.strip() for line in text.splitlines()] + [""]
        for i, (line, below) in enumerate(zip(lines, lines[1:])):
            if any(m.start() < len(line) for m in FIGURE.finditer(f"{line} {below}")):
                found.add(first + i)
    return sorted(found)


def test_the_figure_finder_sees_what_it_should():
    source = '''"""Module: 3.5 GiB."""
x = "12 ms"  # not a comment's: a string
# wrapped: 152.3 ->
# 152.4 and 2
# GiB
def f():
    """f: 2.60 -> 2.63 ten times over, 4 of 4."""
    return f"{x} 5 ms"  # jax 0.10.2, 1F1B m8, (2,2,2)
'''
    assert _figures(source) == [1, 3, 4, 7]


def test_no_benchmark_figures_in_source_comments_or_docstrings():
    """Docstrings and comments say what code does and why (what went wrong without it,
    where that was seen); measured figures go stale there, so they live in BENCHMARKS.md
    and the commit messages (issue 47)."""
    hits = [f"{path.relative_to(ROOT)}:{line}" for root in SOURCES
            for path in sorted(root.rglob("*.py")) for line in _figures(path.read_text())]
    assert not hits, "benchmark figures (GiB, ms, before -> after) in comments or " \
        "docstrings (keep the reason; the figures: BENCHMARKS.md and the git log):\n" + \
        "\n".join(hits)
