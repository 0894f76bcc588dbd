"""Logical axis names, the rules table, and logical -> PartitionSpec.

Owns Megatron's partitioning as data. Every parameter carries logical axis names (set in
the model with `nn.with_logical_partitioning`); `RULES` maps each name to a mesh axis:

- vocab -> tensor: the embedding (and the tied output layer) is vocab-parallel;
- heads -> tensor: QKV is column-parallel (split by heads), the attention output
  projection row-parallel (its input dimension is heads);
- kv_heads -> tensor: Llama's grouped-query key/value projection, column-parallel by
  key/value heads when the tensor size divides them (else the model names them
  kv_heads_replicated, which is replicated);
- mlp -> tensor: the first MLP layer(s) column-parallel, the second row-parallel;
- stages -> pipe: stacked layers are split into pipeline stages;
- everything else (embed, embed_out, kv, qkv, positions, layers, chunks, norm,
  types) is replicated.

ZeRO-1 (`optimizer.zero1`) further shards optimizer state over data on the first
dimension that is free and divisible by the data size.

Inside the step's manual shard_map, values carry JAX's varying-manual-axes type; the last
helpers here set it (`mark_varying`) and undo it by reduction (`reduce_to`).
"""
from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd.mesh import DATA, PIPE, TENSOR

RULES: dict[str, str | None] = {
    "vocab": TENSOR,
    "heads": TENSOR,
    "kv_heads": TENSOR,  # grouped-query key/value heads, when the tensor size divides them
    "mlp": TENSOR,
    "stages": PIPE,
    "embed": None,
    "kv": None,
    "qkv": None,
    "positions": None,
    "layers": None,
    "chunks": None,
    "norm": None,
    "kv_heads_replicated": None,  # ... else every rank holds them all
    "embed_out": None,  # BERT's replicated h x h head layers
    "types": None,  # BERT's token types and SOP classes
}


def logical_to_spec(names: tuple[str | None, ...], rules=RULES) -> P:
    """Maps a parameter's logical axis names to a PartitionSpec of mesh axes."""
    for name in names:
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table")
    return P(*(rules[n] if n is not None else None for n in names))


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def specs_from_logical(logical_tree, rules=RULES):
    """A tree of logical-name tuples (as PartitionSpecs) -> a tree of mesh PartitionSpecs."""
    return jax.tree.map(lambda names: logical_to_spec(tuple(names), rules), logical_tree,
                        is_leaf=is_spec)


def zero1_spec(spec: P, shape: tuple[int, ...], data_size: int) -> P:
    """Adds the data axis to the first unsharded dimension divisible by `data_size`.

    A leaf with no such dimension (a scalar, a small bias) stays as it was: it is tiny.
    """
    if data_size == 1:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, (entry, size) in enumerate(zip(entries, shape)):
        if entry is None and size % data_size == 0:
            entries[i] = DATA
            return P(*entries)
    return spec


def named(mesh, spec_tree):
    """A tree of PartitionSpecs -> a tree of NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=is_spec)


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which x differs between devices (JAX's vma type)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    return frozenset(vma if vma is not None else aval.manual_axis_type.varying)


def mark_varying(tree, axes: tuple[str, ...]):
    """Casts each leaf to varying over `axes` (those it is not already varying over), so
    its gradient stays a per-device partial sum until an explicit reduction."""
    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def reduce_to(tree, specs, axes: tuple[str, ...]):
    """Sums each leaf over the axes in `axes` that its PartitionSpec does not shard."""
    def reduce(x, spec):
        sharded = {a for entry in spec if entry for a in (entry if isinstance(entry, tuple)
                                                           else (entry,))}
        over = tuple(a for a in axes if a not in sharded)
        return lax.psum(x, over) if over else x
    return jax.tree.map(reduce, tree, specs, is_leaf=is_spec)
