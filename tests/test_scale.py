"""The GPU program does the model's matmul work and no more (issue #50), compiled for A100s
without a GPU (jaxptd/runtime/target.py's topology devices): GEMM FLOPs a device of the
compiled step, every dot of the scheduled program times its launches (jaxptd/hlo/'s static
cost report), against the model's count written out here from the shapes (PTD-P eq. 3's
terms). With sequence parallelism and more than one microbatch XLA's all-gather pipeliner
had run each microbatch's layers twice; one microbatch does not show it (no loop).
And PTD-P Table 1's smallest row compiled at its real size holds the planner's memory.

Needs the CUDA compile extra, as tests/test_h100.py (whose set-up it shares): without it
these tests skip.
"""
import os

import pytest

from jaxptd import hlo
from jaxptd.config import load_config
from jaxptd.plan import compile_check
from jaxptd.plan.planner import device_memory_bytes
from jaxptd.runtime.target import TARGETS
from test_h100 import ROOT, needs_compiler

A100 = TARGETS["a100"]


def layout(h: int, heads: int, s: int, vocab: int, t: int, *more: str) -> list:
    """Two layers of width h at tensor t, sequence parallel, full recomputation, two
    microbatches of 2 sequences on one data rank."""
    return [f"model.hidden_size={h}", f"model.num_heads={heads}", f"model.seq_len={s}",
            f"model.vocab_size={vocab}", "model.num_layers=2", "model.dtype=bfloat16",
            "model.remat=full", "model.attention=xla", f"parallel.tensor={t}",
            "parallel.sequence_parallel=true", "parallel.microbatches=2",
            "train.global_batch=4", "runtime.target=a100", *more]


def model_gemm_flops(config) -> float:
    """Matmul FLOPs a device of one step under full recomputation, from the shapes: per
    token a layer's forward 24 h^2 + 4 s h (q, k, v, the output projection, the MLP, the
    attention's two products over all s keys), its backward twice that, and the forward
    again but for the MLP's second matmul, whose output the backward does not need (8 h^2);
    the logits 2 h V forward, twice that backward; over the tensor ranks."""
    m, t = config.model, config.parallel.tensor
    h, s, vocab = m.hidden_size, m.seq_len, m.padded_vocab(t)
    layer = 3 * (24 * h * h + 4 * s * h) + (16 * h * h + 4 * s * h)
    tokens = config.train.global_batch * s
    return tokens * (m.num_layers * layer + 6 * h * vocab) / t


def gemm_flops(config) -> float:
    """GEMM FLOPs a device of the step compiled for A100s (one host of tensor devices)."""
    step, _ = compile_check.compile_step(config, A100, 8)
    kernels = hlo.cost(hlo.parse(step.as_text()), A100.peak_bf16, A100.hbm)
    return sum(k.flops * k.count for k in kernels if k.category == "gemm")


@needs_compiler
@pytest.mark.parametrize("shape", [
    (128, 2, 128, 1000, 2),
    # the 18.4B row of PTD-P Table 1 at two layers (configs/megatron/gpt_18.4b.yaml)
    pytest.param((6144, 48, 2048, 51200, 8), marks=pytest.mark.slow)],
    ids=["small", "gpt-18.4b-width"])
def test_sequence_parallel_step_runs_each_gemm_once(shape):
    config = load_config(None, layout(*shape))
    assert gemm_flops(config) == pytest.approx(model_gemm_flops(config), rel=0.1)


@needs_compiler
@pytest.mark.slow
def test_table1_smallest_row_compiled_is_the_planners_memory():
    """PTD-P Table 1's 1.7B row (configs/megatron/gpt_1.7b.yaml: data 32, 8 microbatches of
    2, full recomputation) compiled for its 32 A100s (4 hosts of 8) fits their usable
    memory, and the planner's bytes a device for the GPU program are the compiled step's
    within 10%: no whole gradient workspace, the weights cast to bfloat16, the microbatch
    loop's second buffer of the largest stacked gradient (plan/memory.py's
    unrolled_gpu_extras). The planner that counted the CPU program's workspace and reduced
    copy instead was 1.26x. bench/table1.py compiles every row."""
    config = load_config(os.path.join(ROOT, "configs", "megatron", "gpt_1.7b.yaml"),
                         ["runtime.target=a100"])
    step, _ = compile_check.compile_step(config, A100, 8)
    compiled = compile_check.memory(step)["total"]
    assert compiled <= A100.usable
    assert device_memory_bytes(config, "gpu") == pytest.approx(compiled, rel=0.1)
