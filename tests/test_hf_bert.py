"""The BERT side of the Hugging Face bridge against transformers itself, live: a tiny random
BertForPreTraining (post-LayerNorm, exact GeLU, [PAD] [CLS] [SEP] [MASK] at 0, 2, 3, 4 of
its vocab.txt) and MegatronBertForPreTraining (jaxptd's own BERT: pre-LayerNorm, tanh
GeLU, the special tokens at the top of the vocabulary) imported give transformers' logits
of both heads, masked LM and next-sentence (jaxptd: sentence-order) prediction, with
padding, and its loss; exported, they load in transformers as the same class and round-trip every
value. A BertForMaskedLM lacks the pooler and the sentence head: they are drawn fresh."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import (HF_VOCAB, assert_export_is_bitwise, assert_trees_close,  # noqa: E402
                     save_tiny_bert, tiny_hf_model, train_a_step_from_import)
from jaxptd.hf import bridge as hf  # noqa: E402
from jaxptd.data import TokenDataset  # noqa: E402
from jaxptd import model as models  # noqa: E402
from jaxptd.model import bert  # noqa: E402
from jaxptd.model.tensor import Layout  # noqa: E402

# norm_position, gelu, special_ids of each import
EXPECTED = {"bert": ("post", "erf", "0,2,3,4"), "megatron-bert": ("pre", "tanh", "")}


@pytest.fixture(scope="module", params=["bert", pytest.param("megatron-bert",
                                                       marks=pytest.mark.slow)])
def imported(request, tmp_path_factory):
    """(kind, transformers model, its directory, the import's directory)."""
    tmp = tmp_path_factory.mktemp(request.param)
    model = save_tiny_bert(request.param, tmp / "hf")
    assert hf.main(["import", str(tmp / "hf"), str(tmp / "jaxptd")]) == 0
    return request.param, model, tmp / "hf", tmp / "jaxptd"


def bert_logits(params, cfg, ids, types):
    """jaxptd's BERT through the training forward: (masked-LM logits [b, s, V], SOP logits
    [b, 2]) for ids and token types [b, s]; keys at [PAD] are masked out."""
    b, s = ids.shape
    batch = jnp.asarray(np.concatenate([ids, types, np.full((b, s), -1), np.zeros((b, 1))],
                                       axis=1), jnp.int32)
    layout, key = Layout(params["embed"]["wte"].shape[0]), jax.random.key(0)
    ends = models.ends(params)
    x = bert.embed(ends, batch, key, cfg, layout, True)
    x = models.apply_layers(params["layers"], x, batch, key, cfg, layout, True)
    mlm, sop = bert.output_logits(ends, x, cfg, layout)
    return np.asarray(mlm)[..., :cfg.vocab_size], np.asarray(sop)


def torch_logits(model, ids, types, pad):
    """transformers' (prediction logits, seq_relationship logits); the attention mask is
    what a tokenizer gives: 0 at [PAD]."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                    attention_mask=torch.tensor((ids != pad).astype(np.int64)))
    return out.prediction_logits.numpy(), out.seq_relationship_logits.numpy()


def inputs(cfg, seed):
    """Random ids [3, s] (every id, the specials included) and token types; the second row
    padded from position 15 on."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, HF_VOCAB, (3, cfg.seq_len))
    ids[1, 15:] = cfg.bert_specials[0]
    types = (np.arange(cfg.seq_len) >= rng.integers(2, cfg.seq_len, (3, 1))).astype(np.int64)
    return ids, types


def assert_close(ours, theirs):
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=2e-6 * np.abs(b).max())


def test_import_gives_transformers_logits_of_both_heads(imported):
    kind, model, _, out = imported
    config, params, step = hf.load_params(out)
    cfg = config.model
    assert step == 0 and (cfg.norm_position, cfg.gelu, cfg.special_ids) == EXPECTED[kind]
    ids, types = inputs(cfg, 1)
    assert_close(bert_logits(params, cfg, ids, types),
                 torch_logits(model, ids, types, cfg.bert_specials[0]))


def test_import_gives_transformers_loss(imported):
    """jaxptd's loss (each row's mean masked-LM loss plus its sentence-order loss, the mean
    over rows) is transformers' own (the mean over the batch's predicted tokens plus the
    next-sentence loss) where every row predicts as many tokens. MegatronBERT's special
    ids are the top of the vocabulary, which jaxptd never predicts (its masked-LM softmax
    leaves them out; transformers' does not): there the reference is transformers'
    logits' loss without those classes."""
    kind, model, _, out = imported
    config, params, _ = hf.load_params(out)
    cfg, reserved = config.model, models.reserved_ids(config.model)
    assert reserved == {"bert": 0, "megatron-bert": 4}[kind]
    ids, types = inputs(cfg, 4)
    rng = np.random.default_rng(4)
    labels = np.full(ids.shape, -100)  # transformers' "not predicted"; jaxptd's is -1
    for row in labels:  # 4 a row, all before the second row's padding
        row[rng.choice(15, 4, replace=False)] = rng.integers(0, HF_VOCAB - reserved, 4)
    order = rng.integers(0, 2, len(ids))
    batch = np.concatenate([ids, types, np.maximum(labels, -1), order[:, None]], axis=1)
    vocab = params["embed"]["wte"].shape[0]
    ours = models.loss_sum(params, jnp.asarray(batch, jnp.int32), jax.random.key(0), cfg,
                           Layout(vocab), True) / ids.size
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                       attention_mask=torch.tensor((ids != cfg.bert_specials[0]).astype(
                           np.int64)), labels=torch.tensor(labels),
                       next_sentence_label=torch.tensor(order))
    expected = theirs.loss.item()
    if reserved:
        classes, xent = HF_VOCAB - reserved, torch.nn.functional.cross_entropy
        without = (xent(theirs.prediction_logits[..., :classes].reshape(-1, classes),
                        torch.tensor(labels).reshape(-1))
                   + xent(theirs.seq_relationship_logits, torch.tensor(order))).item()
        assert abs(without - expected) > 1e-3 * expected  # the classes left out matter
        expected = without
    np.testing.assert_allclose(float(ours), expected, rtol=1e-6)


def test_export_round_trips_every_value(imported, tmp_path):
    """Exported: the same class, every tensor bit-exact (the decoder is tied to the word
    embeddings), transformers' logits unchanged, the special ids in config.json, and the
    import of the export equal to the first."""
    kind, model, hf_dir, out = imported
    assert_export_is_bitwise(out, hf_dir, tmp_path / "hf")
    reloaded = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded) is type(model)
    cfg = hf.load_params(out)[0].model
    ids, types = inputs(cfg, 2)
    pad = cfg.bert_specials[0]
    assert_close(torch_logits(reloaded, ids, types, pad), torch_logits(model, ids, types, pad))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [written[f"{t}_token_id"] for t in ("pad", "cls", "sep", "mask")] == \
        list(cfg.bert_specials)
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "again")]) == 0
    again = hf.load_params(tmp_path / "again")
    assert again[0].model == cfg
    assert_trees_close(again[1], hf.load_params(out)[1], rtol=0)


@pytest.mark.slow
def test_masked_lm_import_draws_the_missing_heads(tmp_path, capsys):
    """BertForMaskedLM has no pooler and no sentence head: the import says so, draws them
    as a fresh jaxptd BERT does, and gives transformers' masked-LM logits."""
    pretraining = tiny_hf_model("bert")
    model = transformers.BertForMaskedLM(pretraining.config).eval()
    model.load_state_dict(pretraining.state_dict(), strict=False)
    save_tiny_bert("bert", tmp_path / "hf")  # its vocab.txt
    model.save_pretrained(tmp_path / "hf")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    assert "has no bert.pooler.dense.weight" in capsys.readouterr().err
    config, params, _ = hf.load_params(tmp_path / "out")
    cfg = config.model
    ids, types = inputs(cfg, 3)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                         attention_mask=torch.tensor((ids != 0).astype(np.int64))).logits
    assert_close(bert_logits(params, cfg, ids, types)[:1], [expected.numpy()])
    fresh = bert.init_params(cfg, cfg.padded_vocab(1), jax.random.key(0))["heads"]
    for leaf in ("w_pool", "b_pool", "w_sop", "b_sop"):
        np.testing.assert_array_equal(params["heads"][leaf], fresh[leaf], err_msg=leaf)


@pytest.mark.slow
def test_training_resumes_from_a_bert_import_at_another_layout(imported, tmp_path):
    """The BertForPreTraining import (post-LN, special ids inside the vocabulary) trains at
    (data 2, pipe 3; no dropout): the first step's loss is the loss of transformers'
    logits on the same rows (jaxptd's: each row's mean masked-LM loss plus its
    sentence-order loss)."""
    kind, model, _, out = imported
    if kind != "bert":
        pytest.skip("one BERT is enough: the restore path does not depend on it")
    corpus, record = train_a_step_from_import(out, tmp_path, [
        "parallel.pipe=3", "parallel.data=2", "parallel.microbatches=2", "train.global_batch=4",
        "model.dropout=0"])
    cfg = hf.load_params(out)[0].model
    s = cfg.seq_len
    rows = models.make_batch(TokenDataset(corpus, "train").batch(0, 0, 4, s), 0, 0, 0, cfg)
    ids, types, labels, order = rows[:, :s], rows[:, s:2 * s], rows[:, 2 * s:3 * s], rows[:, -1]
    mlm, sop = (torch.tensor(x) for x in torch_logits(model, ids, types, cfg.bert_specials[0]))
    xent = torch.nn.functional.cross_entropy
    token_losses = xent(mlm.reshape(-1, HF_VOCAB), torch.tensor(np.maximum(labels, 0)).reshape(
        -1).long(), reduction="none").reshape(labels.shape).numpy()
    predicted = labels >= 0
    row_losses = (token_losses * predicted).sum(1) / predicted.sum(1) + xent(
        sop, torch.tensor(order).long(), reduction="none").numpy()
    np.testing.assert_allclose(record["loss"], row_losses.mean(), rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda d: os.remove(d / "vocab.txt"), "no id for [CLS] [SEP] [MASK]"),
    (lambda d: _edit(d, type_vocab_size=3), "2 token types"),
    (lambda d: _edit(d, position_embedding_type="relative_key"), "absolute"),
    (lambda d: _edit(d, hidden_act="relu"), "hidden_act='relu'"),
    (lambda d: _edit(d, is_decoder=True), "decoder"),
])
def test_what_jaxptd_bert_cannot_represent_is_one_error_line(tmp_path, capsys, change, message):
    save_tiny_bert("bert", tmp_path / "hf")
    change(tmp_path / "hf")
    capsys.readouterr()
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    shutil.rmtree(tmp_path / "hf")


def _edit(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
