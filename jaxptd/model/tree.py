"""The parameter tree's parts (its shape: jaxptd/arch/interface.py): the ends (every
top-level key but 'layers') and which end of the model reads each of their leaves, a
stack's layers one at a time or stacked, and which leaves weight decay reaches.
"""
from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp

from jaxptd.config import ModelConfig
from jaxptd.model.registry import batch_width, get
from jaxptd.model.tensor import Layout


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


def per_layer(tree) -> list:
    """A stacked tree [n, ...] -> the list of its n layers' trees."""
    return [layer_at(tree, i) for i in range(jax.tree.leaves(tree)[0].shape[0])]


def in_host_memory(tree) -> bool:
    """Whether tree's leaves live in host memory (offload.optimizer's stored masters)."""
    return any(jax.typeof(x).memory_space == jax.memory.Space.Host
               for x in jax.tree.leaves(tree))


@jax.custom_vjp
def host_layers(tree) -> list:
    """per_layer(tree) of a stack in host memory, whose transpose writes each layer's
    cotangent into its place of a stack in host memory (an update of a slice: XLA's
    offloading pattern). The slices' own transpose pads every layer's cotangent to the
    whole stack and sums the pads, arithmetic XLA keeps in host memory and so runs on the
    host, over the whole stack once a layer."""
    return per_layer(tree)


def _host_layers_fwd(tree):
    return per_layer(tree), tree


def _host_layers_bwd(tree, cotangents: list):
    def stack(stored, *layers):  # every [n, ...] slice of stored overwritten, in place
        for i, layer in enumerate(layers):
            stored = jax.lax.dynamic_update_slice_in_dim(stored, layer[None], i, 0)
        return stored
    return (jax.tree.map(stack, tree, *cotangents),)


host_layers.defvjp(_host_layers_fwd, _host_layers_bwd)


def stacked(layers):
    """A list of layers' trees -> one tree [n, ...] (a tree already stacked: itself)."""
    return jax.tree.map(lambda *t: jnp.stack(t), *layers) if isinstance(layers, list) \
        else layers


def layer_at(tree, i):
    """Layer i of a stacked tree or of a list of layers (None: None)."""
    return tree[i] if isinstance(tree, list) else jax.tree.map(lambda a: a[i], tree)


def weight_decay_mask(params):
    """True for matrices (names starting with 'w'); biases and norms are not decayed."""
    def decayed(path, _):
        return getattr(path[-1], "key", "").startswith("w")
    return jax.tree_util.tree_map_with_path(decayed, params)
