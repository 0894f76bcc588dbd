"""The real model's parameter counts, whole and on the busiest device, for the planner.

Owns `real_counts`: the parameter tree and its shards as jaxptd/train/state.py's LogicalLayout
decides them (the logical layout's specs: tensor, FSDP, ZeRO-1), from the config's axis
sizes with nothing allocated and no mesh, so a 3072-GPU config plans on a laptop. The
step, checkpoints and the H100 check read the same decisions through StateLayout, which
adds the mesh (NamedShardings) and the in-memory layout.

JAX and the model (and the mesh's axis names, in a module that imports JAX) are imported
inside the functions: `python -m jaxptd.plan --verify` sets XLA_FLAGS and the CPU device
count before JAX starts (jaxptd/plan/verify.py).
"""
from __future__ import annotations

import math

from jaxptd.config import Config


def _leaves(config: Config, vocab: int) -> tuple:
    """((kind, name, global shape, (tensor spec, weight spec, moment spec)), ...) of the real
    model, the specs as jaxptd/train/state.py's LogicalLayout decides them; kind: "layers", or
    which end reads the leaf ("first", "last", "both": a tied embedding,
    model.ends_readers); name: the leaf's own key (w_qkv, scale, ...)."""
    # JAX on use, imported here, not at the top: --verify must not start it before it sets
    # XLA_FLAGS (the module docstring)
    import jax
    from jaxptd import model as models
    from jaxptd.parallel.sharding import is_spec
    from jaxptd.train.state import LogicalLayout

    layout = LogicalLayout.of(config, models.get(config.model), vocab)
    specs = zip(*(jax.tree.leaves(tree, is_leaf=is_spec) for tree in
                  (layout.tensor_specs, layout.param_specs, layout.moment_specs)))
    readers = models.ends_readers(config.model, vocab)
    return tuple(("layers" if path[0].key == "layers" else
                  readers[tuple(e.key for e in path)], path[-1].key, tuple(x.shape), spec)
                 for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(layout.params),
                                            specs))


def real_counts(config: Config) -> dict:
    """Parameter counts of the real model and of the busiest device's shards (elements):
    weight_params (masters and gradients: tensor, pipe and FSDP shards), moment_params
    (the optimizer's moments, config.moments of them: Adam's mu and nu, SGD's momentum;
    also ZeRO-1's split over the data replicas), compute_params (what the forward reads:
    tensor and pipe shards), stage_params (the stage's layers of it), layer_params and
    ends_params (one layer, and the embedding, positions and final norm, tensor-local, not
    FSDP-split), and under FSDP what a gather materialises: dense_unit_params (with
    parallel.fsdp_unit=matmul the largest dense() weight of a layer, which `dense` gathers
    alone) and layer_gathered_params (the rest of a layer, gathered with it; a layer's
    unit: all of it); layer_weight_params and ends_weight_params (one
    layer's and the ends' part of weight_params: what offload.optimizer fetches and
    updates at a time); shared_ends_params (the ends both the embedding and the head
    read, a tied embedding); head_params (the ends the head reads, tensor-local: what a
    head spread over pipe broadcasts, jaxptd/pipeline/head.py); layer_grad_params (the
    stage's reduced layer gradients, split like a moment), layer_leaf_params (the largest
    layer leaf's part of weight_params, all the stage's layers of it), tied_params
    (pipelined: the ends both the first and the last stage read, a tied embedding, whose
    gradients those two exchange). Layers are split over pipe whether or not a leaf's layout names
    'stages' (pipe is not in `split`); FSDP and ZeRO-1 pick a dimension past the layer
    one (sharding.py's rule). "One layer"
    is one element of the layer stack: with model.moe_every = k a unit of k layers, which
    FSDP gathers and offload streams as one.

    A mixture of experts' routed experts (the leaves the 'experts' rule puts on the mesh's
    expert axis) are split over parallel.expert like any sharded dimension, the other
    leaves replicated over it; the data axis (the replicas, ZeRO-1's) is then data /
    (fsdp_size x expert), as the mesh lays it (jaxptd/parallel/mesh.py). expert_weight_params and
    expert_moment_params: the experts' part of weight_params and moment_params (their
    gradients are reduced over their own replicas only); params_experts: the experts'
    parameters in the whole model; params_active: what one token uses, the model less the
    routed experts it is not sent to (a top_k / E share of the experts' parameters)."""
    from jaxptd.parallel.mesh import DATA, EXPERT, FSDP, TENSOR  # JAX on use (docstring)

    par, model = config.parallel, config.model
    vocab = model.padded_vocab(par.tensor)
    g = par.fsdp_size
    sizes = {TENSOR: par.tensor, FSDP: g, EXPERT: par.expert,
             DATA: par.data // (g * par.expert)}
    leaves = _leaves(config, vocab)
    totals, experts = _totals(config, leaves, sizes, EXPERT)
    total = sum(math.prod(shape) for _, _, shape, _ in leaves)
    active = total - experts * (1 - model.moe_top_k / model.moe_experts) if experts else total
    return {**totals, "params_model": total, "params_experts": experts,
            "params_active": active, "vocab_padded": vocab}


LARGEST = ("dense_unit_params", "layer_leaf_params")  # real_counts takes the largest leaf's


def _totals(config: Config, leaves: tuple, sizes: dict, expert_axis: str) -> tuple:
    """(real_counts' per-device totals, the routed experts' parameters in the whole
    model) of the leaves (_leaves), split over the mesh's axes as `sizes` says ({axis
    name: its size}; the routed experts: the leaves on `expert_axis`)."""
    totals = dict.fromkeys(("weight_params", "moment_params", "compute_params",
                            "stage_params", "layer_params", "ends_params", "dense_unit_params",
                            "layer_gathered_params", "layer_weight_params",
                            "ends_weight_params", "shared_ends_params", "head_params",
                            "layer_grad_params", "layer_leaf_params",
                            "tied_params", "expert_weight_params", "expert_moment_params",
                            "fp8_gathered_params"), 0.0)

    def axes(spec) -> tuple:
        return tuple(a for e in spec if e for a in (e if isinstance(e, tuple) else (e,)))

    def split(spec) -> int:
        return math.prod(sizes.get(a, 1) for a in axes(spec))

    experts = 0
    for kind, name, shape, specs in leaves:
        counts = _leaf_counts(config, kind, name, shape, specs, split)
        if expert_axis in axes(specs[0]):
            experts += math.prod(shape)
            counts.update(expert_weight_params=counts["weight_params"],
                          expert_moment_params=counts["moment_params"])
        for key, count in counts.items():
            totals[key] = max(totals[key], count) if key in LARGEST else totals[key] + count
    return totals, experts


def _leaf_counts(config: Config, kind: str, name: str, shape: tuple, specs, split) -> dict:
    """One parameter leaf's part of real_counts' totals (dense_unit_params and
    layer_leaf_params: its own size, which real_counts takes the largest of). specs: its
    (tensor, weight, moment) specs (_leaves); split(spec): the devices a spec splits it
    over."""
    from jaxptd.model import fp8  # JAX on use (the module docstring)
    from jaxptd.model.tensor import DENSE

    par, model = config.parallel, config.model
    spec, sharded, moments = specs
    is_layer = kind == "layers"
    per_pipe = par.pipe if is_layer else 1
    size = math.prod(shape)
    tensor_local = size / split(spec)
    weights = size / split(sharded) / per_pipe
    moment = size / split(moments) / per_pipe  # one moment (or reduced gradient) of it
    counts = {"weight_params": weights, "moment_params": config.moments * moment,
              "compute_params": tensor_local / per_pipe}
    if not is_layer:
        both = tensor_local if kind == "both" else 0
        return {**counts, "ends_params": tensor_local, "ends_weight_params": weights,
                "shared_ends_params": both, "tied_params": both if par.pipe > 1 else 0,
                "head_params": tensor_local if kind != "first" else 0}
    one = tensor_local / model.units  # one element of the layer stack (gathered, streamed)
    gathered = sharded != spec  # FSDP splits it: a gather brings it whole
    by_matmul = par.fsdp_unit == "matmul"  # else the layer is gathered whole
    fp8_gathered = gathered and by_matmul and name in DENSE and model.fp8 == "delayed" \
        and name in fp8.LINEARS  # delayed scaling gathers these shards in FP8
    return {**counts, "layer_grad_params": moment, "stage_params": tensor_local / par.pipe,
            "fp8_gathered_params": tensor_local / par.pipe if fp8_gathered else 0.0,
            "layer_leaf_params": weights,
            "layer_params": one, "layer_weight_params": weights * par.pipe / model.units,
            "dense_unit_params": one if name in DENSE and gathered and by_matmul else 0.0,
            "layer_gathered_params": one if gathered and not (name in DENSE and by_matmul)
            else 0.0}

