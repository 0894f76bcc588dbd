"""The GPU benchmark driver and its scripts, at toy sizes on CPU, so that their first GPU
run is not their first run: bench/gpu_all.sh, bench/gpu_train.py (with its results file,
bench/gpu_results.py), bench/torch_gpt.py and bench/profile_step.py. Times here mean
nothing; what is checked is that every part runs, writes what it says, reports failures
in its rows and refuses bad input with one line."""
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import optimised_env

from bench import gpu_results, gpu_train, profile_step

ROOT = pathlib.Path(__file__).parents[1]

TORCH = gpu_train.version("torch") is not None


def bench_env(tmp_path):
    """A subprocess environment: this checkout first, its own compilation cache, XLA's
    optimised code (the benchmarks time their steps)."""
    return optimised_env({**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                          "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")})


def run(tmp_path, *cmd, timeout=600):
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=bench_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def assert_measured(row):
    """A jaxptd or PyTorch row that ran: positive throughput, finite losses near ln V."""
    assert "error" not in row and "skipped" not in row, row
    assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0
    assert all(math.isfinite(row[k]) for k in ("loss_first", "loss_last"))
    assert abs(row["loss_first"] - math.log(500)) < 0.5  # random tokens, vocabulary 500


def test_a_failed_run_is_a_row_not_the_end(tmp_path):
    oom = ("import sys; print('jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory');"
           "sys.exit(1)")
    log = tmp_path / "runs.log"
    row = gpu_train.run_child([sys.executable, "-c", oom], 60, log)
    assert row == {"error": "out of memory: jaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: "
                            "Out of memory"}
    warned = ("print('W bfc_allocator: ran out of memory trying to allocate 2GiB');"
              "raise ValueError('Triton compile error')")
    row = gpu_train.run_child([sys.executable, "-c", warned], 60, log)
    assert row == {"error": "ValueError: Triton compile error"}
    row = gpu_train.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1, log)
    assert row == {"error": "timed out after 1 s"}
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert gpu_train.run_child([sys.executable, "-c", crash], 60, log) == {
        "error": "killed by SIGSEGV"}
    ok = ("import json, sys; open(sys.argv[sys.argv.index('--result') + 1], 'w')"
          ".write(json.dumps({'tokens_per_s': 1.0}))")
    assert gpu_train.run_child([sys.executable, "-c", ok], 60, log) == {"tokens_per_s": 1.0}
    assert log.read_text().count("==== ") == 5  # every run's output, one log


def test_results_merge_and_summary(tmp_path):
    doc = gpu_results.load(tmp_path / "none.json")
    doc.update(device="d", jax="j", torch="t", global_batch=16, steps=2, warmup=1)
    base = {"model": "gpt-1.3B", "variant": "base", "microbatch_size": 4, "tokens_per_s": 30.0,
            "step_time_s": 1.0}
    gpu_results.upsert(doc["runs"], dict(base, tokens_per_s=10.0), ("model", "variant"))
    gpu_results.upsert(doc["runs"], base, ("model", "variant"))  # replaces
    gpu_results.upsert(doc["runs"], {"model": "gpt-1.3B", "variant": "b=8", "error": "oom"},
                       ("model", "variant"))
    gpu_results.upsert(doc["baselines"], {"model": "gpt-1.3B", "microbatch_size": 4,
                                          "tokens_per_s": 20.0}, ("model", "microbatch_size"))
    gpu_results.save(tmp_path / "r.json", doc)
    again = gpu_results.load(tmp_path / "missing.json", previous=tmp_path / "r.json")
    assert [r["variant"] for r in again["runs"]] == ["base", "b=8"]
    (summary,) = again["models"]
    assert summary["speedup"] == pytest.approx(1.5) and summary["baseline_tokens_per_s"] == 20
    lines = gpu_results.table(again).splitlines()
    assert lines[2].split()[:3] == ["gpt-1.3B", "base", "4"]
    assert lines[2].split()[-2:] == ["20", "1.50"]
    assert lines[3].endswith("error: oom")


@pytest.mark.parametrize("argv, words", [
    (["--models", "gpt-2B"], "unknown model"),
    (["--models", "gpt-toy", "--variants", "remat=some"], "model.remat='some'"),
    (["--models", "gpt-toy", "--variants", "colour=red"], "is not one of"),
    (["--models", "gpt-toy", "--variants", "b=3"], "must divide --global-batch 16"),
    (["--models", "gpt-toy", "--steps", "0"], "--steps=0"),
    (["--models", "gpt-toy", "--out-dir", "/proc/no/such"], "--out-dir /proc/no/such"),
])
def test_gpu_train_refuses_bad_input_in_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        gpu_train.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and words in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("cmd, words", [
    (["bench/gpu_all.sh"], "usage"),
    (["bench/gpu_all.sh", "{tmp}", "sizes", "everything"], "part everything: unknown"),
    (["bench/gpu_all.sh", "/proc/no/such"], "OUT_DIR /proc/no/such"),
    ([sys.executable, "-m", "bench.phase_kernels", "parallel.nope=1"], "parallel.nope"),
    ([sys.executable, "-m", "bench.phase_kernels", "--phase", "middle"], "--phase"),
    ([sys.executable, "-m", "bench.profile_step", "--model", "bert-1B"], "unknown model"),
    pytest.param([sys.executable, "-m", "bench.torch_gpt", "--config", "configs/gpu/none.yaml"],
                 "not found", marks=pytest.mark.skipif(not TORCH, reason="torch is not installed")),
])
def test_scripts_refuse_bad_input_in_one_line(tmp_path, cmd, words):
    result = run(tmp_path, *[c.format(tmp=tmp_path) for c in cmd], timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert words in result.stderr and result.stderr.count("\n") == 1


def torch_state(params, h: int) -> dict:
    """jaxptd's GPT parameters under bench/torch_gpt.py's names and layouts."""
    import torch

    embed, norm = params["embed"], params["final_norm"]
    state = {"wte.weight": embed["wte"], "lm_head.weight": embed["wte"],
             "wpe.weight": embed["wpe"], "ln_f.weight": norm["scale"], "ln_f.bias": norm["bias"]}
    for i in range(params["layers"]["attn"]["w_qkv"].shape[0]):
        layer = jax.tree.map(lambda x: x[i], params["layers"])
        attn, mlp = layer["attn"], layer["mlp"]
        state.update({f"blocks.{i}.{name}": value for name, value in {
            "ln_1.weight": layer["ln1"]["scale"], "ln_1.bias": layer["ln1"]["bias"],
            "ln_2.weight": layer["ln2"]["scale"], "ln_2.bias": layer["ln2"]["bias"],
            "attn.c_attn.weight": attn["w_qkv"].reshape(h, 3 * h).T,  # [h, 3, n, d]
            "attn.c_attn.bias": attn["b_qkv"].reshape(3 * h),
            "attn.c_proj.weight": attn["w_out"].reshape(h, h).T,  # [n, d, h]
            "attn.c_proj.bias": attn["b_out"],
            "mlp.c_fc.weight": mlp["w_fc1"].T, "mlp.c_fc.bias": mlp["b_fc1"],
            "mlp.c_proj.weight": mlp["w_fc2"].T, "mlp.c_proj.bias": mlp["b_fc2"]}.items()})
    return {name: torch.from_numpy(np.array(value)) for name, value in state.items()}


@pytest.mark.skipif(not TORCH, reason="torch is not installed")
def test_torch_model_is_the_jaxptd_model():
    """The baseline's GPT computes jaxptd's loss from jaxptd's parameters (float32)."""
    import torch
    from bench import torch_gpt

    from jaxptd import model as models
    from jaxptd.config import load_config
    from jaxptd.model import gpt
    from jaxptd.model.tensor import Layout

    config = load_config(str(ROOT / "configs/gpu/gpt_125m.yaml"), [
        *gpu_train.TOY, "model.vocab_size=512", "model.dtype=float32", "model.attention=xla"])
    m = config.model  # vocabulary 512: no padding, which jaxptd masks and nanoGPT does not
    rng = np.random.default_rng(0)  # any values will do (LayerNorm's too): no init compile
    params = jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32),
                          jax.eval_shape(lambda: gpt.init_params(m, 512, jax.random.key(0))))
    batch = rng.integers(0, 512, (2, m.seq_len + 1)).astype(np.int32)
    expected = jax.jit(lambda p, b: models.loss_sum(p, b, jax.random.key(0), m, Layout(512),
                                                    True))(params, batch) / batch[:, 1:].size
    model = torch_gpt.GPT(config)
    assert sum(p.numel() for p in model.parameters()) == sum(
        x.size for x in jax.tree.leaves(params))
    model.load_state_dict(torch_state(params, m.hidden_size))
    tokens = torch.from_numpy(batch).long()
    with torch.no_grad():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)  # fp32 rounding


def test_profile_summary_of_a_traced_program():
    def program(x, w):
        return jnp.tanh(x @ w).sum() + jnp.sin(x).sum()

    compiled = jax.jit(program).lower(jnp.ones((256, 256)), jnp.ones((256, 256))).compile()
    args = (jnp.ones((256, 256)), jnp.ones((256, 256)))
    profile, seconds = profile_step.trace_one_step(compiled, *args)
    ops = profile_step.hlo_ops(compiled.as_text())
    summary = profile_step.summarise(profile_step.op_times(profile), ops, top=5)
    assert seconds > 0 and 0 < len(summary["ops"]) <= 5
    assert all(row["op"] in ops for row in summary["ops"])  # named as in the compiled HLO
    assert sum(c["percent"] for c in summary["categories"]) == pytest.approx(100)
    assert sum(c["ms"] for c in summary["categories"]) == pytest.approx(summary["op_time_ms"])
    assert all(row["source"].startswith("jit(program)/") for row in summary["ops"])


def test_self_time_excludes_nested_events():
    events = [("while", 0, 100), ("a", 10, 30), ("b", 40, 60), ("c", 45, 50), ("d", 200, 210)]
    assert dict(profile_step.self_times(events)) == {
        "while": 60, "a": 20, "b": 15, "c": 5, "d": 10}


def assert_toy_base_row(row, doc):
    """gpt-toy's base row (b 8, m 2) and its PyTorch baseline: tokens/s, PTD-P's eq. (3)
    FLOPs and TFLOP/s, 6N TFLOP/s, no MFU or peak memory on CPU; the baseline the same
    model, the speedup their ratio (or skipped without torch)."""
    assert (row["microbatch_size"], row["microbatches"]) == (8, 2)
    tokens = row["global_batch"] * row["seq"]
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"])
    B, s, l, h, V = 16, 32, 2, 64, 512  # the toy: vocabulary 500 padded to 512
    eq3 = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))  # nothing recomputed
    assert row["flops_per_iteration"] == pytest.approx(eq3)
    assert row["tflops_per_device"] == pytest.approx(eq3 / row["step_time_s"] / 1e12)
    assert row["tflops_6n"] == pytest.approx(
        B * s * (6 * row["params"] + 12 * l * h * s) / row["step_time_s"] / 1e12)
    assert row["mfu"] is None and row["peak_memory_bytes"] is None  # CPU
    assert len(row["step_times_s"]) == 2 and row["compile_s"] > 0
    summary = next(m for m in doc["models"] if m["model"] == "gpt-toy")
    assert summary["tokens_per_s"] == row["tokens_per_s"]
    baseline = next(b for b in doc["baselines"] if b["model"] == "gpt-toy"
                    and b.get("microbatch_size") == 8)
    if TORCH:
        assert_measured(baseline)
        assert baseline["params"] == row["params"]  # the same model
        assert summary["speedup"] == pytest.approx(row["tokens_per_s"] / baseline["tokens_per_s"])
    else:
        assert baseline["skipped"] == "torch is not importable" and summary["speedup"] is None


@pytest.mark.slow
def test_driver_runs_every_part_at_toy_sizes(tmp_path):
    """bench/gpu_all.sh --toy: every part runs and writes its files; the merged
    gpu_train_cpu.json holds every variant's measured row, gpt-toy's base row exact
    (assert_toy_base_row) beside its PyTorch baseline, the MoE row, the kernels' and the
    pipeline rounds' tables and a profile."""
    out = tmp_path / "out"
    result = run(tmp_path, "bench/gpu_all.sh", "--toy", out, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files  # what a device command hands back
    assert {"gpu_all.log", "env.txt", "kernels_cpu.json", "gpu_train_cpu.json",
            "gpu_train_runs.log", "profile_gpt-toy_cpu.json", "pipeline_rounds.json"} <= set(files)
    doc = json.loads((out / "gpu_train_cpu.json").read_text())
    assert doc["device"] == "cpu" and doc["jax"] == jax.__version__
    runs = {r["variant"]: r for r in doc["runs"] if r["model"] == "gpt-toy"}
    piped = [f"pipe=4,layers=8,b=2,schedule={k}" for k in ("1f1b", "zb-v,chunks=2")]
    assert set(runs) == {"base", "fp8=tensorwise", "kernels=pallas", "remat=full", "b=1",
                         "b=4", *piped}
    for variant, row in runs.items():
        assert_measured(row)
    # the schedules part: pipelined over 4 simulated devices, 6N of the model's own
    # parameters (not the pipelined state's copies of the ends)
    assert [runs[v]["devices"] for v in piped] == [4, 4] and runs[piped[1]]["chunks"] == 2
    h, V, s, B = 64, 512, 32, 32  # the toy's width, padded vocabulary, sequence; the batch
    params = V * h + s * h + 8 * (12 * h * h + 13 * h) + 2 * h  # tied head, 8 layers
    for row in (runs[v] for v in piped):
        assert row["params"] == params
        assert row["tflops_6n"] == pytest.approx(
            B * s * (6 * params + 12 * 8 * h * s) / row["step_time_s"] / 4 / 1e12)
    assert_toy_base_row(runs["base"], doc)
    assert runs["remat=full"]["flops_per_iteration"] > runs["base"]["flops_per_iteration"]
    assert runs["remat=full"]["tflops_6n"] * runs["remat=full"]["step_time_s"] == pytest.approx(
        runs["base"]["tflops_6n"] * runs["base"]["step_time_s"])  # model FLOPs: no recompute
    assert runs["kernels=pallas"]["kernels"] == "pallas"
    assert [m["model"] for m in doc["models"]] == ["gpt-toy", "llama-toy"]
    moe = [r for r in doc["runs"] if r["variant"].startswith("experts=8")]
    assert len(moe) == 1 and moe[0]["model"] == "llama-toy"
    kernels = json.loads((out / "kernels_cpu.json").read_text())
    assert len(kernels["rows"]) == 30 and all(r.get("err", 0) < 0.02 for r in kernels["rows"])
    rounds = json.loads((out / "pipeline_rounds.json").read_text())["rows"]
    assert [r["variant"] for r in rounds] == [
        "cond, all valid", "steady, all valid", "cond, half idle", "masked, half idle"]
    assert all(r["ms_per_round"] > 0 and r["dtoh_copies_per_round"] >= 0 for r in rounds)
    profile = json.loads((out / "profile_gpt-toy_cpu.json").read_text())
    assert profile["ops"] and profile["categories"] and profile["op_time_ms"] > 0
    log = (out / "gpu_all.log").read_text()
    for part in ("env", "kernels", "sizes", "fp8", "llama", "long", "moe", "variants",
                 "microbatch", "profile", "pipeline", "schedules"):
        assert f"==== part {part}" in log and f"\n{part:<11} ok" in log
    assert "reproduce: bench/gpu_all.sh --toy OUT_DIR env kernels" in log
