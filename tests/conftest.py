"""Test session set-up: 8 simulated CPU devices, set before the JAX backend starts; LLVM's
cheapest code generation; one XLA compilation cache for the session's subprocesses; small
disks for the full-disk tests; the prepared corpus of the training-CLI tests."""
import os
import subprocess

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound (a new program for every layout, tiny arrays): unoptimised
# LLVM code generation halves a pipelined step's compile (measured 11.3 s -> 6.0 s, same
# losses). HLO passes, buffer assignment and so the memory tests are unaffected. The
# subprocesses the tests start inherit it, but for those that run many steps
# (helpers.optimised_env).
os.environ.setdefault("JAXPTD_TEST_OPTIMISED_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The heaviest files first, heaviest at the top (a serial run's seconds a file, measured
# 2026-12-06: git log of this list): pytest-xdist hands whole files to its workers in the
# collected order (`--no-loadscope-reorder`), so each worker's last file is a light one and
# both finish together. Its own order, by test count, left these (few tests, long
# compiles and multi-process runs) to the end, one worker running alone for minutes.
HEAVY_FIRST = ("test_h100.py", "test_pipeline_program.py", "test_pipeline.py",
               "test_h100_memory.py", "test_fp8.py", "test_memory.py", "test_multihost.py",
               "test_parity.py", "test_bench_gpu.py", "test_moe.py", "test_faults.py",
               "test_train.py", "test_llama.py", "test_plan.py", "test_bert.py",
               "test_context.py", "test_model.py", "test_readme.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files whole


@pytest.fixture(scope="session", autouse=True)
def _subprocess_compilation_cache(tmp_path_factory):
    """The CLI runs the tests start (`python -m jaxptd.train` and friends) compile the same
    steps again and again: they share one persistent compilation cache (measured: a
    repeated short training run 31 s -> 13 s). Set after jax's import, so this process
    itself keeps compiling afresh (the tests that read compiled programs see them
    compiled)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla-cache")))
        yield


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (root can mount one); skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def full_disk(small_disk):
    """small_disk with every byte taken by one file (removing it frees the space)."""
    with open(small_disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
    return small_disk


@pytest.fixture(scope="session")
def corpus_env(tmp_path_factory):
    """(environment for the subprocesses, prepared stdlib corpus directory): the training
    CLI's tests (tests/test_train.py, test_train_packing.py)."""
    from jaxptd.data import resolve_corpus
    cache = tmp_path_factory.mktemp("jaxptd-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXPTD_CACHE", str(cache))
        corpus = resolve_corpus("pystdlib")
    return {**os.environ, "JAXPTD_CACHE": str(cache)}, corpus
