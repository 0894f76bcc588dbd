"""Context parallelism and packed rows (jaxptd/model/sequence.py, jaxptd/model/context.py).

fp32 parity: at context 2 and 4, by ring and all-gather, alone and with data, tensor
(with and without sequence parallelism), pipe (every schedule), FSDP, ZeRO-1,
recomputation and offload, with the ring's XLA or Pallas flash blocks, the loss and every
gradient equal the single-device program's (rtol 1e-5), on packed rows (the decoders) and on BERT's padded bidirectional rows. The
ring alone (its own backward) against a dense masked attention of the whole rows, output
and vjp. Packed rows give each document the logits and loss it has alone (the
independent reference: each document run as its own row), under context parallelism too.
The chunk pairs balance the causal work (a checkpoint restores across a change of context:
tests/test_checkpoint.py).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_grads_match_single_device, fixed_batches, make_setup, placed_state

from jaxptd import model as models
from jaxptd.config import ModelConfig
from jaxptd.model import context
from jaxptd.model.sequence import Rows, local_index
from jaxptd.model.tensor import Layout
from jaxptd.train.step import build_grads

END = 7  # the document end of the packed cases
# a larger init than the default makes attention far from uniform, so a wrong mask shows
PACKED = [f"model.document_end={END}", "model.init_std=0.2"]
LLAMA = ["model.arch=llama", "model.num_kv_heads=2"]


def cp(c, method="ring", *more):
    return [f"parallel.context={c}", f"parallel.context_attention={method}", *PACKED, *more]


CASES = {
    "c2 ring": ((1, 1, 1), cp(2)),
    "c2 allgather t2 sp": ((1, 1, 2), cp(2, "allgather", "parallel.sequence_parallel=true")),
    "c2 ring d2 t2 zero1 remat": ((2, 1, 2), cp(2, "ring", "optimizer.zero1=true",
                                                "model.remat=full")),
    "c2 ring d2 fsdp selective offload": ((2, 1, 1), cp(2, "ring", "parallel.fsdp=true",
                                                        "model.remat=selective",
                                                        "offload.activations=true")),
    "c2 ring p2 gpipe bert": ((1, 2, 1), ["parallel.context=2", "model.arch=bert",
                                          "model.vocab_size=304", "model.init_std=0.2",
                                          "parallel.microbatches=2",
                                          "parallel.schedule=gpipe"]),
    "c2 ring t2 llama flash": ((1, 1, 2), ["parallel.context=2", "model.kernels=pallas",
                                           "model.init_std=0.2", *LLAMA]),
    "c2 ring d2 p2 zb-v fsdp": ((2, 2, 1), cp(2, "ring", "parallel.fsdp=true",
                                              "parallel.microbatches=2",
                                              "parallel.schedule=zb-v", "parallel.chunks=2")),
    "c4 allgather p2 interleaved llama": ((1, 2, 1), cp(4, "allgather", *LLAMA,
                                                        "parallel.microbatches=4",
                                                        "parallel.schedule=interleaved",
                                                        "parallel.chunks=2")),
}
FAST = ("c2 ring",)


def packed_batch(config, seed=0):
    """A global batch of random tokens with document ends at a few places in every row."""
    batch = fixed_batches(config, 1, seed)[0].copy()
    batch[batch == END] = END + 1  # ends only where placed
    rng = np.random.default_rng(seed)
    for row in batch:
        row[rng.choice(np.arange(1, batch.shape[1] - 1), 3, replace=False)] = END
    return batch


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_losses_and_gradients_match_single_device(name, monkeypatch):
    (data, pipe, tensor), extra = CASES[name]
    setup = make_setup(data, pipe, tensor, extra)
    if setup.config.model.document_end >= 0:  # (BERT: its own rows)
        monkeypatch.setattr("helpers.fixed_batches",
                            lambda config, n, seed=0: [packed_batch(config, seed)])
    assert_grads_match_single_device(setup)


def _dense(q, k, v, hidden, scale):
    """Plain softmax attention of q [b, s, heads, d] over k, v [b, s, kv_heads, d] (each
    key/value head repeated for its group) with hidden [b, s, s] True = masked; a query
    that sees no key gets zeros."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    blind = jnp.all(hidden, axis=-1, keepdims=True)[:, None]  # [b, 1, s, 1]
    scores = jnp.where(hidden[:, None], -jnp.inf, jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    probs = jnp.where(blind, 0.0, jax.nn.softmax(jnp.where(blind, 0.0, scores), axis=-1))
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("kind", [pytest.param("causal", marks=pytest.mark.slow),
                                  pytest.param("causal flash", marks=pytest.mark.slow),
                                  "causal segments", "bidirectional padding"])
def test_ring_attention_and_its_vjp_match_dense_attention(kind):
    """The ring (context 4, its own backward) against one dense attention of the whole rows
    with the mask built from row indices: the output and the vjp for q, k, v of a random
    cotangent. Grouped-query heads (4 over 2); packed documents (segments, positions
    restarting) or BERT's padded keys (a row all padding: zeros, no NaN); flash: the
    blocks are pallas_kernels.flash's (JAX's Pallas flash attention, interpret mode)."""
    c, b, s, heads, kv_heads, d = 4, 2, 32, 4, 2, 8
    rng = np.random.default_rng(0)
    q, d_out = (rng.normal(size=(b, s, heads, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(b, s, kv_heads, d)).astype(np.float32) for _ in range(2))
    index = np.arange(s)
    causal = kind.startswith("causal")
    hidden = np.broadcast_to(causal & (index[None, :] > index[:, None]), (b, s, s))
    positions, segments, padding = np.broadcast_to(index, (b, s)).astype(np.int32), None, None
    if "segments" in kind:  # documents ending at random places, not at the chunk edges
        starts = np.zeros((b, s), np.int32)
        for row in starts:
            row[rng.choice(np.arange(1, s), 4, replace=False)] = 1
        segments = np.cumsum(starts, axis=1).astype(np.int32)
        first = np.maximum.accumulate(np.where(starts > 0, index, 0), axis=1)
        positions = (index - first).astype(np.int32)
        hidden = hidden | (segments[:, None, :] != segments[:, :, None])
    if "padding" in kind:
        padding = index[None, :] >= np.array([[s - 11], [0]])  # a row's tail, a whole row
        hidden = hidden | padding[:, None, :]
    rows = Rows(jnp.asarray(positions), None if segments is None else jnp.asarray(segments),
                None if padding is None else jnp.asarray(padding))
    scale = d ** -0.5
    expected, vjp = jax.vjp(lambda *a: _dense(*a, jnp.asarray(hidden), scale), q, k, v)
    expected_grads = vjp(jnp.asarray(d_out))

    layout = Layout(128, context=c, context_axis="context", context_attention="ring")
    order = np.concatenate([np.asarray(local_index(s, layout, r)) for r in range(c)])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:c]), ("context",))
    ring = jax.shard_map(
        lambda q, k, v, rows: context.attention(q, k, v, rows, layout, causal=causal,
                                                scale=scale, cudnn=False,
                                                flash="flash" in kind, core=None),
        mesh=mesh, in_specs=(P(None, "context"),) * 3 + (P(),), out_specs=P(None, "context"))
    held = [jnp.asarray(x[:, order]) for x in (q, k, v)]  # rank r's tokens: its chunk pair

    @jax.jit
    def run(held, cotangent):
        out, pullback = jax.vjp(lambda *a: ring(*a, rows), *held)
        return out, pullback(cotangent)
    out, grads = run(held, jnp.asarray(d_out[:, order]))
    back = np.argsort(order)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6,
                              equal_nan=False)
    close(np.asarray(out)[:, back], expected)
    for name, got, want in zip("qkv", grads, expected_grads):
        close(np.asarray(got)[:, back], want, err_msg=name)


def _alone(doc, width):
    """A row [1, width] holding one document, then document ends to fill it."""
    return np.concatenate([doc, np.full(width - len(doc), END, np.int32)])[None]


def _documents(rng, lengths, vocab):
    """Documents of the given lengths (with their end token last), no other ends inside."""
    docs = []
    for n in lengths:
        doc = rng.integers(0, vocab, n).astype(np.int32)
        doc[doc == END] = END + 1
        doc[-1] = END
        docs.append(doc)
    return docs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama"])
def test_packed_row_gives_each_document_its_own_logits_and_loss(arch):
    """A row of three documents: each document's logits are those it has as a row of its
    own (positions restart, no attention across), the row's loss is the documents' summed
    (the target after an end counts nowhere); the same row as one stream differs."""
    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, seq_len=24,
                      vocab_size=64, init_std=0.2, document_end=END,
                      num_kv_heads=2 if arch == "llama" else 0)
    vocab = cfg.padded_vocab(1)
    # jitted: one compile each (eagerly, one per op of every call)
    params = jax.jit(functools.partial(models.get(cfg).init_params, cfg, vocab))(
        jax.random.key(0))
    docs = _documents(np.random.default_rng(0), (7, 9, 8), cfg.vocab_size)
    row = np.concatenate(docs)[None]  # [1, 24]
    layout = Layout(vocab)
    forward = jax.jit(models.forward_logits, static_argnums=(2, 3))
    loss_sum = jax.jit(lambda batch: models.loss_sum(params, batch, jax.random.key(0), cfg,
                                                     layout, True))

    def logits(tokens, c=cfg):
        return np.asarray(forward(params, jnp.asarray(tokens), c, layout))

    def loss(tokens, next_token):
        return float(loss_sum(jnp.asarray(np.concatenate([tokens, [[next_token]]], axis=1))))

    packed, start = logits(row), 0
    for doc in docs:  # alone: the document, then ends (causal: unseen; their targets: none)
        alone = _alone(doc, row.shape[1] + 1)
        np.testing.assert_allclose(packed[:, start:start + len(doc)],
                                   logits(alone[:, :-1])[:, :len(doc)], rtol=1e-5, atol=1e-5)
        start += len(doc)
    np.testing.assert_allclose(loss(row, 3), sum(loss(_alone(d, 24)[:, :-1], END)
                                                 for d in docs), rtol=1e-5)
    stream = dataclasses.replace(cfg, document_end=-1)
    assert not np.allclose(logits(row, stream)[:, 7:], packed[:, 7:], atol=1e-3)


@pytest.mark.slow
def test_packed_rows_under_context_parallelism_are_their_documents():
    """The loss of a packed batch under context 2 (ring, tensor 2) is the sum of its
    documents' losses, each run alone on one device: the step's loss (the mean over the
    targets that take loss) times their count."""
    setup = make_setup(1, 1, 2, cp(2, "ring", "train.global_batch=2", "model.seq_len=24",
                                  "model.vocab_size=64"))
    config = setup.config
    rng = np.random.default_rng(1)
    rows = [_documents(rng, lengths, config.model.vocab_size)
            for lengths in ((7, 9, 8), (12, 5, 7))]
    batch = np.stack([np.concatenate([*docs, [3]]) for docs in rows]).astype(np.int32)
    state = placed_state(setup)
    _, loss, _ = jax.jit(build_grads(setup, deterministic=True))(
        state["params"], jax.device_put(batch, setup.batch_sharding), state["rng"],
        state["step"], jnp.float32(1))
    params = setup.state_layout.to_logical(jax.device_get(state["params"]))
    alone = sum(float(models.loss_sum(params, jnp.asarray(_alone(doc, batch.shape[1])),
                                      jax.random.key(0), config.model, Layout(setup.vocab),
                                      True))
                for docs in rows for doc in docs)
    counted = np.sum(batch[:, :-1] != config.model.document_end)
    np.testing.assert_allclose(float(loss) * counted, alone, rtol=1e-5)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_chunk_pairs_cover_the_row_and_balance_the_causal_work(c):
    """Every position is held by exactly one rank; each rank's causally visible score
    entries are the same (imbalance 1.0), where contiguous chunks would give the last
    rank (2c - 1) / c of the mean."""
    seq = 16 * c
    layout = Layout(128, context=c, context_axis="context")
    held = [np.asarray(local_index(seq, layout, r)) for r in range(c)]
    assert sorted(np.concatenate(held).tolist()) == list(range(seq))
    work = [int(np.sum(idx + 1)) for idx in held]  # a query at i sees i + 1 keys
    assert max(work) == min(work)
    contiguous = [int(np.sum(np.arange(r * seq // c, (r + 1) * seq // c) + 1))
                  for r in range(c)]
    assert max(contiguous) / np.mean(contiguous) == pytest.approx((2 * c - 1) / c, rel=0.05)
