"""Shared test set-up: tiny configs, meshes on the simulated devices, fixed batches, the
single-device reference (plain jax.grad of the unsharded model, no shard_map), and the
checkpoint fault-injection walk."""
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxptd.train import optim
from jaxptd.config import Config, load_config
from jaxptd.parallel.mesh import make_mesh
from jaxptd import model as models
from jaxptd.model import moe
from jaxptd.model.tensor import Layout
from jaxptd.train.step import Setup

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=8", "model.seq_len=16",
        "model.vocab_size=300", "train.global_batch=16", "optimizer.warmup_steps=1",
        "train.steps=10"]


def make_setup(data=1, pipe=1, tensor=1, extra=()):
    overrides = TINY + [f"parallel.data={data}", f"parallel.pipe={pipe}",
                        f"parallel.tensor={tensor}", *extra]
    config = load_config(None, overrides)
    mesh = make_mesh(config.parallel, jax.devices()[: config.num_devices])
    return Setup(config, mesh)


_HOST_STATES = {}


def placed_state(setup, seed=0):
    """setup.state_layout.init_state(seed)'s values placed in the layout's shardings, without compiling
    an initialiser per layout (that costs seconds for each on 2 cores): the logical state
    is initialised once per model, vocabulary and optimizer (jitted on one device, the
    values sharding-independent: test_parity), kept on the host, reshaped and placed."""
    config = setup.config
    key = (config.model, config.optimizer, setup.vocab, seed)
    if key not in _HOST_STATES:
        _HOST_STATES[key] = jax.device_get(jax.jit(
            lambda: setup.state_layout.to_logical(setup.state_layout.fresh_state(seed)))())
    return jax.device_put(setup.state_layout.to_stacked(_HOST_STATES[key]), setup.state_layout.state_shardings)


def fixed_batches(config, n, seed=0):
    """n random global batches in the architecture's rows (token rows for decoders)."""
    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch, config.model.seq_len + 1)
    high = config.model.vocab_size - models.reserved_ids(config.model)
    return [models.make_batch(rng.integers(0, high, shape).astype(np.int32), seed, step, 0,
                              config.model) for step in range(n)]


def reference_loss(config, vocab, params, batch):
    """The step's objective on one device, global parameters, no dropout: the token loss's
    mean over the targets that take loss plus the balance terms' over every token."""
    model, batch, key = config.model, jnp.asarray(batch), jax.random.key(0)
    loss, stats = models.loss_terms(params, batch, key, model, Layout(vocab), True)
    tokens, end = batch.shape[0] * model.seq_len, model.document_end
    counted = tokens if end < 0 else jnp.sum(batch[:, :-1] != end)  # packed: not after an end
    return loss / counted + moe.objective(stats, model) / tokens


@functools.lru_cache(maxsize=None)
def _reference_value_and_grad(model_config, vocab):
    """One jitted program per model (the layouts of a parity grid share it: compiled once,
    where op-by-op dispatch took three times as long for each)."""
    config = Config(model=model_config)
    return jax.jit(jax.value_and_grad(lambda p, b: reference_loss(config, vocab, p, b)))


def reference_loss_and_grads(config, vocab, params, batch):
    """Mean token loss and its gradients on one device, global parameters."""
    return _reference_value_and_grad(config.model, vocab)(params, jnp.asarray(batch))


@functools.lru_cache(maxsize=None)
def _reference_update(model_config, optimizer_config, train_config, vocab):
    """(optimizer, one jitted optimizer step) of the plain program, per model and
    optimizer (op by op, the optimizer's first update compiled each primitive alone: 10 s)."""
    config = Config(model=model_config, optimizer=optimizer_config, train=train_config)
    tx, value_and_grad = optim.make_optimizer(config), _reference_value_and_grad(
        model_config, vocab)

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss
    return tx, jax.jit(step)


def reference_losses(config, vocab, params, batches):
    """Losses of len(batches) optimizer steps of the plain single-device program."""
    tx, step = _reference_update(config.model, config.optimizer, config.train, vocab)
    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
        losses.append(float(loss))
    return losses


def assert_grads_match_single_device(setup, batch=None, stats_out=None):
    """build_grads at the setup's layout gives the single-device loss and gradients.
    stats_out: a dict that receives the step's mixture-of-experts statistics as "stats" (a
    test that checks them too need not compile the same program again)."""
    from jaxptd.train.step import build_grads

    state = placed_state(setup)
    batch = fixed_batches(setup.config, 1)[0] if batch is None else batch  # [B, s + 1]
    grads, loss, stats = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    if stats_out is not None:
        stats_out["stats"] = stats
    params = jax.device_get(setup.state_layout.to_logical(state["params"]))
    ref_loss, ref_grads = reference_loss_and_grads(setup.config, setup.vocab, params, batch)
    assert np.isfinite(float(ref_loss))
    # the reference's loss is the objective: a mixture of experts' balance terms included
    objective = loss + moe.objective(stats, setup.config.model) * setup.policy.token_norm
    np.testing.assert_allclose(float(objective), float(ref_loss), rtol=1e-5)
    assert_trees_close(setup.state_layout.to_logical(jax.device_get(grads)), ref_grads)
    return float(loss)


def assert_steps_match_single_device(setup, steps=3, batches=None):
    """`steps` optimizer steps at the setup's layout give the single-device losses."""
    from jaxptd.train.step import build_train_step

    state = placed_state(setup)
    params0 = setup.state_layout.to_logical(jax.device_get(state["params"]))  # (host memory: numpy)
    batches = batches or fixed_batches(setup.config, steps)
    step, losses = build_train_step(setup), []
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
        balance = moe.objective(metrics.get("moe"), setup.config.model)  # (the reference's
        losses.append(float(metrics["loss"] + balance * setup.policy.token_norm))  # objective)
    np.testing.assert_allclose(
        losses, reference_losses(setup.config, setup.vocab, params0, batches), rtol=1e-5)


def assert_trees_close(actual, expected, rtol=1e-5):
    """Elementwise rtol, with an absolute floor of rtol x the leaf's largest magnitude; the
    reference must be finite (NaN would match NaN)."""
    flat_a = jax.tree_util.tree_leaves_with_path(jax.device_get(actual))
    flat_e = jax.tree_util.tree_leaves(jax.device_get(expected))
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (jax.tree_util.keystr(path), a.shape, e.shape)
        assert np.isfinite(e).all(), jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.abs(e).max() + 1e-12,
                                   err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------- the CLI

def optimised_env(env: dict) -> dict:
    """env with the XLA flags the suite started with, not conftest's unoptimised code
    generation: for subprocesses that run many steps, where run time outweighs compile
    time (BERT's 300-step learning run: 120 s optimised, 284 s not)."""
    return dict(env, XLA_FLAGS=os.environ["JAXPTD_TEST_OPTIMISED_XLA_FLAGS"])


def train_cli_records(tmp_path, name, overrides):
    """Three steps of `python -m jaxptd.train` on a small model (plus `overrides`): its
    metrics.jsonl records, (those with a loss, the events)."""
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "jaxptd.train", "model.num_layers=4", "model.hidden_size=32",
           "model.num_heads=4", "model.seq_len=32", "train.global_batch=8", "train.steps=3",
           "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
           f"train.run_dir={run_dir}", *overrides]
    env = dict(os.environ, JAXPTD_CACHE=str(tmp_path.parent / "jaxptd-cache"))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=600, capture_output=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in records if "loss" in r], [r for r in records if "event" in r]


# --------------------------------------------------------------------------- checkpoint faults

FAULTS = ("truncate", "empty", "delete", "flip")


def damage(path: Path, fault: str) -> None:
    """Damages one file: half of it cut, emptied, deleted, or 4 bytes in its middle
    inverted (which also makes any text invalid UTF-8)."""
    data = path.read_bytes()
    if fault == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "delete":
        path.unlink()
    else:
        flipped = bytearray(data)
        for i in range(len(data) // 2, min(len(data) // 2 + 4, len(data))):
            flipped[i] ^= 0xFF
        path.write_bytes(bytes(flipped))


def assert_same_state(actual, expected) -> None:
    """Bitwise equality, leaves matched by path (a restored NamedTuple may be a dict)."""
    from jaxptd.checkpoint.checksums import leaf_name
    flat = lambda tree: {leaf_name(p): np.asarray(x) for p, x in
                         jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}
    a, e = flat(actual), flat(expected)
    assert a.keys() == e.keys()
    for name in e:
        np.testing.assert_array_equal(a[name], e[name], err_msg=name)


def walk_faults(source: Path, step: int, tmp: Path, restore, states: dict, capfd,
                rotate: bool = False) -> dict:
    """Every fault of FAULTS (with `rotate`, one per file, in turn) in every file of step
    `step` of checkpoint directory `source`, each on a fresh copy: `restore(directory)` must give (state, good step) with the state
    bitwise equal to `states[step]`, every other step kept, and, when it fell back, one
    warning line naming the damaged step. Returns {(file, fault): restored step}."""
    step_dir = source / str(step)
    files = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
    outcomes = {}
    for index, rel in enumerate(files):
        for fault in (FAULTS[index % len(FAULTS)],) if rotate else FAULTS:
            work = tmp / "walk"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(source, work)
            damage(work / str(step) / rel, fault)
            capfd.readouterr()
            state, got = restore(work)
            err = capfd.readouterr().err
            case = f"{fault} {rel}: restored step {got}; stderr {err[-1000:]}"
            assert "Traceback" not in err, case
            assert_same_state(state, states[got])
            assert all((work / str(s)).is_dir() for s in states if s != step), case
            if got != step:
                warnings = [line for line in err.splitlines() if line.startswith("warning:")]
                assert len(warnings) == 1 and f"step {step} is damaged" in warnings[0], case
            outcomes[(rel, fault)] = got
    return outcomes
HF_VOCAB = 301


def tiny_hf_model(kind: str):
    """A random transformers model with odd sizes and several layers (torch seed 0):
    GPT2LMHeadModel, LlamaForCausalLM with grouped-query attention (6 heads, 2 kv), the
    llama family's Qwen2, Mixtral and Qwen2-MoE (TINY_LLAMAS),
    BertForPreTraining (exact GeLU, [PAD] at 0) or MegatronBertForPreTraining (tanh GeLU,
    the special tokens at the top of the vocabulary, named in its config). BERTs' norms and
    biases are drawn too (transformers starts them at ones and zeros), so that a LayerNorm
    or bias in the wrong place shows."""
    import torch
    import transformers

    torch.manual_seed(0)
    if kind in ("bert", "megatron-bert"):
        return _tiny_bert(kind)
    if kind == "gpt":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=36, n_head=3, n_layer=3, vocab_size=HF_VOCAB, n_positions=20, n_inner=52,
            bos_token_id=None, eos_token_id=None)).eval()
    if kind in TINY_LLAMAS:
        return _tiny_llama(kind)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3,
        intermediate_size=70, vocab_size=HF_VOCAB, max_position_embeddings=64,
        rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None)).eval()


# The llama family's other classes, tiny (2 layers, 4 heads over 2 kv heads, 4 experts of
# which each token takes 2; Qwen2-MoE 4 layers, every second a mixture, the others dense):
# transformers class, its config class, the sizes of its own
TINY_LLAMAS = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(intermediate_size=44)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        intermediate_size=44, moe_intermediate_size=20, shared_expert_intermediate_size=36,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=4,
        decoder_sparse_step=2)),
}


def _tiny_llama(kind: str):
    """TINY_LLAMAS[kind] with its norms, biases and routers drawn too (transformers starts
    them at ones and zeros, and a router at small values whose top k is nearly a tie), so
    a norm or bias in the wrong place shows and routing is decided by clear margins."""
    import torch
    import transformers

    name, config, sizes = TINY_LLAMAS[kind]
    model = getattr(transformers, name)(getattr(transformers, config)(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=HF_VOCAB,
        max_position_embeddings=64, rope_theta=1000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        **{"num_hidden_layers": 2, **sizes}))
    with torch.no_grad():
        for param_name, value in model.named_parameters():
            if param_name.endswith("bias"):
                value.normal_(0.0, 0.1)
            elif "norm" in param_name:
                value.normal_(1.0, 0.1)
            elif param_name.endswith("gate.weight"):  # the router's and the shared gate's
                value.normal_(0.0, 0.5)
    return model.eval()


def assert_export_is_bitwise(checkpoint, hf_dir, dest):
    """`python -m jaxptd.hf export checkpoint dest` writes hf_dir's model.safetensors
    again: the same names, every tensor bit for bit."""
    from safetensors.numpy import load_file

    from jaxptd.hf import bridge as hf
    assert hf.main(["export", str(checkpoint), str(dest)]) == 0
    exported = load_file(Path(dest) / "model.safetensors")
    original = load_file(Path(hf_dir) / "model.safetensors")
    assert set(exported) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def torch_logits(model, tokens):
    """A transformers causal LM's logits of token ids [b, s], as numpy."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def generate_ids(model_cfg, params, vocab, tensor, prompt, new, **sampling):
    """`new` ids generated after `prompt` by jaxptd.generate at tensor size `tensor`."""
    from jaxptd import generate
    from jaxptd.config import ParallelConfig

    mesh = make_mesh(ParallelConfig(tensor=tensor), jax.devices()[:tensor])
    run = generate.build(model_cfg, mesh, vocab, len(prompt), new, **sampling)
    return np.asarray(run(params, jnp.asarray([prompt], jnp.int32), jax.random.key(0)))[0]


def _tiny_bert(kind: str):
    import torch
    import transformers

    sizes = dict(vocab_size=HF_VOCAB, hidden_size=36, num_attention_heads=3,
                 num_hidden_layers=3, intermediate_size=52, max_position_embeddings=24)
    if kind == "bert":
        model = transformers.BertForPreTraining(transformers.BertConfig(
            **sizes, hidden_act="gelu", pad_token_id=0))
    else:
        top = dict(zip(("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id"),
                       range(HF_VOCAB - 4, HF_VOCAB)))
        model = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(
            **sizes, hidden_act="gelu_new", **top))
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith("bias"):
                value.normal_(0.0, 0.1)
            elif "LayerNorm" in name or ".ln." in name:
                value.normal_(1.0, 0.1)
    return model.eval()


BERT_WORDPIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4 of tiny BERT's


def save_tiny_bert(kind: str, directory):
    """tiny_hf_model(kind) saved with a vocab.txt (BERT's: where its special ids are)."""
    model = tiny_hf_model(kind)
    model.save_pretrained(directory)
    if kind == "bert":
        words = BERT_WORDPIECES + [f"w{i}" for i in range(len(BERT_WORDPIECES), HF_VOCAB)]
        (Path(directory) / "vocab.txt").write_text("\n".join(words) + "\n")
    return model


def train_a_step_from_import(out, tmp_path, overrides: list) -> tuple[str, dict]:
    """`python -m jaxptd.train` one step from a Hugging Face import `out` (copied to a run
    directory) on a small prepared corpus at the layout `overrides` give; returns (the
    corpus, the step's metrics record) after checking the run resumed from step 0."""
    from jaxptd.data import prepare_corpus
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20)
    corpus = prepare_corpus([str(docs)], tmp_path / "corpus", val_fraction=0.3)
    run = tmp_path / "run"
    shutil.copytree(out, run)
    overrides = [*overrides, "train.steps=1", "train.log_every=1", "train.eval_every=0",
                 f"data.path={corpus}", f"train.run_dir={run}",
                 f"checkpoint.dir={run / 'checkpoints'}"]
    result = subprocess.run([sys.executable, "-m", "jaxptd.train", "--config",
                             str(run / "config.yaml"), *overrides], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step 0" in result.stdout
    record = [json.loads(line) for line in open(run / "metrics.jsonl") if '"loss"' in line][0]
    return corpus, record
