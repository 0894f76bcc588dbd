"""The repository's importable names against what is installed: no module of the project
shadows an installed package (a `bench/kernels.py` on sys.path once hid the `kernels`
package that transformers imports, and failed 45 tests of a fresh install)."""
import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
OWN = {"jaxptd", "pallas_kernels", "bench", "tests"}


def importable_names(directory: pathlib.Path) -> set:
    """Top-level names a directory on sys.path makes importable: packages and modules."""
    return ({p.name for p in directory.iterdir() if (p / "__init__.py").exists()}
            | {p.stem for p in directory.glob("*.py")})


def test_root_names_are_the_projects_own_and_no_installed_package():
    names = importable_names(ROOT)
    assert names <= OWN, f"unexpected importable names at the repository root: {names - OWN}"
    installed = importlib.metadata.packages_distributions()
    for name in names:
        owners = set(installed.get(name, ())) - {"jaxptd"}
        assert not owners, f"{name} is also the top-level name of {owners}"


def test_tests_and_bench_modules_shadow_no_installed_package():
    """tests/ is on sys.path as the suite runs (conftest, helpers): none of its modules may
    hide an installed one; bench/ must be a package (its modules are bench.NAME)."""
    assert (ROOT / "bench" / "__init__.py").exists()
    surgery = [str(p.relative_to(ROOT)) for d in ("tests", "bench", "jaxptd")
               for p in (ROOT / d).rglob("*.py") if "sys.path.insert" in p.read_text()
               and p.name != "test_packaging.py"]
    assert not surgery, f"sys.path edited in {surgery}: import bench modules as bench.NAME"
    for name in importable_names(ROOT / "tests"):
        spec = importlib.util.find_spec(name)
        assert spec is None or pathlib.Path(spec.origin).parent == ROOT / "tests", \
            f"tests/{name}.py shadows {spec.origin}"


def test_every_bench_module_imports_beside_transformers():
    """Every benchmark module imported, then transformers with its hub-kernels integration,
    in one process: what a test worker that ran the bench tests does next."""
    pytest.importorskip("transformers")
    code = ("import importlib, pkgutil, bench\n"
            "for m in pkgutil.iter_modules(bench.__path__):\n"
            "    importlib.import_module('bench.' + m.name)\n"
            "from transformers.integrations import hub_kernels\n"
            "import transformers; transformers.GPT2Config()\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
