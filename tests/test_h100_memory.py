"""The GPU program's memory against the planner's, compiled for H100s without a GPU
(jaxptd/plan/compile_check.py, `python -m jaxptd.plan --verify --target h100`): what one more
layer adds to the compiled step (kept activations, full recomputation, offloaded layers,
the pipeline's kept backward a layer at a time, zero-bubble's buffers) and the PyTorch FSDP runs' FSDP
runs scaled down.
Slow: each compiles a step twice or at a width that takes minutes. Needs the CUDA compile
extra, as tests/test_h100.py (whose set-up it shares)."""
import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from jaxptd import hlo
from jaxptd.plan import compile_check, stand_in
from jaxptd.config import load_config
from test_h100 import (H100, ROOT, cudnn_launches, float32_mlp_gradients, layout,
                       needs_compiler)


def temp_per_layer(base, steps=None) -> float:
    """The temporary bytes one more layer adds to the step compiled for 8 H100s: 8 layers
    against 4, over 4. steps: a dict that receives {layers: (config, compiled step,
    seconds)}, for a test that checks more of the same compiles."""
    temps = {}
    for layers in (4, 8):
        config = load_config(None, [*base, f"model.num_layers={layers}"])
        step, seconds = compile_check.compile_step(config, H100, 8)
        temps[layers] = compile_check.memory(step)["temp"]
        if steps is not None:
            steps[layers] = config, step, seconds
    return (temps[8] - temps[4]) / 4


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["minimal", "minimal_mlp"])
def test_a_layer_keeps_what_the_planner_says(remat):
    """One H100, flash attention: the temporary memory one more layer adds (8 layers
    against 4) is the planner's layer (jaxptd/plan/model.py: what it keeps) plus its float32
    gradients, within 10%; without recomputation what it keeps is no more than 15% over
    Megatron's fused 16-bit layer's 34 s b h (Korthikanti et al. 2022; ours keeps 26: it
    recomputes the GeLU output and keeps no dropout masks, test_plan.py)."""
    from jaxptd.plan import model as plan_model
    base = ["model.hidden_size=1024", "model.num_heads=8", "model.seq_len=1024",
            "model.vocab_size=1024", "model.dtype=bfloat16", "model.attention=cudnn",
            "runtime.target=h100", "train.global_batch=4", f"model.remat={remat}"]
    b, s, h, a = 4, 1024, 1024, 8
    per_layer = temp_per_layer(base)
    gradients = 4 * 12 * h * h  # float32, every dense() weight of the layer
    kept = plan_model.layer_activation_bytes(b, s, h, a, 1, 2, flash=True, remat=remat)
    assert per_layer == pytest.approx(kept + gradients, rel=0.1)
    if remat == "none":
        assert per_layer - gradients <= 1.15 * 34 * s * b * h


# (b, s, h, a, t): the layer the (2, 1, 4) sequence-parallel tests add, bf16, cuDNN
SP_SHAPE = (4, 1024, 1024, 8, 4)


def sp_layout(remat: str) -> list:
    """Overrides of a (2, 1, 4) step with sequence parallelism at SP_SHAPE on H100s."""
    b, s, h, a, t = SP_SHAPE
    return [f"model.hidden_size={h}", f"model.num_heads={a}", f"model.seq_len={s}",
            "model.vocab_size=1024", "model.dtype=bfloat16", "model.attention=cudnn",
            "runtime.target=h100", "parallel.data=2", f"parallel.tensor={t}",
            "parallel.sequence_parallel=true", f"train.global_batch={2 * b}",
            f"model.remat={remat}"]


@needs_compiler
@pytest.mark.slow
def test_full_recomputation_recomputes_one_layer_at_a_time():
    """model.remat=full at (2, 1, 4) with sequence parallelism on 8 H100s: one more layer
    (8 against 4) adds the input it keeps and its float32 gradients, within 15% (16.2 MB
    against the planner's 14.7: a layer's input [b, s/t, h] once more). A layer's
    input gradient waits for its weight gradients (model.weight_gradients_first); left
    free, XLA started every layer's recomputation early (its sequence-parallel all-gather
    first) and kept them all: 35.6 MiB a layer at this shape, against 15.5."""
    from jaxptd.plan import model as plan_model
    b, s, h, a, t = SP_SHAPE
    per_layer = temp_per_layer(sp_layout("full"))
    kept = plan_model.layer_activation_bytes(b, s, h, a, t, 2, sp=True, flash=True,
                                             remat="full")
    assert per_layer == pytest.approx(kept + 4 * 12 * h * h / t, rel=0.15), per_layer


@needs_compiler
@pytest.mark.slow
def test_sequence_parallel_layer_keeps_its_norm_outputs_split():
    """No recomputation at (2, 1, 4) with sequence parallelism on 8 H100s: one more layer
    (8 against 4) adds what the planner says it keeps, its norm outputs [b, s/t, h] as
    they were before f (tensor.entered: gathered again in the backward) and its weights
    cast to bf16 (the planner's layer_weights), and its float32 gradients, within 5%
    (46.2 MB against 46.2; keeping the gathered norm outputs, the layer took 55.6 MB,
    which this fails)."""
    from jaxptd.plan import model as plan_model
    b, s, h, a, t = SP_SHAPE
    per_layer = temp_per_layer(sp_layout("none"))
    kept = plan_model.layer_activation_bytes(b, s, h, a, t, 2, sp=True, flash=True)
    weights = 12 * h * h / t
    assert per_layer == pytest.approx(kept + (2 + 4) * weights, rel=0.05), per_layer


def verify_report(*args) -> dict:
    """The JSON report of `python -m jaxptd.plan --verify --target h100 --json ARGS` (the
    step compiled for H100s in a process of its own, beside the planner's figures); the
    process leaves no XLA dump behind (plan/verify.py's dump_dir)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "jaxptd.plan", "--verify", "--target",
                               "h100", "--json", *args], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                                  TMPDIR=tmp), timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not glob.glob(os.path.join(tmp, "jaxptd-xla-*"))
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]


def planned_and_compiled(overrides) -> tuple[float, float]:
    """(the planner's bytes a device, the compiled step's) for overrides of the default
    config."""
    report = verify_report(*overrides)
    return report["planned_bytes"], report["planned_bytes"] / report["planned_ratio"]


@needs_compiler
@pytest.mark.slow
def test_kept_backward_is_stored_and_read_a_layer_at_a_time():
    """(2, 2, 2) 1F1B, 8 microbatches, sequence parallelism, model.remat=minimal on 8 H100s:
    two more layers a stage (8 layers against 4) add what the planner says (3 stash slots
    of their kept values, their weights in the compute dtype and float32 gradients),
    within 10%, and the step is the planner's within 10%. The F slot stores each layer's
    kept values before the next layer runs and the B slot reads them a layer at a time
    (pipeline/training.py, by_layer): 173.8 MB a stage layer at this shape, the planner
    176.4. With a vjp of the whole chunk, which kept the F slot's values until it stored
    them all and whose B slot copied all of a slot's out at its start, 201.6 (2.3 GiB more
    for GPT-1.3B at this layout)."""
    base = ["model.hidden_size=1024", "model.num_heads=8", "model.seq_len=1024",
            "model.vocab_size=1024", "model.dtype=bfloat16", "model.attention=cudnn",
            *layout(2, 2, 2, 8, "parallel.sequence_parallel=true", "model.remat=minimal",
                    "optimizer.zero1=true")]
    (plan4, step4), (plan8, step8) = (planned_and_compiled([*base, f"model.num_layers={n}"])
                                      for n in (4, 8))
    assert plan8 == pytest.approx(step8, rel=0.1)
    assert step8 - step4 == pytest.approx(plan8 - plan4, rel=0.1), (step8 - step4) / 2


@needs_compiler
@pytest.mark.slow
def test_zero_bubble_keeps_what_the_planner_says():
    """(2, 2, 2) zb-h1, 8 microbatches, sequence parallelism, model.remat=minimal, 8 layers
    on 8 H100s: the step is the planner's within 10% (3 stash slots of the layers' kept
    values, 3 tape slots of their dense() inputs, the norm outputs as they were before the
    all-gather, 2 W slots of their output gradients and the W slot's reads of one). The
    kept backward keeps none of the zero perturbations its layers take (kept.Kept passes
    them in again: they were stored beside every q, k, v and first MLP output, 4 GiB for
    GPT-1.3B at this layout; the previous code compiled to 1.59e9 bytes here against the
    planner's 1.32e9). One compile: the per-layer bytes (4 against 8 layers) agreed within
    10% too, and the suite's time is near its limit."""
    planned, compiled = planned_and_compiled([
        "model.hidden_size=1024", "model.num_heads=8", "model.seq_len=1024",
        "model.vocab_size=1024", "model.dtype=bfloat16", "model.attention=cudnn",
        "model.num_layers=8", *layout(2, 2, 2, 8, "parallel.schedule=zb-h1",
                                      "parallel.sequence_parallel=true",
                                      "model.remat=minimal", "optimizer.zero1=true")])
    assert planned == pytest.approx(compiled, rel=0.1)


@needs_compiler
@pytest.mark.slow
def test_offloaded_layers_backward_one_at_a_time():
    """offload.activations (full recomputation, each layer's input in host memory) and
    offload.optimizer on 8 H100s, data 8, compiled with host memory apart (plan/stand_in.py):
    each layer more adds at most its float32 weight gradients and its input, not its
    recomputed activations (8 layers against 4, within 25%). A layer's input gradient
    waits for its weight gradients (model.weight_gradients_first); left free, XLA deferred
    every layer's weight-gradient GEMMs behind the input-gradient chain, each keeping its
    recomputed inputs. Its attention and MLP as test_h100.py's
    test_step_compiles_for_h100 holds every layout's: cuDNN attention once a layer
    backward and twice forward (the layer whose input waits in host memory is run again),
    and the bias-GeLU's backward writes no float32 [b, s, ffn].
    With the layer inputs alone offloaded, the 8-layer step's reductions overlap the
    backward: every data-parallel all-reduce of the layers' gradients has a GEMM or
    attention in flight, but the last, of the bottom layers' (nothing waits for those but
    the embedding's gradient): each layer's input gradient waits for the reduced
    gradients of the layer model.AHEAD above it (model.reduced_ahead). Without, XLA queued
    them all behind the last layers' backward. (With offload.optimizer too none overlaps:
    the gradients go to host memory once reduced, and XLA combines their all-reduces
    and runs them alone, with or without the pins; seen since the compile has host
    memory, issue 50's notes.)"""
    b, s, h = 4, 2048, 1024
    base = [f"model.hidden_size={h}", "model.num_heads=8", f"model.seq_len={s}",
            "model.vocab_size=1024", "model.dtype=bfloat16", "model.attention=cudnn",
            "runtime.target=h100", "parallel.data=8", f"train.global_batch={8 * b}",
            "offload.activations=true"]
    steps = {}
    per_layer = temp_per_layer([*base, "offload.optimizer=true"], steps)
    assert per_layer <= 1.25 * (4 * 12 * h * h + 2 * s * b * h), per_layer
    config, step, seconds = steps[8]
    assert isinstance(step, stand_in.Compiled)  # (conftest's 8 CPU devices stand in)
    assert compile_check.analyse(config, step, H100, seconds)["fits"]
    module = hlo.parse(step.as_text())
    backward = cudnn_launches(module, "fmhaSoftmaxBackward")
    assert backward == config.model.num_layers * config.parallel.microbatches
    assert cudnn_launches(module, "fmhaSoftmax") == 2 * backward
    assert not float32_mlp_gradients(module, config.model.ffn // config.parallel.tensor)
    step, _ = compile_check.compile_step(load_config(None, [*base, "model.num_layers=8"]),
                                         H100, 8)
    reductions = [c for c in hlo.collectives(hlo.parse(step.as_text()))
                  if c.kind == "all-reduce"]
    overlapped = [bool(set(c.overlap) & {"gemm", "attention"}) for c in reductions]
    assert len(overlapped) > 2 and all(overlapped[:-1]), overlapped


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("config", ["gpt_1t_seq2048"])
def test_seed003_runs_scaled_are_what_the_planner_says(config):
    """the PyTorch FSDP 1T runs (one matmul's weight gathered at a time, the optimizer state
    and layer inputs offloaded with a streamed update, SGD) at a width a test compiles,
    for 8 H100s with host memory apart (plan/stand_in.py): the masters and momentum are
    host arguments of the step, as many bytes as the planner's host weights and optimizer
    state (within 2%), and the planner's device bytes within 15% of the compiled device's
    (the gap is issue 50's notes: the compile keeps a little more than the planner's
    gathered weights and layer)."""
    path = os.path.join(ROOT, "configs", "pytorch_fsdp", f"{config}.yaml")
    overrides = ["parallel.data=8", "model.num_layers=8", "model.hidden_size=2048",
                 "model.num_heads=16", "model.seq_len=1024", "train.global_batch=32",
                 "model.attention=cudnn"]  # (the head width here is 128: cuDNN's)
    report = verify_report("--config", path, *overrides)
    assert not report["offloaded_state_on_device"] and report["fits"]
    host = report["plan"]["host_memory_bytes_per_device"]
    assert report["memory"]["host_argument"] == pytest.approx(
        host["weights"] + host["optimizer"], rel=0.02)
    assert report["planned_ratio"] == pytest.approx(1.0, abs=0.15), report["planned_ratio"]
