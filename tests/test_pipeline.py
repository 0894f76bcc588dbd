"""Pipeline executor: parity with the single-device program for every schedule (training
and the forward-only eval), bounded memory for 1f1b/interleaved, and the point-to-point
traffic the schedule implies."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_grads_match_single_device, assert_steps_match_single_device,
                     fixed_batches, make_setup, reference_loss)
from jaxptd.config import ConfigError, load_config
from jaxptd.pipeline.executor import rounds_for
from jaxptd.pipeline.schedules import make_schedule, simulate
from jaxptd.step import build_eval_step, build_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (data, pipe, tensor, schedule, chunks, microbatches, layers): m = 1, m < p, m not a
# multiple of p, v from 1 to 4, with data and tensor parallelism inside the stages.
CASES = [
    (1, 2, 1, "1f1b", 1, 1, 4),
    (1, 4, 1, "1f1b", 1, 2, 4),
    (1, 4, 2, "1f1b", 1, 8, 4),
    (2, 2, 2, "1f1b", 1, 4, 4),
    (2, 2, 2, "gpipe", 1, 2, 4),
    (1, 8, 1, "gpipe", 1, 3, 8),
    (1, 2, 4, "interleaved", 2, 4, 4),
    (1, 4, 2, "interleaved", 2, 5, 8),
    (1, 4, 1, "interleaved", 2, 1, 8),
    (1, 2, 1, "interleaved", 3, 3, 6),
    (2, 2, 2, "interleaved", 4, 2, 8),
]


def pipelined_setup(data, pipe, tensor, schedule, chunks, micro, layers, extra=()):
    return make_setup(data, pipe, tensor, [
        f"parallel.schedule={schedule}", f"parallel.chunks={chunks}",
        f"parallel.microbatches={micro}", f"model.num_layers={layers}",
        f"train.global_batch={2 * data * micro}", *extra])


@pytest.mark.parametrize("stash, case", [("activations", c) for c in CASES] + [
    ("inputs", c) for c in CASES[2::4]], ids=lambda x: x if isinstance(x, str) else
    "-".join(map(str, x)))
def test_pipelined_gradients_match_single_device(stash, case):
    setup = pipelined_setup(*case, extra=[f"parallel.stash={stash}"])
    assert_grads_match_single_device(setup)


def test_pipelined_training_steps_match_single_device():
    """Three optimizer steps (interleaved, zero1) give the single-device losses."""
    setup = pipelined_setup(2, 2, 2, "interleaved", 2, 2, 4, ["optimizer.zero1=true"])
    assert_steps_match_single_device(setup)


def random_params(setup, seed=0):
    """Every leaf drawn N(0, 0.1) on the host, norms included (a stage that ran another
    stage's weights would show) -> (in-memory params in their shardings, logical params)."""
    rng = np.random.default_rng(seed)
    host = jax.tree.map(lambda x: rng.normal(0.0, 0.1, x.shape).astype(x.dtype),
                        setup.abstract_params)
    return jax.device_put(host, setup.state_shardings["params"]), setup.to_logical(host)


@pytest.mark.parametrize("case", [(1, 4, 1, "1f1b", 1, 8, 4), (1, 4, 1, "interleaved", 2, 5, 8),
                                  (2, 2, 2, "gpipe", 1, 2, 4)],
                         ids=lambda case: "-".join(map(str, case)))
def test_pipelined_eval_loss_matches_single_device(case):
    """The forward-only pipeline's loss: 1f1b, interleaved with m not a multiple of p, and
    data and tensor parallelism inside the stages."""
    setup = pipelined_setup(*case)
    params, logical = random_params(setup)
    batch = fixed_batches(setup.config, 1)[0]
    loss = build_eval_step(setup)(params, jax.device_put(batch, setup.batch_sharding))
    expected = reference_loss(setup.config, setup.vocab, logical, batch)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_pipelined_eval_runs_no_backward():
    """The eval program sends activations only (one ppermute; the gradient program has a
    second, backwards) and loops over the forward-only rounds, m + p - 1 for 1f1b, not the
    training schedule's."""
    p, m = 4, 8
    setup = pipelined_setup(1, p, 1, "1f1b", 1, m, 4)
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    params = setup.abstract_state()["params"]
    eval_step = build_eval_step(setup)
    assert str(jax.make_jaxpr(eval_step)(params, batch)).count("ppermute[") == 1
    text = eval_step.lower(params, batch).compile().as_text()
    trips = [int(n) for n in re.findall(r'known_trip_count[^0-9]*(\d+)', text)]
    assert max(trips) == m + p - 1 < rounds_for("1f1b", p, m, 1).num_rounds, trips


def test_layer_assignment_follows_virtual_stages():
    """Rank r holds virtual stages r, r + p, ...: with 4 ranks and 2 chunks of 16 layers,
    rank 0 holds layers 1-2 and 9-10 (PTD-P §2.2.2)."""
    setup = pipelined_setup(1, 4, 1, "interleaved", 2, 4, 16)
    logical = jnp.arange(16.0)[:, None] * jnp.ones((16, 3))
    stacked = setup.to_stacked({"layers": logical})["layers"]  # [v, p, Lc, 3]
    rank0 = stacked[:, 0, :, 0].reshape(-1)
    assert rank0.tolist() == [0.0, 1.0, 8.0, 9.0]
    assert setup.to_logical({"layers": stacked})["layers"].tolist() == logical.tolist()


def compiled_temp_bytes(schedule, micro, chunks=1, stash="activations"):
    setup = pipelined_setup(1, 4, 1, schedule, chunks, micro, 8,
                            [f"train.global_batch={micro}", "model.seq_len=64",
                             "model.hidden_size=64", f"parallel.stash={stash}"])
    batch = jax.ShapeDtypeStruct((micro, 65), jnp.int32, sharding=setup.batch_sharding)
    compiled = build_train_step(setup).lower(setup.abstract_state(), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("schedule, chunks, stash", [
    ("1f1b", 1, "activations"), ("interleaved", 2, "activations"), ("1f1b", 1, "inputs")])
def test_stash_memory_does_not_grow_with_microbatches(schedule, chunks, stash):
    small = compiled_temp_bytes(schedule, 8, chunks, stash)
    large = compiled_temp_bytes(schedule, 32, chunks, stash)
    assert large < 1.25 * small, (small, large)


def test_gpipe_memory_grows_with_microbatches():
    """GPipe keeps every microbatch's activations until its backward: about linear in m."""
    small, large = compiled_temp_bytes("gpipe", 8), compiled_temp_bytes("gpipe", 32)
    assert large > 2.5 * small, (small, large)


# "%x = f32[4,16,16]{1,0,2} collective-permute(...), source_target_pairs={{0,2},{2,4}}"
PERMUTE = re.compile(r"= (\w+)\[([\d,]*)\]\S* collective-permute(?:-start)?\(.*?"
                     r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@pytest.mark.parametrize("chunks, schedule", [(1, "1f1b"), (2, "interleaved")])
def test_point_to_point_traffic_matches_schedule(chunks, schedule):
    """Two collective-permutes per round, each [b, s, h/t] (scatter/gather), along the chain
    (ring when interleaved); rounds x ranks sends cover the schedule's m (p v - 1) messages."""
    p, t, m = 4, 2, 4
    setup = pipelined_setup(1, p, t, schedule, chunks, m, 8)
    config = setup.config
    batch = jax.ShapeDtypeStruct((config.train.global_batch, config.model.seq_len + 1),
                                 jnp.int32, sharding=setup.batch_sharding)
    text = build_train_step(setup).lower(setup.abstract_state(), batch).compile().as_text()
    permutes = PERMUTE.findall(text)
    assert len(permutes) == 2, permutes
    b = config.train.global_batch // m
    for dtype, dims, pairs in permutes:
        assert dtype == "f32"
        assert [int(d) for d in dims.split(",")] == [b, config.model.seq_len,
                                                      config.model.hidden_size // t]
        assert len(re.findall(r"\d+,\d+", pairs)) == t * (p if chunks > 1 else p - 1)
    rounds = rounds_for(schedule, p, m, chunks)
    trips = [int(n) for n in re.findall(r'known_trip_count[^0-9]*(\d+)', text)]
    assert rounds.num_rounds in trips
    useful = simulate(make_schedule(schedule, p, m, chunks)).messages
    assert useful == {"forward": m * (p * chunks - 1), "backward": m * (p * chunks - 1)}
    assert rounds.num_rounds * (p if chunks > 1 else p - 1) >= useful["forward"]


def test_bad_pipeline_configs_are_refused():
    with pytest.raises(ConfigError, match="model.num_layers=4: must be divisible"):
        load_config(None, ["parallel.pipe=4", "parallel.chunks=2",
                           "parallel.schedule=interleaved", "model.num_layers=4"])
    with pytest.raises(ConfigError, match="parallel.chunks=2: more than one chunk"):
        load_config(None, ["parallel.pipe=2", "parallel.chunks=2", "model.num_layers=4"])


def train_losses(tmp_path, name, overrides):
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "jaxptd.train", "model.num_layers=4", "model.hidden_size=32",
           "model.num_heads=4", "model.seq_len=32", "train.global_batch=8", "train.steps=3",
           "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
           f"train.run_dir={run_dir}", *overrides]
    env = dict(os.environ, JAXPTD_CACHE=str(tmp_path.parent / "jaxptd-cache"))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in records if "loss" in r], [r for r in records if "event" in r]


def test_train_cli_pipelined_equals_unpipelined(tmp_path):
    plain, _ = train_losses(tmp_path, "plain", ["parallel.data=2", "parallel.tensor=4",
                                                "parallel.microbatches=2"])
    piped, compiled = train_losses(tmp_path, "piped", [
        "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=2",
        "parallel.schedule=interleaved", "parallel.chunks=2"])
    np.testing.assert_allclose([r["loss"] for r in piped], [r["loss"] for r in plain],
                               rtol=1e-5)
    assert compiled[0]["bubble_fraction"] == pytest.approx(1 / 4)  # (p-1)/(v m)
