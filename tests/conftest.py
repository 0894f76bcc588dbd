"""Test session set-up: 8 simulated CPU devices, set before the JAX backend starts; LLVM's
cheapest code generation; one XLA compilation cache for the session's subprocesses."""
import os

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
