"""model.fp8=tensorwise: the FP8 GEMM against an independent quantize-in-numpy reference
(ml_dtypes' float8 casts), its gradients against bf16's (cosine per leaf; a stale scale
fails the same check), the same loss and gradients at every kind of layout as the
single-device FP8 program with the same microbatches, and the log that says so."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import REPO, fixed_batches, make_setup, placed_state

from jaxptd.model import fp8
from jaxptd.train.step import build_grads

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _numpy_quantized(x, dtype, largest):
    """x rounded as the FP8 GEMM sees it, back in float32: x / s cast to `dtype` by
    ml_dtypes (round to nearest even), times s, s = amax / largest."""
    x = np.asarray(x, np.float32)
    scale = np.float32(np.max(np.abs(x)) / largest)
    return (x / scale).astype(dtype).astype(np.float32) * scale


def test_transposed_specs_are_the_gradients_einsums():
    assert fp8.transposed("bsh,hcnd->bscnd") == ("bscnd,hcnd->bsh", "bsh,bscnd->hcnd")
    assert fp8.transposed("bqnd,ndh->bqh") == ("bqh,ndh->bqnd", "bqnd,bqh->ndh")


def test_quantize_scales_by_amax_and_keeps_zeros():
    x = jnp.asarray([[-3.0, 0.5], [1.5, 0.0]])
    q, scale = fp8.quantize(x, fp8.E4M3, ())
    assert float(scale) == pytest.approx(3.0 / E4M3_MAX)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == E4M3_MAX
    q0, scale0 = fp8.quantize(jnp.zeros((2, 2)), fp8.E4M3, ())
    assert float(scale0) == 1.0 and not jnp.any(q0.astype(jnp.float32))


def test_fp8_gemm_and_its_gradients_match_numpy_quantization():
    """Forward e4m3 x e4m3, backward the e5m2 output gradient times each e4m3 operand,
    float32 accumulation: the products of the numpy-rounded operands."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 16))
    w = jax.random.normal(kw, (16, 24)) * 0.1
    g = jax.random.normal(kg, (2, 8, 24))
    product = fp8.einsum("bsh,hf->bsf")
    y, vjp = jax.vjp(product, x, w)
    dx, dw = vjp(g)
    xq, wq = (_numpy_quantized(v, ml_dtypes.float8_e4m3fn, E4M3_MAX) for v in (x, w))
    gq = _numpy_quantized(g, ml_dtypes.float8_e5m2, E5M2_MAX)
    np.testing.assert_allclose(y, np.einsum("bsh,hf->bsf", xq, wq), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, np.einsum("bsf,hf->bsh", gq, wq), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, np.einsum("bsh,bsf->hf", xq, gq), rtol=1e-5, atol=1e-5)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    # and FP8 is not the identity: the float32 product differs
    assert not np.allclose(y, np.einsum("bsh,hf->bsf", x, w), rtol=1e-3)


def _grads(setup):
    state = placed_state(setup)
    batch = fixed_batches(setup.config, 1)[0]
    grads, loss, _ = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    return float(loss), jax.device_get(setup.state_layout.to_logical(grads))


def _cosines(grads, reference) -> dict:
    def cosine(a, b):
        a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
    paths = ["/".join(str(getattr(k, "key", k)) for k in p)
             for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
    return dict(zip(paths, map(cosine, jax.tree.leaves(grads), jax.tree.leaves(reference))))


@functools.lru_cache(maxsize=None)
def _bf16_grads(arch: str):
    return _grads(make_setup(extra=[f"model.arch={arch}", "model.dtype=bfloat16"]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_fp8_gradients_point_where_bf16_ones_do(arch, monkeypatch):
    """One step's gradients in FP8 have cosine similarity >= 0.99 with bf16's for every
    leaf; with a stale scale (an amax four steps of growth old: a quarter of today's, so
    the largest values clip) the same check fails."""
    extra = [f"model.arch={arch}", "model.dtype=bfloat16", "model.fp8=tensorwise"]
    loss, grads = _grads(make_setup(extra=extra))
    ref_loss, ref = _bf16_grads(arch)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    cosines = _cosines(grads, ref)
    assert min(cosines.values()) >= 0.99, cosines

    quantize = fp8.quantize

    def stale(x, dtype, axes):
        q, scale = quantize(x, dtype, axes)
        largest = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32) / (scale / 4), -largest, largest).astype(
            dtype), scale / 4
    monkeypatch.setattr(fp8, "quantize", stale)
    fp8.einsum.cache_clear()
    try:
        _, broken = _grads(make_setup(extra=extra + ["model.num_layers=3"]))
    finally:
        fp8.einsum.cache_clear()
    _, ref3 = _grads(make_setup(extra=[f"model.arch={arch}", "model.dtype=bfloat16",
                                       "model.num_layers=3"]))
    assert min(_cosines(broken, ref3).values()) < 0.99


# Every kind of layout against the single device with the same microbatches of 4 rows
# (16 rows: 4 microbatches on one device, 2 on each of 2 data ranks): a tensorwise scale
# is a microbatch tensor's, so identical inputs give identical scales.
LAYOUTS = [
    (2, 2, 2, ["parallel.microbatches=2"]),
    (2, 2, 2, ["parallel.microbatches=2", "parallel.schedule=zb-h1"]),
    (1, 1, 4, ["parallel.microbatches=4", "parallel.sequence_parallel=true",
               "model.remat=selective"]),
    (2, 1, 1, ["parallel.microbatches=2", "parallel.fsdp=true"]),
    (2, 1, 1, ["parallel.microbatches=2", "offload.activations=true",
               "offload.optimizer=true"]),
    (2, 1, 2, ["parallel.microbatches=2", "parallel.fsdp=true", "parallel.fsdp_unit=matmul",
               "model.remat=full"]),
    pytest.param(1, 2, 1, ["parallel.microbatches=4", "parallel.context=2"], id="context"),
    (1, 2, 1, ["parallel.microbatches=4", "parallel.schedule=interleaved",
               "parallel.chunks=2"]),
]


def _fp8_setup(data, pipe, tensor, extra):
    """FP8 at a layout, the vocabulary a multiple of 128 x 4 (no padding row at tensor <= 4:
    every layout's tree has the single device's shapes)."""
    return make_setup(data, pipe, tensor, ["model.fp8=tensorwise", "model.vocab_size=512",
                                           *extra])


@functools.lru_cache(maxsize=None)
def _single_device_fp8():
    return _grads(_fp8_setup(1, 1, 1, ["parallel.microbatches=4"]))


@pytest.mark.slow
@pytest.mark.parametrize("data, pipe, tensor, extra", LAYOUTS)
def test_fp8_layouts_match_the_single_device_fp8_program(data, pipe, tensor, extra):
    ref_loss, ref = _single_device_fp8()
    loss, grads = _grads(_fp8_setup(data, pipe, tensor, extra))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_fp8_close(grads, ref)


# a mixture of experts with a capacity (its expert GEMMs in FP8), every token to every
# expert: with top 2 of 4 a rounding flip may move a near-tied token to another expert,
# which is routing, not scaling
MOE = ["model.arch=llama", "model.moe_experts=4", "model.moe_top_k=4",
       "model.moe_capacity=4.0", "model.moe_aux_loss=0"]


@pytest.mark.slow
def test_fp8_experts_match_the_single_device_fp8_program():
    _, ref = _grads(_fp8_setup(1, 1, 1, ["parallel.microbatches=4", *MOE]))
    _, grads = _grads(_fp8_setup(2, 2, 2, ["parallel.microbatches=2", *MOE]))
    assert_fp8_close(grads, ref)


@pytest.mark.slow
def test_an_amax_not_reduced_over_tensor_ranks_fails_the_layout_check(monkeypatch):
    """Each tensor rank scaling its shards by its own amax (no pmax) is caught."""
    quantize = fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda x, dtype, axes: quantize(x, dtype, ()))
    fp8.einsum.cache_clear()
    try:
        _, grads = _grads(_fp8_setup(1, 1, 4, ["parallel.microbatches=4",
                                               "parallel.sequence_parallel=true"]))
    finally:
        fp8.einsum.cache_clear()
    ref = _single_device_fp8()[1]
    with pytest.raises(AssertionError, match="whole tree"):  # each check alone catches it
        assert_fp8_close(grads, ref, leaf_rtol=np.inf)
    with pytest.raises(AssertionError, match="layers"):
        assert_fp8_close(grads, ref, tree_rtol=np.inf)


def assert_fp8_close(actual, expected, tree_rtol=1.5e-2, leaf_rtol=5e-2):
    """The gradients are the reference's up to a few FP8 rounding flips: the whole tree
    within tree_rtol in norm, each leaf within leaf_rtol.

    Where a layout's float32 sums differ from the single device's in the last bit, an
    element within that bit of a rounding boundary of e5m2 (two mantissa bits) rounds the
    other way: one output-gradient element a quarter off, which moves a column of its
    weight's gradient and, through the layers below, a little of everything. Most test
    batches hold such an element (last-bit perturbations of the one-device program's
    weights flip one), so whether a layout flips it depends on the CPU and its code
    generation, not on the layout being right. At this width (64 tokens a microbatch, h 32)
    one flip moves the tree by well under a percent and a small leaf by a few; a scale that
    differs between ranks (an amax not reduced over tensor) moves every element by FP8's
    rounding, the tree by several percent; a shard exchanged or left unreduced moves its
    leaf by its whole size."""
    def error(a, e):
        return np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)

    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(actual))
    pairs = [(np.asarray(a, np.float64), np.asarray(e, np.float64))
             for a, e in zip(leaves, jax.tree.leaves(expected))]
    for path, (a, e) in zip(paths, pairs):
        assert a.shape == e.shape and np.isfinite(e).all(), jax.tree_util.keystr(path)
        assert error(a, e) <= leaf_rtol, (jax.tree_util.keystr(path), error(a, e))
    tree = error(*(np.concatenate([np.ravel(x) for x in side]) for side in zip(*pairs)))
    assert tree <= tree_rtol, ("the whole tree", tree)


@pytest.mark.slow
def test_a_hugging_face_import_fine_tunes_in_fp8_and_exports_its_weights(tmp_path):
    """A transformers Llama imported, one step trained with model.fp8=tensorwise at pipe 3,
    tensor 2 with SP: the first loss is transformers' on the same batch within FP8's rounding
    (2%), and the export after it holds the run's float32 master weights."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from helpers import tiny_hf_model, train_a_step_from_import
    from jaxptd.data import TokenDataset
    from jaxptd.hf import bridge as hf

    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "jaxptd")]) == 0
    corpus, record = train_a_step_from_import(tmp_path / "jaxptd", tmp_path, [
        "model.fp8=tensorwise", "parallel.pipe=3", "parallel.tensor=2",
        "parallel.sequence_parallel=true", "parallel.microbatches=2", "model.seq_len=16",
        "train.global_batch=4", "checkpoint.every=1"])
    batch = TokenDataset(corpus, "train").batch(0, 0, 4, 16).astype(np.int64)
    with torch.no_grad():
        expected = model(torch.tensor(batch), labels=torch.tensor(batch)).loss.item()
    assert record["loss"] == pytest.approx(expected, rel=2e-2)
    assert record["loss"] != pytest.approx(expected, rel=1e-6)  # FP8 did run
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {str(v.dtype) for v in exported.values()} == {"float32"}


@pytest.mark.slow
def test_a_gpu_without_fp8_tensor_cores_refuses_fp8():
    """The deviceless compile for A100s (no FP8 tensor cores) stops at one error line."""
    import subprocess
    import sys
    pytest.importorskip("jax_plugins.xla_cuda13")
    done = subprocess.run([sys.executable, "-m", "jaxptd.plan", "--config",
                           "configs/gpu/gpt_125m.yaml", "--verify", "--target", "a100",
                           "model.fp8=tensorwise"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: model.fp8=tensorwise: a100 GPUs have no FP8 tensor cores (Hopper and "
        "newer: h100, h200); set model.fp8=none"]


H100_SMALL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
              "model.seq_len=256", "model.vocab_size=1000", "model.dtype=bfloat16",
              "model.attention=cudnn", "runtime.target=h100", "model.fp8=tensorwise"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true",
     "train.global_batch=4"],
    ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=4",
     "parallel.schedule=zb-h1", "train.global_batch=16"]])
def test_every_layer_gemm_compiles_to_fp8_for_h100(layout):
    """Compiled for 8 H100s without a GPU: every GEMM of a layer pass (each linear's
    forward and both backward GEMMs, the zero-bubble W's included) has 8-bit operands, and
    the static cost times them at the FP8 peak."""
    from jaxptd import hlo
    from jaxptd.config import load_config
    from jaxptd.plan import compile_check
    from jaxptd.runtime.target import TARGETS, TargetError, topology_devices
    h100 = TARGETS["h100"]
    try:
        topology_devices(h100, 1, 1)
    except TargetError as e:
        pytest.skip(str(e))
    config = load_config(None, [*H100_SMALL, *layout])
    step, seconds = compile_check.compile_step(config, h100, 8)
    module = hlo.parse(step.as_text())
    gemms = compile_check.cost_report(config, module, h100)["layer_gemms"]
    assert gemms["fp8"] >= 12 and gemms["other"] == 0, gemms
    fp8_kernels = [k for k in hlo.cost(module, h100.peak_bf16, h100.hbm, h100.peak_fp8)
                   if k.fp8]
    assert fp8_kernels and all(k.category == "gemm" and "Block" in k.op_name
                               for k in fp8_kernels)
    kernel = max(fp8_kernels, key=lambda k: k.flops)
    assert kernel.seconds(1e12, 1e30, 2e12) == pytest.approx(kernel.flops / 2e12)


def test_the_planner_times_fp8_gemms_at_the_fp8_peak():
    """GPT-1.3B on one H100: FP8 takes off the compute time about half of the linears' FLOPs
    (forward, both backward GEMMs and full recomputation's forward again), nothing else;
    an A100 record (no FP8 peak) times them as bf16."""
    from jaxptd.config import load_config
    from jaxptd.plan.inputs import PlanInputs
    from jaxptd.plan.planner import fp8_flops, plan
    from jaxptd.runtime.target import TARGETS

    base = ["model.num_layers=4", "parallel.microbatches=4", "train.global_batch=16",
            "model.remat=full"]
    configs = [load_config(str(REPO / "configs/gpu/gpt_1.3b.yaml"), [*base, *more])
               for more in ([], ["model.fp8=tensorwise"])]
    m = configs[0].model
    linears = 24 * m.hidden_size ** 2  # a GPT layer's linears a token, forward
    assert fp8_flops(configs[0], 0) == 0
    assert fp8_flops(configs[1], 0) == pytest.approx(4 * linears * 16 * m.seq_len * 4)
    for name in ("h100", "a100"):
        hw = TARGETS[name]
        saved = 1 - hw.peak_bf16 / hw.peak_fp8 if hw.peak_fp8 else 0.0  # H100: 0.5
        bf16, fp8_ = (plan(c, PlanInputs(hw, 0.5 * hw.peak_bf16, "gpu"), simulate=False)
                      ["step_time_s"]["compute"] for c in configs)
        assert bf16 - fp8_ == pytest.approx(
            saved * fp8_flops(configs[1], 0) / (0.5 * hw.peak_bf16), rel=1e-9)


# ------------------------------------------------------------- model.fp8=delayed


def test_delayed_gemm_scales_by_its_history_and_returns_this_steps_amaxes():
    """Delayed scaling: x, w and the output gradient divided by max(history row) x 2^margin
    / the format's largest value (a row of zeros: by 1), clipped to it, the products those
    of the numpy-rounded operands; the history's gradient holds max |x|, max |w|, max |g| in
    column 0 and zeros elsewhere."""
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (2, 8, 16))
    w = jax.random.normal(kw, (16, 24)) * 0.1
    g = jax.random.normal(kg, (2, 8, 24)) * 1e-2
    history = jnp.asarray([[1.0, 3.0, 2.0], [0.2, 0.0, 0.1], [0.0, 0.0, 0.0]])
    for margin in (0, 1):
        y, vjp = jax.vjp(fp8.delayed_einsum("bsh,hf->bsf", (), margin), x, w, history)
        dx, dw, dh = vjp(g)
        sx, sw = (2.0 ** margin * a / E4M3_MAX for a in (3.0, 0.2))

        def rounded(v, s, dtype):  # (a stale scale clips: x here reaches past 3)
            largest = float(ml_dtypes.finfo(dtype).max)
            v = np.clip(np.asarray(v, np.float32) / np.float32(s), -largest, largest)
            return v.astype(dtype).astype(np.float32) * np.float32(s)
        xq, wq = rounded(x, sx, ml_dtypes.float8_e4m3fn), rounded(w, sw, ml_dtypes.float8_e4m3fn)
        gq = rounded(g, 1.0, ml_dtypes.float8_e5m2)
        np.testing.assert_allclose(y, np.einsum("bsh,hf->bsf", xq, wq), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dx, np.einsum("bsf,hf->bsh", gq, wq), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(dw, np.einsum("bsh,bsf->hf", xq, gq), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dh[:, 0], [np.abs(x).max(), np.abs(w).max(),
                                              np.abs(g).max()], rtol=1e-6)
        assert not np.any(np.asarray(dh[:, 1:]))


def test_advance_rolls_each_history_and_keeps_it_after_an_overflow():
    old = {"w_fc1": jnp.ones((2, 2)), "w_fc1_amax": jnp.arange(12.0).reshape(2, 3, 2)}
    seen = {"w_fc1": jnp.zeros((2, 2)), "w_fc1_amax": jnp.zeros((2, 3, 2)).at[:, :, 0].set(
        jnp.asarray([[7.0, 8.0, 9.0], [1.0, jnp.inf, 2.0]]))}
    updated = {"w_fc1": old["w_fc1"] - 1, "w_fc1_amax": old["w_fc1_amax"] * 0}
    grads, amaxes = fp8.observed(seen)
    assert not np.any(np.asarray(grads["w_fc1_amax"])) and amaxes is seen
    new = fp8.advance(updated, old, amaxes)
    np.testing.assert_array_equal(new["w_fc1"], updated["w_fc1"])
    np.testing.assert_array_equal(new["w_fc1_amax"][0], [[7.0, 0.0], [8.0, 2.0], [9.0, 4.0]])
    np.testing.assert_array_equal(new["w_fc1_amax"][1], old["w_fc1_amax"][1])  # (inf: kept)
    acc = fp8.accumulate({"a": jnp.float32(2), "w_o_amax": jnp.float32(2)},
                         {"a": jnp.float32(3), "w_o_amax": jnp.float32(3)})
    assert float(acc["a"]) == 5.0 and float(acc["w_o_amax"]) == 3.0


def _delayed_steps(data, pipe, tensor, extra, steps=2):
    """(losses, logical params) after `steps` train steps with model.fp8=delayed."""
    from jaxptd.train.step import build_train_step
    setup = make_setup(data, pipe, tensor, ["model.fp8=delayed", "model.vocab_size=512",
                                            *extra])
    state, step, losses = placed_state(setup), build_train_step(setup), []
    for batch in fixed_batches(setup.config, steps):
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(setup.state_layout.to_logical(state["params"]))


@functools.lru_cache(maxsize=None)
def _single_device_delayed(model: tuple = ()):
    return _delayed_steps(1, 1, 1, ["parallel.microbatches=4", *model])


def _histories(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(params) if fp8.is_history(p)}


@pytest.mark.slow
@pytest.mark.parametrize("data, pipe, tensor, extra", [  # (1F1B: the executor zb-h1 runs)
    (2, 2, 2, ["parallel.microbatches=2", "parallel.schedule=zb-h1",
               "parallel.sequence_parallel=true"]),
    (1, 2, 1, ["parallel.microbatches=4", "parallel.schedule=zb-v", "parallel.chunks=2"]),
    (2, 1, 2, ["parallel.microbatches=2", "optimizer.zero1=true",
               "optimizer.overlap_grad_reduce=true", "parallel.sequence_parallel=true"]),
    (2, 1, 2, ["parallel.microbatches=2", "parallel.fsdp=true", "parallel.fsdp_unit=matmul",
               "model.remat=full"]),
    (1, 2, 1, ["parallel.microbatches=4", "parallel.context=2"]),
    (2, 2, 2, ["parallel.microbatches=2", *MOE]),
    (2, 1, 1, ["parallel.microbatches=2", "offload.activations=true",
               "offload.optimizer=true"])],
    ids=["zb-h1-sp", "zb-v", "zero1-overlap-sp", "fsdp-matmul", "context",
         "experts", "offload"])
def test_delayed_histories_and_losses_match_the_single_device(data, pipe, tensor, extra):
    """Two steps of delayed scaling (the second scaled by the first's amaxes): every layout
    records the single device's histories (each amax the largest over the microbatches and
    ranks: a sum would be 2-4x) and computes its losses. Independently of the program, the
    weight row's older entry is max |w| of the initial weights."""
    model = tuple(e for e in extra if e in MOE)
    ref_losses, ref = _single_device_delayed(model)
    losses, params = _delayed_steps(data, pipe, tensor, extra)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = _histories(params), _histories(ref)
    assert got.keys() == want.keys() and len(want) == (6 if model else 4)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
        assert np.all(want[name][:, :, :2] > 0) and not np.any(want[name][:, :, 2:])
    setup = make_setup(extra=["model.fp8=delayed", "model.vocab_size=512", *model])
    initial = jax.device_get(setup.state_layout.to_logical(placed_state(setup)["params"]))
    for path, w in jax.tree_util.tree_leaves_with_path(initial["layers"]):
        name = f"['layers']{jax.tree_util.keystr(path)[:-2]}{fp8.HISTORY}']"
        if name in want:  # [L, 3, H]: the weight's row, step 1's entry (now the older)
            np.testing.assert_allclose(want[name][:, 1, 1], np.abs(np.asarray(w)).reshape(
                len(w), -1).max(axis=1), rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_delayed_histories_restore_across_layouts_and_precisions(tmp_path):
    """A delayed-scaling state saved at (2, 2, 2) restores at (1, 1, 4) with its histories
    bitwise, into a run without delayed scaling without them (the rest bitwise), and a state
    saved without them restores into a delayed run with zero histories."""
    from jaxptd.checkpoint.files import layout_metadata
    from jaxptd.checkpoint.precision import restore_switching_fp8
    from jaxptd.checkpoint.store import Checkpointer

    def saved_at(setup, directory, state):
        ckpt = Checkpointer(str(directory), 1, 10, metadata=layout_metadata(setup.config, 1))
        ckpt.save(1, setup.state_layout.state_to_logical(state))
        ckpt.close()

    def restored(setup, directory, written_by):
        ckpt = Checkpointer(str(directory), 0, 10)
        try:
            return jax.device_get(restore_switching_fp8(lambda target: ckpt.restore_latest(
                target, setup.config.model.vocab_size), setup, written_by.config.to_dict())[0])
        finally:
            ckpt.close()

    base = ["model.vocab_size=512", "parallel.microbatches=2"]
    source = make_setup(2, 2, 2, ["model.fp8=delayed", *base])
    state = jax.tree_util.tree_map_with_path(  # histories of distinct values
        lambda p, x: x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)
        if fp8.is_history(p) else x, placed_state(source))
    saved_at(source, tmp_path / "delayed", state)
    logical = jax.device_get(source.state_layout.state_to_logical(state))
    same = restored(make_setup(1, 1, 4, ["model.fp8=delayed", *base]), tmp_path / "delayed",
                    source)
    assert _histories(same["params"]) and all(np.array_equal(same_h, _histories(
        logical["params"])[k]) for k, same_h in _histories(same["params"]).items())
    plain = make_setup(1, 1, 4, base)
    off = restored(plain, tmp_path / "delayed", source)
    assert not _histories(off["params"]) and not _histories(off["opt_state"])
    kept = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(logical)}
    for path, v in jax.tree_util.tree_leaves_with_path(off):
        np.testing.assert_array_equal(v, kept[jax.tree_util.keystr(path)])
    saved_at(plain, tmp_path / "plain", placed_state(plain))
    on = restored(source, tmp_path / "plain", plain)
    assert _histories(on["params"]) and not any(map(np.any, _histories(on["params"]).values()))


def test_the_planner_counts_delayed_fsdp_gathers_at_a_byte():
    """FSDP a matmul at a time with delayed scaling gathers the layer linears' shards in
    FP8 (forward and backward) and reduce-scatters their gradients as before: the planner's
    FSDP bytes are those of tensorwise's less 2 (g - 1) / g x (bytes - 1) a linear weight."""
    from jaxptd.config import load_config
    from jaxptd.plan.counts import real_counts
    from jaxptd.plan.inputs import PlanInputs
    from jaxptd.plan.planner import plan
    from jaxptd.runtime.target import TARGETS

    hw = TARGETS["h100"]
    base = ["parallel.fsdp=true", "parallel.tensor=1", "parallel.data=8"]
    volumes = {}
    for unit, kind in (("matmul", "tensorwise"), ("matmul", "delayed"), ("layer", "delayed")):
        config = load_config(str(REPO / "configs/gpt_tiny.yaml"),
                             [*base, f"parallel.fsdp_unit={unit}", f"model.fp8={kind}"])
        volumes[unit, kind] = plan(config, PlanInputs(hw, 0.5 * hw.peak_bf16, "gpu"),
                                   simulate=False)["comm_bytes"]["fsdp_per_microbatch"]
        m = config.model
    linears = 12 * m.hidden_size ** 2 * m.num_layers / 8  # a GPT layer's 4 linears, a shard
    assert real_counts(config)["fp8_gathered_params"] == 0  # (layer unit: 16-bit gathers)
    assert volumes["layer", "delayed"] - volumes["matmul", "delayed"] == pytest.approx(
        2 * 7 / 8 * 8 * linears * (4 - 1))  # (grad_reduce_dtype float32: 4 bytes)
    # tensorwise gathers at 4 bytes too (delayed's own histories: a few bytes more)
    assert volumes["matmul", "tensorwise"] == pytest.approx(volumes["layer", "delayed"],
                                                            rel=2e-3)
