"""The models: the shared pieces (tensor.py: a tensor rank's view of parameters, matmuls
and collectives; layers.py: the layer's Flax modules; vocab.py: the vocabulary-parallel
embedding and loss; stack.py: the layer stack), one module per architecture (gpt.py,
llama.py, bert.py, each with its `ARCH` record: the interface of jaxptd/arch/interface.py),
and what every part outside model/ uses, so that nothing else branches on the architecture.

This module adds what is the same for every architecture: `get(cfg)` (model.arch's
record, through the registry jaxptd/arch), the layer stack (`apply_layers`, with the
zero-bubble taps: `perturbations`, `dense_weight_grads`), `loss_sum`, the batch rows and
the weight-decay rule.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd.arch import family
from jaxptd.arch.interface import Architecture
from jaxptd.config import ModelConfig
from jaxptd.model import moe, stack
from jaxptd.model.layers import RESIDUAL
from jaxptd.model.tensor import (DENSE, DENSE_INPUTS, DENSE_OUTPUT, ENTERED, PERTURBATIONS,
                                 QKV_OUTPUT, ATTENTION_OUT, Layout, enter_tensor, matmul)
from jaxptd.parallel.varying import after, rewritten_at, varying_axes, waiting, zeros_as


LAYER_INPUT = "layer_input"
# offload.activations: a layer keeps only its input, in host memory; the rest is recomputed.
OFFLOAD_LAYER_INPUTS = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
    offload_src="device", offload_dst="pinned_host")
# model.remat=minimal: a layer keeps its column-parallel matmul outputs (named by
# tensor.dense), the residual stream between its two blocks (so no all-reduce is re-run)
# and cuDNN flash attention's own outputs (its context and softmax statistics: the
# backward never re-runs attention); norms, activations, bias adds and an XLA attention
# core are recomputed from them. (The cuDNN forward is recognised by its primitive's name,
# the one thing here not covered by a public constant: the H100 compile test counts one
# cuDNN forward per layer, so a renamed primitive fails there.) model.remat=minimal_mlp
# keeps the same but the attention's q, k, v projection, which it recomputes from the
# layer's input (its norm, the sequence-parallel gather and the GEMM again): 2/3 of a
# layer's matmul outputs of GPT's [b, s, 4h/t] and [b, s, 3h/t], for a sixth of its
# forward GEMMs again.
def _kept_names(*names):
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(*names, RESIDUAL),
        lambda prim, *_, **__: prim.name == "dot_product_attention_fwd_wrapper")


MINIMAL = _kept_names(DENSE_OUTPUT, QKV_OUTPUT)
MINIMAL_MLP = _kept_names(DENSE_OUTPUT)


def get(cfg: ModelConfig) -> Architecture:
    """The architecture model.arch names."""
    return family(cfg).load()


def ends(params) -> dict:
    """The parameters outside the layer stack (used by the first and last stages)."""
    return {k: v for k, v in params.items() if k != "layers"}


@lru_cache(maxsize=16)
def ends_readers(cfg: ModelConfig, vocab: int) -> dict:
    """{key path of an ends leaf (a tuple of dict keys): 'first', 'last' or 'both'}: which
    end of the model reads it, the embedding, the head and loss, or both (a tied
    embedding: GPT's, BERT's), read off the two traced programs, nothing computed. Cached
    (read it, don't change it): the planner's search asks at many layouts."""
    arch = get(cfg)
    the_ends = ends(jax.eval_shape(lambda: arch.init_params(cfg, vocab, jax.random.key(0))))
    layout = Layout(vocab)
    batch = jax.ShapeDtypeStruct((1, batch_width(cfg)), jnp.int32)
    x = jax.ShapeDtypeStruct((1, cfg.seq_len, cfg.hidden_size), jnp.dtype(cfg.dtype))
    first = _read_leaves(lambda e, b: arch.embed(e, b, jax.random.key(0), cfg, layout, True),
                         the_ends, batch)
    last = _read_leaves(lambda e, y, b: arch.head_loss(e, y, b, cfg, layout),
                        the_ends, x, batch)
    paths = [tuple(entry.key for entry in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(the_ends)]
    return {path: "both" if f and l else "last" if l else "first"  # (unread: first)
            for path, f, l in zip(paths, first, last)}


def _read_leaves(fn, tree, *rest) -> list[bool]:
    """For each leaf of tree (fn's first argument), whether fn's traced program reads it."""
    jaxpr = jax.make_jaxpr(fn)(tree, *rest).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars[:len(jax.tree.leaves(tree))]]


def apply_layers(layers, x, batch, key, cfg: ModelConfig, layout: Layout,
                 deterministic: bool, perturbations=None, prepare=None, extra=None, keep=None,
                 with_stats: bool = False, wait=None, reduced: bool = False):
    """Applies a stack of layers (leading axis n, or a list of n layers' trees) to x
    [b, s, h], as a scan or unrolled (`scans_layers`); batch: the microbatch's rows, from
    which an architecture may take an attention mask (BERT).

    `key` seeds dropout; layer i uses fold_in(key, i) of its index in this stack.
    With model.remat == 'full' each layer's activations are recomputed in the backward pass
    ('minimal' keeps the matmul outputs and flash attention's residuals: MINIMAL;
    'minimal_mlp' the same but q, k and v: MINIMAL_MLP;
    'selective' recomputes only the attention core, inside layers.Attention); with
    layout.offload_activations too, and each layer's input waits for it in host memory.
    With `perturbations` (from `perturbations`: zeros added to every dense() output, so
    their gradient is the output gradient), returns (y, the input of every dense() matmul,
    each [n, ...]) instead of y. `prepare(layer params, layer's slice of extra)` turns
    what is stored into what a layer computes with, inside the scan (FSDP's all-gather, the
    step's gradient reduction hooks): it depends on no activation, so XLA may run layer
    i + 1's ahead of layer i's compute. keep: the jax.checkpoint policy of a prepared layer
    (which of its values the backward may keep; FSDP's says: not the gathered parameters).
    with_stats: y is (x, the layers' mixture-of-experts statistics, each [n, ...]: moe.py's
    dict; None for a dense model). wait (unrolled layers): values the middle layer's
    attention output projection waits for, with its input (`waiting_attention_out`): the
    pipeline's message in flight, whose transfer XLA then keeps beside that layer's
    attention (pipeline/executor.py). reduced: prepare's transpose all-reduces each
    layer's gradients (the step's hooks, no FSDP); unrolled and with `weights_first`, each
    layer's input gradient then waits for those of a layer above it (`reduced_ahead`).
    """
    one_layer = layer_function(batch, key, cfg, layout, deterministic,
                               taped=perturbations is not None, prepare=prepare, keep=keep)
    n = len(layers) if isinstance(layers, list) else jax.tree.leaves(layers)[0].shape[0]
    if scans_layers(cfg, layout.platform):
        xs = (stacked(layers), jnp.arange(n), perturbations, extra)
        x, (stats, inputs) = lax.scan(one_layer, x, xs)
    else:  # unrolled: what each layer keeps is its own buffer, no [n, ...] stack to fill
        outs, stored = [], [_layer(layers, i) for i in range(n)]
        pins = reduced and weights_first(cfg, layout, perturbations is not None)
        for i in range(n):
            if pins and i + AHEAD < n:
                x, stored[i + AHEAD] = reduced_ahead(x, stored[i + AHEAD])
            params = stored[i]
            if wait is not None and i == n // 2:
                params = waiting_attention_out(params, (x, wait))
            x, out = one_layer(x, (params, i, _layer(perturbations, i), _layer(extra, i)))
            outs.append(out)
        stats, inputs = (stacked([o[j] for o in outs]) if outs[0][j] is not None else None
                         for j in range(2))
    y = (x, stats) if with_stats else x
    return (y, inputs) if perturbations is not None else y


def apply_layer(params, x, index: int, batch, key, cfg: ModelConfig, layout: Layout,
                deterministic: bool, prepare=None, keep=None, apart: bool = False):
    """Layer `index` of a stack on its own, as apply_layers runs it (params: that layer's
    tree) -> (y, its mixture-of-experts statistics or None)."""
    y, (stats, _) = layer_function(batch, key, cfg, layout, deterministic, prepare=prepare,
                                   keep=keep, apart=apart)(x, (params, index, None, None))
    return y, stats


def layer_function(batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool,
                   taped: bool = False, prepare=None, keep=None, apart: bool = False):
    """What a layer of a stack computes, (x, (params, index, perturbations, extra)) -> (y,
    (statistics, dense() inputs)), under the recomputation policy of model.remat (see
    apply_layers). apart: the backward runs in another program slot than the forward (a
    pipeline's kept backward), so the recomputation needs no barrier against XLA merging it
    with the forward (jax.checkpoint's prevent_cse; the layer's own too, Layout.apart:
    tensor.entered's): without it the backward reads what it kept where it is, with it
    XLA first copied every kept value out of the pipeline's stash (11.5 ms a step of the
    H100 compile of (2,2,2) 1F1B m8 with model.remat=minimal)."""
    arch = get(cfg)
    layout = dataclasses.replace(layout, apart=True) if apart else layout
    layer = arch.block(cfg, layout)
    mask = arch.attention_mask(batch, cfg, layout)
    collections = [DENSE_INPUTS] * taped + [moe.STATS] * cfg.moe

    def one_layer(x, xs):
        params, index, added, more = xs
        if prepare is not None:
            params = prepare(params, more)
        if weights_first(cfg, layout, taped):
            x, params = weight_gradients_first(x, params)
        if layout.offload_activations:
            x = checkpoint_name(x, LAYER_INPUT)
        rngs = {"dropout": jax.random.fold_in(key, index)}
        variables = {"params": params, **({PERTURBATIONS: added} if taped else {})}
        if not collections:
            return layer.apply(variables, x, deterministic, mask, rngs=rngs), (None, None)
        y, state = layer.apply(variables, x, deterministic, mask, rngs=rngs,
                               mutable=collections)
        stats = stack.layer_tree(state[moe.STATS], cfg, cfg.unit - 1)["mlp"]["stats"] \
            if cfg.moe else None
        return y, (stats, state[DENSE_INPUTS] if taped else None)

    policy = OFFLOAD_LAYER_INPUTS if layout.offload_activations else {
        "full": None, "minimal": MINIMAL, "minimal_mlp": MINIMAL_MLP}.get(cfg.remat, keep)
    if layout.offload_activations or cfg.remat in ("full", "minimal", "minimal_mlp") or \
            keep is not None:
        # (minimal: FSDP's gathered weights are no matmul output, so they are regathered)
        return jax.checkpoint(one_layer, policy=policy, prevent_cse=not apart)
    return one_layer


def weights_first(cfg: ModelConfig, layout: Layout, taped: bool) -> bool:
    """Whether a layer's backward runs its weight gradients before it passes its input
    gradient on (`weight_gradients_first`) and, where the step reduces each layer's
    gradients in its backward, a layer's input gradient waits for those of a layer above
    it, reduced (`reduced_ahead`)."""
    return layout.platform == "gpu" and (layout.offload_activations or (
        cfg.remat == "full" and not taped and layout.context == 1))


@jax.custom_vjp
def _gradient_after(x, tree):
    """The identity on x and a tree, whose backward makes x's gradient depend on every
    leaf of the tree's (the dependence is data: varying.after and rewritten_at):
    `weight_gradients_first` and `reduced_ahead`."""
    return x, tree


def _gradient_after_bwd(_, grads):
    dx, dtree = grads
    return rewritten_at(dx, after(jnp.int32(0), dtree, like=dx)), dtree


_gradient_after.defvjp(lambda x, tree: ((x, tree), None), _gradient_after_bwd)


def weight_gradients_first(x, params):
    """The identity on a layer's input and parameters, whose backward makes the input
    gradient it passes on depend on the layer's parameter gradients: the layer below starts
    its backward only once this layer's weight-gradient GEMMs have run. Left free, XLA
    runs the input-gradient chain first (the critical path) and defers every layer's
    weight gradients, each keeping its inputs: with offload.activations, 17 layers'
    recomputed activations at once in the H100 compile of GPT-1.3B (27.8 GiB; 22.5 with
    this); with model.remat=full and the layers unrolled, a stage's 12 layers recomputed
    at once ((2,2,2) 1F1B m8 SP: 11.05 -> 7.83 GiB; (2,1,4) SP: 8.81 -> 5.62; no change
    of the static time). Not with model.remat=minimal, whose matmul outputs are kept
    anyway (14.50 -> 14.16 GiB there, with the planner's figure then 13% above it), nor
    for a zero-bubble B slot (`perturbations`: its dense() weights' gradients are the W
    slot's; made a dependence here, XLA computed them in the B slot too: zb-h1 m4 with
    full recomputation 197.7 -> 218.4 ms), nor with context parallelism (the ring's last
    backward send of a layer then overlapped nothing: tests/test_h100.py). The
    dependence is data (`_gradient_after`). GPU programs only: XLA's CPU schedule is
    another, which this made larger (seeds/003's proxies)."""
    return _gradient_after(x, params)


# reduced_ahead's distance: layer i's input gradient waits for the reduced gradients of
# layer i + AHEAD, so each reduction has the backward of the AHEAD - 1 layers between to
# run beside (1 layer at 1: none left where XLA's all-reduce combiner merges two layers'
# reductions into one, as it does below 128 MiB a layer; the H100 compile of a width-1024
# 8-layer offload step had then 1 of 5 all-reduces with a GEMM in flight, 3 of 4 at 2).
AHEAD = 2


def reduced_ahead(x, ahead):
    """The identity on layer i's input and layer i + AHEAD's stored parameters (what `prepare`
    turns into what that layer computes with), whose backward makes layer i's input
    gradient wait for the gradient of those parameters (`_gradient_after`), by then past
    prepare's transpose: all-reduced over data (the step's hook). So each layer's
    reduction runs beside the backward of the layers between it and the one that waits
    for it. Left free, XLA's scheduler queued them, one at a time, behind the last
    layers' backward: offload.activations on 8 H100s (GPT-1.3B) had 22 of its 41
    all-reduces with a GEMM in flight, 45 of 49 with this (the two bottom layers' four,
    which nothing waits for, have only the embedding's gradient after them; 48 of 50 at
    AHEAD = 1), at the same static time and 0.03 GiB more. Only with `weights_first` and
    no FSDP (measured on the H100 compile: (2,1,4) SP without recomputation took 0.6%
    more time, its all-reduces split where they had been combined; FSDP 8 and seeds/003's
    FSDP lost overlap of their reduce-scatters)."""
    return _gradient_after(x, ahead)


def waiting_attention_out(params, deps):
    """A layer's weights with its attention output projection (tensor.ATTENTION_OUT, the
    first matmul after the attention: what XLA runs just before it is the attention and
    the QKV projection) made to wait for `deps` (varying.waiting), where it varies over
    every mesh axis the leaves of deps do (no reduction needed)."""
    axes = frozenset().union(*map(varying_axes, jax.tree.leaves(deps)))
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({
        k: waiting(w, deps) if k[-1] in ATTENTION_OUT and axes <= varying_axes(w) else w
        for k, w in flat.items()})


def per_layer(tree) -> list:
    """A stacked tree [n, ...] -> the list of its n layers' trees."""
    return [_layer(tree, i) for i in range(jax.tree.leaves(tree)[0].shape[0])]


def stacked(layers):
    """A list of layers' trees -> one tree [n, ...] (a tree already stacked: itself)."""
    return jax.tree.map(lambda *t: jnp.stack(t), *layers) if isinstance(layers, list) \
        else layers


def _layer(tree, i):
    """Layer i of a stacked tree or of a list of layers (None: None)."""
    return tree[i] if isinstance(tree, list) else jax.tree.map(lambda a: a[i], tree)


def scans_layers(cfg: ModelConfig, platform: str) -> bool:
    """model.scan_layers resolved for a platform (Layout.platform): auto scans on CPU
    (compile time) and unrolls on a GPU (no per-layer stacks of kept values: each layer's
    are buffers of their own)."""
    return cfg.scan_layers == "true" or (cfg.scan_layers == "auto" and platform != "gpu")


def perturbations(layers, x, cfg: ModelConfig, layout: Layout, prepare=None):
    """Zeros shaped and typed (varying manual axes included) like every dense() output of
    the stack, [n, ...]: what `apply_layers` takes to tape a backward. Traces nothing."""
    layer = get(cfg).block(cfg, layout)

    def one_layer(x, params):
        params = params if prepare is None else prepare(params, None)
        y, state = layer.apply({"params": params}, x, True, None, mutable=[PERTURBATIONS])
        return y, state[PERTURBATIONS]

    return zeros_as(jax.eval_shape(lambda: lax.scan(one_layer, x, layers)[1]))


def split_dense(layers) -> tuple[dict, dict]:
    """A layer tree -> (its dense() weights, everything else): what W computes the
    gradients of, and what B does."""
    flat = traverse_util.flatten_dict(layers)
    dense = {k: v for k, v in flat.items() if k[-1] in DENSE}
    rest = {k: v for k, v in flat.items() if k[-1] not in DENSE}
    return traverse_util.unflatten_dict(dense), traverse_util.unflatten_dict(rest)


def merge_dense(dense: dict, rest: dict) -> dict:
    """The inverse of split_dense."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(dense),
                                         **traverse_util.flatten_dict(rest)})


def dense_weight_grads(dense, inputs, output_grads, layout: Layout, prepare=None):
    """Gradients of a stack's dense() weights [n, ...] from the input and the output gradient
    of each of their matmuls ([n, ...] trees with the weights' paths): a zero-bubble W, no
    forward; `layer_dense_weight_grads` of each layer."""
    return jax.vmap(lambda w, x, g: layer_dense_weight_grads(w, x, g, layout, prepare))(
        dense, inputs, output_grads)


def layer_dense_weight_grads(dense, inputs, output_grads, layout: Layout, prepare=None):
    """Gradients of one layer's dense() weights from the input and the output gradient of
    each of their matmuls (trees with the weights' paths). Each is the transpose of its
    matmul in the weight as the layer uses it: `prepare`d as apply_layers prepares it
    (FSDP's layer gather), then as dense() multiplies it (tensor.matmul: cast, and an FSDP
    shard gathered for it alone); the gathers' transposes reduce-scatter the gradient into
    the shard. XLA drops the matmul's unused forward. The inputs of tensor.ENTERED matmuls
    are recorded before f (under the name ENTERED gives) and enter the tensor region again
    here (sequence parallelism: all-gathered)."""
    flat_inputs = traverse_util.flatten_dict(inputs)
    flat_grads = traverse_util.flatten_dict(output_grads)

    def one(path, w):  # w: float32 master weight (or shard) of one dense name
        product = matmul(path[-1], layout)
        if path[-1] in ENTERED:
            x = enter_tensor(flat_inputs[(*path[:-1], ENTERED[path[-1]])], layout)
        else:
            x = flat_inputs[path]

        def use(v):
            if prepare is not None:
                v = traverse_util.flatten_dict(
                    prepare(traverse_util.unflatten_dict({path: v}), None))[path]
            return product(x, v)
        return jax.vjp(use, w)[1](flat_grads[path])[0]

    flat = traverse_util.flatten_dict(dense)
    return traverse_util.unflatten_dict({path: one(path, w) for path, w in flat.items()})


def loss_terms(params, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool,
               prepare_ends=None, prepare=None, extra=None, keep=None,
               reduced: bool = False):
    """The whole model: batch [b, W] int32 -> (its loss sum, float32 (module docstring);
    the layers' mixture-of-experts statistics, moe.py's, or None). prepare_ends (and
    prepare, extra, keep, reduced: see apply_layers) turn the stored parameters into what
    the model computes with."""
    arch = get(cfg)
    the_ends = ends(params) if prepare_ends is None else prepare_ends(ends(params))
    x = arch.embed(the_ends, batch, key, cfg, layout, deterministic)
    x, stats = apply_layers(params["layers"], x, batch, key, cfg, layout, deterministic,
                            prepare=prepare, extra=extra, keep=keep, with_stats=True,
                            reduced=reduced)
    return arch.head_loss(the_ends, x, batch, cfg, layout), stats


def loss_sum(params, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool,
             prepare_ends=None, prepare=None, extra=None, keep=None):
    """What training minimises, in loss-sum units: the loss sum of `loss_terms` plus a
    mixture of experts' balance terms (moe.objective)."""
    loss, stats = loss_terms(params, batch, key, cfg, layout, deterministic, prepare_ends,
                             prepare, extra, keep)
    return loss + moe.objective(stats, cfg)


def forward_logits(params, tokens, cfg: ModelConfig, layout: Layout):
    """A decoder's logits [b, s, V/t] float32 for tokens [b, s] through the training
    forward (no cache, no dropout)."""
    arch, key = get(cfg), jax.random.key(0)
    batch = jnp.pad(tokens, ((0, 0), (0, 1)))  # the rows embed expects: s + 1 tokens
    x = arch.embed(ends(params), batch, key, cfg, layout, True)
    x = apply_layers(params["layers"], x, batch, key, cfg, layout, True)
    return arch.decoder.logits(ends(params), x, cfg, layout)


def batch_width(cfg: ModelConfig) -> int:
    """Columns of a batch row: s + 1 tokens for decoders."""
    return get(cfg).batch_width(cfg)


def make_batch(tokens: np.ndarray, seed: int, step: int, first_row: int,
               cfg: ModelConfig) -> np.ndarray:
    """Token rows [n, s + 1] (rows first_row.. of batch `step`) -> the architecture's rows
    [n, batch_width] int32, a pure function of its arguments (numpy, on the host)."""
    return get(cfg).make_batch(tokens, seed, step, first_row, cfg)


def reserved_ids(cfg: ModelConfig) -> int:
    """Ids at the top of model.vocab_size the architecture keeps for itself (BERT's special
    tokens); the data's ids must stay below them."""
    return get(cfg).reserved_ids(cfg)


def weight_decay_mask(params):
    """True for matrices (names starting with 'w'); biases and norms are not decayed."""
    def decayed(path, _):
        return getattr(path[-1], "key", "").startswith("w")
    return jax.tree_util.tree_map_with_path(decayed, params)
