"""fp32 parity: every (data, pipe=1, tensor) layout, with ZeRO-1 too where data > 1,
computes the losses and gradients of the single-device program (rtol 1e-5); every layout,
each architecture's, starts from the same model: the initialiser run at the layout gives
the single device's logical parameters bitwise, zero padding, and its first loss; and
packed rows' loss, the mean over the targets that take loss counted over the global batch,
and its gradients are the single device's at every kind of layout (pipelined, tensor with
SP, data, FSDP; with context: tests/test_context.py), in training and evaluation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import (assert_grads_match_single_device, assert_same_state,
                     assert_steps_match_single_device, assert_trees_close, fixed_batches,
                     make_setup, placed_state, reference_loss, reference_loss_and_grads,
                     reference_losses)
from jax.sharding import PartitionSpec as P

from jaxptd.model import weight_decay_mask
from jaxptd.train.optim import lr_schedule
from jaxptd.train.step import (build_eval_step, build_grads, build_train_step,
                               pipeline_context)

# ZeRO-1 shards the optimizer state over data (with data = 1 it is the same program); it
# leaves the gradients of the layout unchanged, so (2, 1, 4) is run with it only.
CASES = [pytest.param(*case, marks=pytest.mark.slow) for case in (
    (1, 1, 1, False), (8, 1, 1, False), (1, 1, 8, False))] + [(2, 1, 4, True)]


@pytest.mark.parametrize("data, pipe, tensor, zero1", CASES)
def test_losses_and_gradients_match_single_device(data, pipe, tensor, zero1):
    setup = make_setup(data, pipe, tensor, [f"optimizer.zero1={zero1}",
                                            "parallel.microbatches=2"])
    config = setup.config
    state = placed_state(setup)
    params0 = jax.device_get(state["params"])
    batches = fixed_batches(config, 3)

    grads, loss, _ = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batches[0], setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    ref_loss, ref_grads = reference_loss_and_grads(config, setup.vocab, params0, batches[0])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)

    step = build_train_step(setup)
    losses = []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference_losses(config, setup.vocab, params0, batches),
                               rtol=1e-5)


def _optax_sgd_steps(setup, params, batches):
    """(losses, parameters) of len(batches) steps of the plain single-device program with
    optax's own SGD chain (global-norm clipping, L2 decay of the matrices, momentum)."""
    opt = setup.config.optimizer
    tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm),
                     optax.add_decayed_weights(opt.weight_decay, mask=weight_decay_mask),
                     optax.sgd(lr_schedule(setup.config), momentum=opt.momentum))
    state, losses = tx.init(params), []
    for batch in batches:
        loss, grads = reference_loss_and_grads(setup.config, setup.vocab, params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


@pytest.mark.parametrize("data, pipe, tensor, extra", [
    pytest.param(4, 1, 2, ["parallel.fsdp=true"], marks=pytest.mark.slow),
    pytest.param(2, 2, 2, ["parallel.microbatches=2"], marks=pytest.mark.slow)])
def test_sgd_matches_optax_sgd_on_one_device(data, pipe, tensor, extra):
    """optimizer.name=sgd: three steps at the layout give the losses and parameters of
    the single-device program updated by optax.sgd (momentum 0.9, weight decay 0.1)."""
    setup = make_setup(data, pipe, tensor, ["optimizer.name=sgd", "optimizer.lr=0.1",
                                            "optimizer.weight_decay=0.1", *extra])
    state = placed_state(setup)
    params0 = jax.device_get(setup.state_layout.to_logical(state["params"]))
    batches = fixed_batches(setup.config, 3)
    step, losses = build_train_step(setup), []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    expected_losses, expected = _optax_sgd_steps(setup, params0, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(setup.state_layout.to_logical(state["params"]), expected)
    assert losses[-1] < losses[0]


def test_zero1_shards_optimizer_state_over_data():
    setup = make_setup(8, 1, 1, ["optimizer.zero1=true"])
    state = placed_state(setup)
    adam = state["opt_state"][1][0]  # ScaleByAdamState of the adamw chain
    wte = adam.mu["embed"]["wte"]
    assert "data" in str(wte.sharding.spec)
    assert wte.addressable_shards[0].data.size == wte.size // 8
    assert state["params"]["embed"]["wte"].addressable_shards[0].data.size == wte.size


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32():
    """Mixed precision: bf16 compute with f32 masters lands near the f32 loss."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        setup = make_setup(2, 1, 4, [f"model.dtype={dtype}"])
        state = placed_state(setup)
        assert state["params"]["layers"]["mlp"]["w_fc1"].dtype == jnp.float32
        step = build_train_step(setup)
        batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
        losses[dtype] = float(step(state, batch)[1]["loss"])
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [True])
def test_float16_dynamic_loss_scale_skips_overflow(offload):
    """An overflowing step is skipped (the streamed update of offload.optimizer too)."""
    setup = make_setup(1, 1, 1, ["model.dtype=float16", "optimizer.loss_scale=dynamic",
                                 f"offload.optimizer={offload}"])
    state = placed_state(setup)
    step = build_train_step(setup)
    batch = jax.device_put(fixed_batches(setup.config, 1)[0], setup.batch_sharding)
    state = jax.tree.map(lambda x: x, state)
    state["loss_scale"] = state["loss_scale"]._replace(scale=jnp.float32(2.0**40))
    before = jax.device_get(state["params"])
    state, metrics = step(state, batch)
    assert float(metrics["loss_scale"]) == 2.0**39  # overflow: halved
    assert_trees_close(state["params"], before, rtol=0)  # and the update skipped
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


# --------------------------------------------------------------------------- the starting point

# 257 pads to 384 at tensor 1, 512 at 2 and 4, 1024 at 8 (a multiple of 128 x tensor).
START = ["model.vocab_size=257", "train.seed=3"]
ARCHS = {"gpt": [], "llama": ["model.arch=llama", "model.ffn_size=24", "model.num_kv_heads=4"],
         "bert": ["model.arch=bert"]}
FSDP, SP = "parallel.fsdp=true", "parallel.sequence_parallel=true"


def _schedule(name, chunks=1):
    return [f"parallel.schedule={name}", f"parallel.chunks={chunks}", "parallel.microbatches=4"]


# (data, pipe, tensor, extra): every architecture at tensor sizes 2 and 4 (their
# paddings; 8's: gpt's zb-interleaved case is 4, test_checkpoint restores at 8), data,
# ZeRO-1, FSDP, SP and a pipeline; one other schedule each (the ends are laid out on the
# pipe the same way by each). Tensor 2 alone is llama's only (the fast subset's case):
# GPT's and BERT's padding at tensor 2 is their (2, 2, 2) case's.
LAYOUTS = [(1, 1, 2, []), (2, 1, 4, ["optimizer.zero1=true", SP]),
           (2, 2, 2, [FSDP, SP, *_schedule("1f1b")])]
SCHEDULES = {"gpt": [(1, 2, 4, _schedule("zb-interleaved", 2))],
             "llama": [(1, 2, 2, _schedule("interleaved", 2))],
             "bert": [(1, 2, 2, _schedule("zb-h1"))]}
FAST = {("llama", 1, 1, 2)}
START_CASES = [pytest.param(arch, *layout, marks=() if (arch, *layout[:3]) in FAST
                            else pytest.mark.slow)
               for arch in ARCHS for layout in LAYOUTS + SCHEDULES[arch]
               if layout[:3] != (1, 1, 2) or (arch, *layout[:3]) in FAST]


def vocab_split(tree, axes, vocab_size: int):
    """(each leaf's real vocabulary part, the list of its padding parts): leaves cut at
    vocab_size along their axes named 'vocab' in `axes` (logical names, like the tree)."""
    def cut(x, names, part):
        return np.asarray(x)[tuple(part if n == "vocab" else slice(None) for n in names)]
    tree = jax.device_get(tree)
    names = jax.tree.leaves(axes, is_leaf=lambda n: isinstance(n, P))
    real = jax.tree.map(lambda x, n: cut(x, n, slice(0, vocab_size)), tree, axes)
    padding = [cut(x, n, slice(vocab_size, None))
               for x, n in zip(jax.tree.leaves(tree), names) if "vocab" in n]
    return real, padding


@functools.lru_cache(maxsize=None)
def single_device_start(arch):
    """The single device's logical parameters (padding cut off) and first loss, the plain
    program's (helpers.reference_loss), for the architecture's model."""
    setup = make_setup(1, 1, 1, ARCHS[arch] + START)
    config, vocab = setup.config, setup.vocab
    params = jax.device_get(jax.jit(setup.arch.init_params, static_argnums=(0, 1))(
        config.model, vocab, jax.random.key(config.train.seed)))
    loss = float(jax.jit(lambda p: reference_loss(config, vocab, p, fixed_batches(
        config, 1)[0]))(params))
    axes = setup.arch.logical_axes(config.model, vocab)
    return vocab_split(params, axes, config.model.vocab_size)[0], loss


@pytest.mark.parametrize("arch, data, pipe, tensor, extra", START_CASES,
                         ids=lambda x: x if not isinstance(x, list) else "+".join(x) or "plain")
def test_every_layout_starts_from_the_same_model(arch, data, pipe, tensor, extra):
    """The initialiser at the layout (its own padded vocabulary and shardings) gives the
    single device's logical parameters bitwise and zeros in the padding; its first loss
    is the single device's to fp32 rounding; two training steps leave the padding of the
    parameters and of the Adam moments zero (their gradients are zero: padded ids never
    take probability nor are looked up)."""
    setup = make_setup(data, pipe, tensor, ARCHS[arch] + START + list(extra))
    config = setup.config
    vocab_size = config.model.vocab_size
    axes = setup.arch.logical_axes(config.model, setup.vocab, tensor)
    state = setup.state_layout.init_state(config.train.seed)
    params, padding = vocab_split(setup.state_layout.to_logical(state["params"]), axes, vocab_size)
    expected, expected_loss = single_device_start(arch)
    assert_same_state(params, expected)
    assert padding and all(np.all(p == 0) for p in padding), setup.vocab

    step, losses = build_train_step(setup), []
    for batch in fixed_batches(config, 2):
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], expected_loss, rtol=1e-6)
    adam = state["opt_state"][1][0]  # ScaleByAdamState of the adamw chain
    for tree in (state["params"], adam.mu, adam.nu):
        _, padding = vocab_split(setup.state_layout.to_logical(tree), axes, vocab_size)
        assert all(np.all(p == 0) for p in padding)
    trained = vocab_split(setup.state_layout.to_logical(state["params"]), axes, vocab_size)[0]
    assert not np.array_equal(trained["embed"]["wte"], params["embed"]["wte"])  # it trains


# --------------------------------------------------------------------------- packed rows

# Packed rows (model.document_end; jaxptd/model/sequence.py): the loss is the mean over the
# targets that take loss, counted over the whole global batch (the rows hold 0 to 8 ends:
# every microbatch and data rank counts differently, so a count of its own would show).
END = 7
PACKED = [f"model.document_end={END}", "model.init_std=0.2"]
# Unpipelined, one layout holds data (4 ranks: each counts its own targets), tensor, SP,
# FSDP and the overlapped reduction; ZeRO-1 (which leaves the gradients as they are) and
# context with data, tensor and pipe on packed rows are tests/test_context.py's cases.
PACKED_LAYOUTS = {
    "d4-t2-fsdp-sp-overlap": (4, 1, 2, [FSDP, SP, "optimizer.overlap_grad_reduce=true",
                                        "parallel.microbatches=2"]),
    "p2-t2-1f1b": (1, 2, 2, _schedule("1f1b")),
    "d2-p2-t2-zb-h1-sp": (2, 2, 2, [SP, *_schedule("zb-h1")]),
    "p4-interleaved-steady": (1, 4, 1, [*_schedule("interleaved", 2), "model.num_layers=8",
                                        "parallel.round_form=steady"]),  # a spread head
}
PACKED_FAST = {"p2-t2-1f1b"}


def packed_batches(config, n, seed=0):
    """n of fixed_batches' global batches as packed rows: model.document_end only where
    placed, at 2 (i % 5) random inputs of row i (0 to 8 of its targets not counted), so
    that the rows', the microbatches' and the data ranks' counted targets differ."""
    end, rng = config.model.document_end, np.random.default_rng(seed)
    assert end >= 0
    batches = []
    for batch in fixed_batches(config, n, seed):
        batch = np.where(batch == end, end + 1, batch)  # ends only where placed
        for i, row in enumerate(batch):
            row[rng.choice(batch.shape[1] - 1, 2 * (i % 5), replace=False)] = end
        batches.append(batch)
    return batches


def _packed_setup(name):
    data, pipe, tensor, extra = PACKED_LAYOUTS[name]
    return make_setup(data, pipe, tensor, [*PACKED, *extra])


@pytest.mark.parametrize("name", [n if n in PACKED_FAST else pytest.param(
    n, marks=pytest.mark.slow) for n in PACKED_LAYOUTS])
def test_packed_loss_and_gradients_match_single_device(name):
    """A packed batch's loss at the layout is the single device's mean over the counted
    targets (helpers.reference_loss: not the one after a document end), and its gradients
    that mean's: pipelined (1F1B, zb-h1, interleaved with the head spread over the ranks),
    tensor with sequence parallelism, data with FSDP (rtol 1e-5)."""
    setup = _packed_setup(name)
    (batch,) = packed_batches(setup.config, 1)
    # 196 of 256 targets counted: a mean over every target would be 23% lower, far
    # outside the tolerance
    assert np.sum(batch[:, :-1] != END) < 0.8 * batch[:, :-1].size
    if setup.config.parallel.pipe > 1:  # the steady form spreads the head over the ranks
        assert pipeline_context(setup).spread_head == name.endswith("steady")
    assert_grads_match_single_device(setup, batch)


@pytest.mark.slow
def test_packed_training_and_eval_match_single_device():
    """Two Adam steps of packed batches at a pipelined layout with SP (zb-h1) give the
    single device's losses, and the eval step its loss of a third batch: the gradients'
    scale is the loss's, and evaluation is normalised as training."""
    setup = _packed_setup("d2-p2-t2-zb-h1-sp")
    config = setup.config
    batches = packed_batches(config, 3, seed=1)
    assert_steps_match_single_device(setup, 2, batches[:2])
    state = placed_state(setup)
    loss = build_eval_step(setup)(state["params"], jax.device_put(batches[2],
                                                                  setup.batch_sharding))
    params = setup.state_layout.to_logical(jax.device_get(state["params"]))
    np.testing.assert_allclose(float(loss), float(reference_loss(
        config, setup.vocab, params, batches[2])), rtol=1e-5)
