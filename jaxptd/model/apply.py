"""The model as training and evaluation run it, for every architecture: the layer stack
(`apply_layers`: a scan over the stacked layers or unrolled, `scans_layers`) under
model.remat's recomputation policy (`layer_function`), and the whole model's loss
(`loss_terms`, `loss_sum`) and a decoder's logits (`forward_logits`): the embedding, the
stack and the head of model.arch's record (registry.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd.config import ModelConfig
from jaxptd.model import moe, stack
from jaxptd.model.layers import RESIDUAL
from jaxptd.model.ordering import (AHEAD, reduced_ahead, waiting_attention_out,
                                   weight_gradients_first, weights_first)
from jaxptd.model.registry import get
from jaxptd.model.tensor import DENSE_INPUTS, DENSE_OUTPUT, PERTURBATIONS, QKV_OUTPUT, Layout
from jaxptd.model.tree import ends, host_layers, in_host_memory, layer_at, stacked


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
# forward GEMMs again. Pallas flash attention (model.attention=flash) is not kept: the
# backward re-runs its forward (jaxptd/train/metrics.py counts it).
def _kept_names(*names):
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(*names, RESIDUAL),
        lambda prim, *_, **__: prim.name == "dot_product_attention_fwd_wrapper")


MINIMAL = _kept_names(DENSE_OUTPUT, QKV_OUTPUT)
MINIMAL_MLP = _kept_names(DENSE_OUTPUT)


def apply_layers(layers, x, batch, key, cfg: ModelConfig, layout: Layout,
                 deterministic: bool, perturbations=None, prepare=None, extra=None, keep=None,
                 with_stats: bool = False, wait=None, reduced: bool = False,
                 apart: bool = False):
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
    apart: the backward runs in another program slot than the forward (layer_function).
    """
    scans = scans_layers(cfg, layout.platform)
    one_layer = layer_function(batch, key, cfg, layout, deterministic,
                               taped=perturbations is not None, prepare=prepare, keep=keep,
                               unrolled=not scans, apart=apart)
    n = len(layers) if isinstance(layers, list) else jax.tree.leaves(layers)[0].shape[0]
    if scans:
        xs = (stacked(layers), jnp.arange(n), perturbations, extra)
        x, (stats, inputs) = lax.scan(one_layer, x, xs)
    else:  # unrolled: what each layer keeps is its own buffer, no [n, ...] stack to fill
        outs, stored = [], host_layers(layers) if not isinstance(layers, list) and \
            in_host_memory(layers) else [layer_at(layers, i) for i in range(n)]
        pins = reduced and weights_first(cfg, layout, perturbations is not None)
        for i in range(n):
            if pins and i + AHEAD < n:
                x, stored[i + AHEAD] = reduced_ahead(x, stored[i + AHEAD])
            params = stored[i]
            if wait is not None and i == n // 2:
                params = waiting_attention_out(params, (x, wait))
            x, out = one_layer(x, (params, i, layer_at(perturbations, i), layer_at(extra, i)))
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
                   taped: bool = False, prepare=None, keep=None, apart: bool = False,
                   unrolled: bool = False):
    """What a layer of a stack computes, (x, (params, index, perturbations, extra)) -> (y,
    (statistics, dense() inputs)), under the recomputation policy of model.remat (see
    apply_layers). apart: the backward runs in another program slot than the forward (a
    pipeline's kept backward), so the recomputation needs no barrier against XLA merging it
    with the forward (jax.checkpoint's prevent_cse; the layer's own too, Layout.apart:
    tensor.entered's): without it the backward reads what it kept where it is, with it
    XLA first copied every kept value out of the pipeline's stash."""
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

    if layout.offload_activations and unrolled:
        return input_in_host_memory(one_layer)
    policy = OFFLOAD_LAYER_INPUTS if layout.offload_activations else {
        "full": None, "minimal": MINIMAL, "minimal_mlp": MINIMAL_MLP}.get(cfg.remat, keep)
    if layout.offload_activations or cfg.remat in ("full", "minimal", "minimal_mlp") or \
            keep is not None:
        # (minimal: FSDP's gathered weights are no matmul output, so they are regathered)
        return jax.checkpoint(one_layer, policy=policy, prevent_cse=not apart)
    return one_layer


def input_in_host_memory(one_layer):
    """one_layer (x, xs) -> y under full recomputation from its input x, which waits in host
    memory from the forward to the backward, for an unrolled stack (offload.activations).
    Its forward ends only once x's copy to host memory is done (an optimization barrier
    on the copy and the output), so the device's x is free when the next layer runs; with
    jax.checkpoint's offloading policy, unrolled, XLA's GPU compiler started each copy only
    when the backward neared the layer, keeping every input on the device meanwhile (a
    scan's iteration ends with its copy done, so a scanned stack keeps the policy)."""
    @jax.custom_vjp
    def layer(x, xs):
        return one_layer(x, xs)

    def forward(x, xs):
        y = one_layer(x, xs)
        y, kept = lax.optimization_barrier((y, jax.device_put(x, jax.memory.Space.Host)))
        return y, (kept, xs)

    def backward(saved, g):
        kept, xs = saved
        return jax.vjp(one_layer, jax.device_put(kept, jax.memory.Space.Device), xs)[1](g)
    layer.defvjp(forward, backward)
    return layer


def scans_layers(cfg: ModelConfig, platform: str) -> bool:
    """model.scan_layers resolved for a platform (Layout.platform): auto scans on CPU
    (compile time) and unrolls on a GPU (no per-layer stacks of kept values: each layer's
    are buffers of their own)."""
    return cfg.scan_layers == "true" or (cfg.scan_layers == "auto" and platform != "gpu")


def loss_terms(params, batch, key, cfg: ModelConfig, layout: Layout, deterministic: bool,
               prepare_ends=None, prepare=None, extra=None, keep=None,
               reduced: bool = False):
    """The whole model: batch [b, W] int32 -> (its loss sum, float32 (jaxptd/arch/interface.py);
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
