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
- experts -> expert: a mixture of experts' routed experts are split over the expert ranks
  (their hidden width, 'mlp', over tensor as the dense MLP's); the router's scores over
  all experts ('router') are replicated;
- everything else (embed, embed_out, kv, qkv, positions, layers, chunks, norm,
  types, router) is replicated.

FSDP (`parallel.fsdp`) shards every parameter (and so its gradient and Adam moments) over
the `fsdp` axis on its first free dimension divisible by the group size, past the layer-
stacking dimensions (`fsdp_spec`); `fsdp_dims` says which dimension of each leaf, as the
layers see it, to all-gather. ZeRO-1 (`optimizer.zero1`) further shards optimizer state
over the `data` axis (the replicas) on the first free dimension divisible by its size.

The varying-manual-axes helpers used inside the step's shard_map are varying.py's.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd.parallel.mesh import DATA, EXPERT, FSDP, PIPE, TENSOR

RULES: dict[str, str | None] = {
    "vocab": TENSOR,
    "heads": TENSOR,
    "kv_heads": TENSOR,  # grouped-query key/value heads, when the tensor size divides them
    "mlp": TENSOR,
    "stages": PIPE,
    "experts": EXPERT,
    "router": None,
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
    "fp8_operands": None,  # a linear's amax history (model.fp8=delayed): its operands,
    "fp8_history": None,  # ... and the steps it remembers
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


def _shard_free_dim(spec: P, shape: tuple[int, ...], axis: str, size: int, skip: int = 0):
    """spec with `axis` on the first dimension past `skip` that is unsharded and divisible
    by `size`. A leaf with no such dimension (a scalar, a small bias) stays as it was."""
    if size == 1:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i in range(skip, len(shape)):
        if entries[i] is None and shape[i] % size == 0:
            entries[i] = axis
            return P(*entries)
    return spec


def zero1_spec(spec: P, shape: tuple[int, ...], data_size: int, stacked: int = 0) -> P:
    """Adds the data axis (the replicas) to the first free dimension divisible by it past
    the `stacked` layer-stacking dimensions."""
    return _shard_free_dim(spec, shape, DATA, data_size, stacked)


def fsdp_spec(spec: P, shape: tuple[int, ...], group: int, stacked: int) -> P:
    """Adds the fsdp axis to the first free dimension divisible by the group size past
    the `stacked` layer-stacking dimensions (0 for the ends)."""
    return _shard_free_dim(spec, shape, FSDP, group, stacked)


# the name of a parameter brought to the device for its layer: all-gathered (FSDP) or
# fetched from host memory (offload.optimizer)
GATHERED = "fsdp_gathered"


def regather(prim, *_, **params) -> bool:
    """The jax.checkpoint policy of a layer under FSDP or with its masters in host memory:
    keep every value it computes except the parameters brought for it (the all-gather over
    fsdp and the GATHERED name), which the backward brings again (FSDP's memory: one
    unit's weights whole at a time; offload's: none of the masters kept on the device)."""
    if prim.name == "name":
        return params["name"] != GATHERED
    if prim.name in ("device_put", "pvary"):  # free to redo: the way from the stored
        return False  # parameter to the named one is kept open, nothing of it stacked
    if prim.name == "custom_vjp_call":  # a gradient hook (an identity forward) is free too,
        jaxpr = params["call_jaxpr"].jaxpr  # and so is a gather (reduction.fsdp_gathers)
        gathered = {v for e in jaxpr.eqns if e.primitive.name == "all_gather"
                    and not regather(e.primitive, **e.params) for v in e.outvars}
        return list(jaxpr.outvars) != list(jaxpr.invars) and not set(jaxpr.outvars) <= gathered
    if prim.name == "all_gather":
        names = params["axis_name"]
        return FSDP not in (names if isinstance(names, tuple) else (names,))
    return True


def fsdp_dims(specs, stacked: int):
    """For each leaf (a tree of PartitionSpecs), the dimension sharded over fsdp as the
    layers see the leaf, with its `stacked` leading dimensions gone; None if unsharded."""
    def dim(spec):
        hits = [i for i, entry in enumerate(spec) if entry == FSDP]
        return hits[0] - stacked if hits else None
    return jax.tree.map(dim, specs, is_leaf=is_spec)


def named(mesh, spec_tree, memory_kind: str | None = None):
    """A tree of PartitionSpecs -> a tree of NamedShardings on `mesh` (in `memory_kind`:
    None for the device's default, 'pinned_host' for host memory)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), spec_tree,
                        is_leaf=is_spec)
