"""The train state: its two layouts, their specs and shardings, its initialisation and
the change between the layouts.

The state is a dict {params, opt_state, step, rng, loss_scale}. Logical layout
(checkpoints, initialisation): each layer leaf has a leading [num_layers] axis in model
order (model.units: a unit of model.moe_every layers an element). In memory with pipe > 1: [v, p, L/(p v), ...] (chunks, stages, layers of a chunk), a
free reshape of the logical order in which rank r's dimension-1 slice holds virtual stages
r, r + p, ... (V-shaped schedules: chunk 1's ranks reversed, `_v_flip`); each ends leaf
[p, ...] over pipe, held in the slot of the rank that reads it (the embedding's rank 0,
the head's, schedules.head_rank: p - 1, or 0 V-shaped; a tied embedding in both, equal) and
zeros in the others, which stay zero (no gradient, no decay of a zero). So a tied
embedding's gradient is summed over the two stages that read it, not all p, and every
replica's update is the same. With pipe = 1 the two layouts are the same. FSDP shards both
layouts over the fsdp axis the same way (fsdp_spec); ZeRO-1 splits the optimizer's moments
over the data replicas; with offload.optimizer the masters and moments are in host memory.
Those decisions for the logical layout need no mesh, only the config's axis sizes
(`LogicalLayout`): StateLayout and the planner (jaxptd/plan/counts.py) both read them.
The optimizer (its state is part of this state) is made here, with the gradient norm that
counts each parameter once in this layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from jaxptd import model as models
from jaxptd.train import optim
from jaxptd.config import Config
from jaxptd.model import fp8
from jaxptd.model.tensor import DENSE
from jaxptd.pipeline.schedules import V_SHAPED, head_rank
from jaxptd.parallel.sharding import fsdp_dims, fsdp_spec, is_spec, named, specs_from_logical, zero1_spec


def _is_layer_leaf(path) -> bool:
    return any(getattr(entry, "key", None) == "layers" for entry in path)


def _map_layers(fn, tree, other=lambda x: x):
    """Applies fn to every leaf under a 'layers' key (params and their optimizer moments),
    `other` to the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if _is_layer_leaf(path) else other(x), tree, is_leaf=is_spec)


def _fsdp(config: Config, specs, shapes, stacked: int):
    """With parallel.fsdp, every leaf's spec also shards it over the fsdp axis, past a layer
    leaf's `stacked` leading dimensions."""
    group = config.parallel.fsdp_size
    if group == 1:
        return specs
    return jax.tree_util.tree_map_with_path(
        lambda path, spec, x: spec if fp8.is_history(path) else fsdp_spec(
            spec, x.shape, group, stacked if _is_layer_leaf(path) else 0),
        specs, shapes, is_leaf=is_spec)


def _zero1(config: Config, specs, shapes, stacked: int):
    """With optimizer.zero1: specs also split over the data replicas (the mesh's data axis,
    data / (fsdp_size x expert)), on the first free dimension past a layer leaf's leading
    `stacked` ones (StateLayout.grads_specs says which)."""
    par = config.parallel
    replicas = par.data // (par.fsdp_size * par.expert)
    if not config.optimizer.zero1 or replicas == 1:
        return specs
    return jax.tree_util.tree_map_with_path(
        lambda path, spec, x: spec if fp8.is_history(path) else zero1_spec(
            spec, x.shape, replicas, stacked if _is_layer_leaf(path) else 0),
        specs, shapes, is_leaf=is_spec)


@lru_cache(maxsize=16)
def _logical_model(arch, model, vocab: int, tensor: int) -> tuple:
    """(ShapeDtypeStructs of the logical parameters, jax.eval_shape of the initialiser,
    nothing allocated; their logical axis names). Cached: the planner's search asks for
    the same model at many layouts."""
    params = jax.eval_shape(lambda: arch.init_params(model, vocab, jax.random.key(0)))
    return params, arch.logical_axes(model, vocab, tensor)


@dataclass(frozen=True)
class LogicalLayout:
    """The logical (checkpoint) layout's decisions, from the config's axis sizes (tensor,
    pipe, fsdp group, data replicas), no mesh: what StateLayout builds its shardings from
    and the planner counts a 3072-GPU config's shards by. Trees like the parameters; a
    layer leaf [L, ...] is split over pipe in contiguous blocks (stage r for v = 1)."""
    params: Any  # ShapeDtypeStructs of the logical parameters
    axes: Any  # their logical axis names (PartitionSpecs; arch.logical_axes)
    tensor_specs: Any  # PartitionSpecs of the sharding rules (tensor; layers over pipe)
    param_specs: Any  # ... also over fsdp (parallel.fsdp): the masters and gradients
    moment_specs: Any  # ... also over the data replicas (optimizer.zero1): the moments

    @classmethod
    def of(cls, config: Config, arch, vocab: int) -> "LogicalLayout":
        params, axes = _logical_model(arch, config.model, vocab, config.parallel.tensor)
        layers = "stages" if config.parallel.pipe > 1 else "layers"
        tensor_specs = specs_from_logical(_map_layers(lambda names: P(layers, *names[1:]), axes))
        param_specs = _fsdp(config, tensor_specs, params, 1)
        return cls(params, axes, tensor_specs, param_specs,
                   _zero1(config, param_specs, params, 1))


class StateLayout:
    """The state's layouts and shardings on a mesh (the module docstring), decided once."""

    def __init__(self, config: Config, mesh, arch, vocab: int):
        self.config, self.mesh, self.arch, self.vocab = config, mesh, arch, vocab
        model, par = config.model, config.parallel
        self.pipelined = par.pipe > 1
        self.ends_readers = models.ends_readers(model, vocab) if self.pipelined else {}
        self.logical = LogicalLayout.of(config, arch, vocab)
        self.abstract_params = jax.eval_shape(self.to_stacked, self.logical.params)
        self.stacked = 3 if self.pipelined else 1  # leading dims of a layer leaf in memory
        self.param_specs = _fsdp(config, specs_from_logical(_map_layers(
            lambda names: P("chunks", "stages", *names), self.logical.axes,
            lambda names: P("stages", *names))), self.abstract_params,
            self.stacked) if self.pipelined else self.logical.param_specs
        self.tx = optim.make_optimizer(config, self.grad_norm)
        self.state_specs = self._state_specs(self.param_specs, self.abstract_params,
                                             self.grads_specs)
        self.state_shardings = self._shardings(self.state_specs, config.offload.optimizer)
        self.device_state_shardings = self._shardings(self.state_specs, False)
        self.logical_state_shardings = self._shardings(self._state_specs(
            self.logical.param_specs, self.logical.params, self.logical.moment_specs), False)

    def dense_shards(self) -> tuple[tuple[str, int], ...]:
        """((dense name, FSDP dimension as a layer sees it), ...) of the layer weights that
        FSDP shards and `dense` gathers itself, one matmul's weight at a time
        (parallel.fsdp_unit=matmul; with `layer`, none: reduction.fsdp_gathers brings the
        layer whole)."""
        if self.config.parallel.fsdp_unit != "matmul":
            return ()
        dims = traverse_util.flatten_dict(fsdp_dims(self.param_specs["layers"], self.stacked))
        shards = {path[-1]: dim for path, dim in dims.items()
                  if path[-1] in DENSE and dim is not None}
        assert len(shards) == sum(path[-1] in DENSE for path in dims if dims[path] is not None)
        return tuple(sorted(shards.items()))

    def _state_specs(self, param_specs, abstract_params, moments):
        return {
            "params": param_specs,
            "opt_state": optim.optimizer_specs(self.tx, abstract_params, moments),
            "step": P(),
            "rng": P(),
            "loss_scale": optim.LossScale(P(), P()),
        }

    def _shardings(self, specs, offload: bool):
        """NamedShardings; with offload, the masters and Adam's moments in host memory."""
        device = named(self.mesh, specs)
        if not offload:
            return device
        host = named(self.mesh, {k: specs[k] for k in ("params", "opt_state")},
                     memory_kind="pinned_host")
        return {**device, **host}

    @property
    def grads_specs(self):
        """Where the reduced gradients land: like the optimizer's moments (with ZeRO-1
        reduce-scattered over the data replicas, else like the parameters). Unpipelined,
        and with offload.optimizer (which brings the state a layer at a time), a layer
        leaf splits past its layer dimension: the last microbatch's hooks reduce each layer
        inside its backward. Pipelined, the gradients are reduced after the schedule (or a
        chunk at a time), so a layer leaf [v, 1, Lc, ...] may split on Lc: a split of that
        leading dimension is contiguous, where one of an inner dimension sets XLA
        transposing every gradient before its reduce-scatter and every master, moment
        and gathered parameter around the update."""
        whole_layers = not self.pipelined or self.config.offload.optimizer
        return _zero1(self.config, self.param_specs, self.abstract_params,
                      self.stacked if whole_layers else self.stacked - 1)

    def kind(self, path) -> str | None:
        """How a leaf of the state (or of its parameters, moments, gradients), by its path,
        is laid out in memory: 'layer', where its ends leaf is held ('first', 'last',
        'both': models.ends_readers; pipelined only) or None (as logical)."""
        if _is_layer_leaf(path):
            return "layer"
        keys = tuple(e.key for e in path if isinstance(e, jax.tree_util.DictKey))
        # the path's tail from an ends name: ("params", "embed", "wte") -> ("embed", "wte")
        return next((self.ends_readers[keys[i:]] for i in range(len(keys))
                     if keys[i:] in self.ends_readers), None)

    def _converters(self, tree, to_memory: bool):
        """For each leaf of `tree`, the function that changes its layout (_converter)."""
        par = self.config.parallel
        return jax.tree_util.tree_map_with_path(lambda path, _: _converter(
            self.kind(path) if self.pipelined else None, to_memory, par.chunks, par.pipe,
            par.schedule in V_SHAPED), tree)

    def to_stacked(self, tree):
        """Logical -> in memory: [L, ...] layer leaves -> [v, p, L/(p v), ...], ends leaves
        -> [p, ...] slots (the module docstring)."""
        return jax.tree.map(lambda f, x: f(x), self._converters(tree, True), tree)

    def to_logical(self, tree):
        """In memory -> logical (layer leaves [L, ...], each ends leaf from its slot)."""
        return jax.tree.map(lambda f, x: f(x), self._converters(tree, False), tree)

    def square_sum(self, path, g):
        """One gradient leaf's sum of squares, a tied embedding's two slots (the same
        gradient) counted once."""
        if fp8.is_history(path):  # (its entries are amaxes, no gradient: model/fp8.py)
            return jnp.float32(0)
        if self.kind(path) == "both":  # summed per slot first: a [p] vector crosses pipe
            return jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))[0]
        return jnp.sum(jnp.square(g))

    def grad_norm(self, grads):
        """The global norm of a gradient tree (in memory), each parameter counted once."""
        return jnp.sqrt(sum(jax.tree.leaves(
            jax.tree_util.tree_map_with_path(self.square_sum, grads))))

    def fresh_state(self, seed: int):
        """The train state at initialisation in the in-memory layout, unplaced: to trace
        under jit (init_state places it; abstract_state takes its shapes)."""
        dynamic = self.config.optimizer.loss_scale == "dynamic"
        params = self.to_stacked(self.arch.init_params(self.config.model, self.vocab,
                                                       jax.random.key(seed)))
        return {
            "params": params,
            "opt_state": self.tx.init(params),
            "step": jnp.int32(0),
            "rng": jax.random.key_data(jax.random.key(seed + 1)),
            "loss_scale": optim.LossScale.create(dynamic),
        }

    def init_state(self, seed: int):
        """Initialises the state directly into its shardings (no full copy on one host)."""
        return jax.jit(lambda: self.fresh_state(seed),
                       out_shardings=self.state_shardings)()

    def abstract_state(self, logical: bool = False):
        """ShapeDtypeStructs with shardings (in-memory or logical layout): what a checkpoint
        restores into."""
        convert = self.to_logical if logical else (lambda state: state)
        shapes = jax.eval_shape(lambda: convert(self.fresh_state(0)))
        shardings = self.logical_state_shardings if logical else self.state_shardings
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)

    def state_to_logical(self, state):
        """The train state in the checkpoint layout. Pipelined, its layer leaves are
        re-laid into host memory (pinned_host) one at a time, where Orbax would copy them
        anyway: a save holds one leaf twice on the device at most, never a second train
        state. Unpipelined, the state itself (same layout)."""
        if not self.pipelined:
            return state
        host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"),
                            self.logical_state_shardings)
        return _relayout(state, host, self._converters(state, False), consume=False)

    def state_from_logical(self, state):
        """A restored logical state -> the in-memory layout and shardings, leaf by leaf,
        each restored array freed once converted (one leaf twice at most, not two states).
        The restored arrays are consumed."""
        if not self.pipelined and not self.config.offload.optimizer:
            return state
        return _relayout(state, self.state_shardings, self._converters(state, True),
                         consume=True)


def _relayout(state, shardings, converters, consume: bool):
    """Every leaf of `state` through its converter (StateLayout._converters) and placed by its
    sharding, one leaf at a time (a leaf already there is kept as it is); with `consume`
    each source leaf is deleted as soon as its copy exists. Each leaf's program finishes
    before the next starts: dispatched together, their collectives deadlocked XLA CPU's
    in-process rendezvous (2 of 15 saves of a pipelined state on a busy 2-core machine)."""
    def one(x, sharding, convert):
        if convert is _same and x.sharding == sharding:
            return x
        y = _placed(convert, sharding, x.sharding.memory_kind != "device")(x)
        y.block_until_ready()
        if consume:
            x.delete()
        return y
    return jax.tree.map(one, state, shardings, converters)


def _same(x):
    return x


@lru_cache(maxsize=None)
def _converter(kind: str | None, to_memory: bool, chunks: int, pipe: int, v_shape: bool):
    """One leaf's change of layout, logical -> in memory or back (the module docstring)."""
    if kind is None:
        return _same
    if kind == "layer":
        if to_memory:
            return lambda x: _v_flip(x.reshape(chunks, pipe, -1, *x.shape[1:]), v_shape)
        return lambda x: _v_flip(x, v_shape).reshape(-1, *x.shape[3:])
    last = head_rank(v_shape, pipe, chunks)
    held = [(i == 0 and kind != "last") or (i == last and kind != "first")
            for i in range(pipe)]
    if to_memory:
        return lambda x: jnp.stack([x if h else jnp.zeros_like(x) for h in held])
    at = 0 if kind != "last" else last
    return lambda x: x[at]


def _v_flip(x, v_shape: bool):
    """A [v, p, ...] layer stack with its chunk 1 in the other rank order, V-shaped (its
    own inverse): rank r's chunk 1 is virtual stage 2p - 1 - r (schedules.virtual_stage),
    so that the logical layers, in order, run down chunk 0's ranks and back up chunk 1's."""
    return jnp.concatenate([x[:1], x[1:, ::-1]]) if v_shape else x


@lru_cache(maxsize=None)
def _placed(convert, sharding, from_host: bool):
    """convert jitted with its output placed by `sharding` (one compile per leaf shape and
    placement, reused by every save); a leaf in host memory is brought to the device for
    it (an ends leaf's slots are built there)."""
    if from_host:
        return jax.jit(lambda x: convert(jax.device_put(x, jax.memory.Space.Device)),
                       out_shardings=sharding)
    return jax.jit(convert, out_shardings=sharding)
