"""bench/kernels.py at toy shapes on CPU (interpret mode): every case runs, its output is
checked against XLA's, and a wrong kernel is caught. Times here mean nothing; the
benchmark proper needs a GPU."""
import importlib

import pytest

from bench import kernels
from pallas_kernels import reference_fused_softmax

# 40-key rows over a 16-key block: softmax_long takes the multi-block path, as on a GPU.
TOY = kernels.TOY


@pytest.fixture
def toy_blocks(monkeypatch):
    monkeypatch.setattr(importlib.import_module("pallas_kernels.fused_softmax"),
                        "_MAX_BLOCK", 16)


@pytest.mark.slow
def test_every_case_runs_and_matches_xla(toy_blocks, capsys):
    bandwidth, rows = kernels.measure(TOY, reps=1, cudnn=False)
    cases = {(r["op"], r["impl"], r["pass_"]) for r in rows}
    assert cases == {(op, impl, pass_)
                     for op in ("softmax", "softmax_long", "bias_gelu", "layer_norm",
                                "rms_norm", "attention", "flash_block")
                     for impl in ("pallas", "xla") for pass_ in ("fwd", "fwd+bwd")} | {
        ("slot_gemm", impl, "loop") for impl in ("pallas", "xla")}
    assert bandwidth > 0 and all(r["ms"] > 0 for r in rows)
    assert all(r["gbps"] > 0 for r in rows
               if r["op"] not in ("attention", "flash_block", "slot_gemm"))
    errors = [r["err"] for r in rows if r["impl"] == "pallas"]
    assert len(errors) == 15 and max(errors) < kernels.MAX_ERR
    assert not kernels.wrong_rows(rows)
    kernels.print_table("cpu", bandwidth, rows, "command")
    assert "softmax_long" in capsys.readouterr().out


def test_a_wrong_kernel_is_reported(monkeypatch):
    def off_by_five_percent(x, **kw):
        return (reference_fused_softmax(x, **kw) * 1.05).astype(x.dtype)

    monkeypatch.setattr(kernels, "fused_softmax", off_by_five_percent)
    cases = [c for c in kernels.softmax_cases(TOY) if c[0] == "softmax"]
    outputs = {impl + pass_: fn(*args) for _, impl, pass_, fn, args, _ in cases}
    err = kernels.relative_error(outputs["pallasfwd"], outputs["xlafwd"])
    assert 0.04 < err < 0.06
    assert kernels.wrong_rows([dict(err=err)]) and not kernels.wrong_rows([dict(err=0.001)])
