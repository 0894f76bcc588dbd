"""The training step: one jitted SPMD program over the (data, fsdp, pipe, tensor) mesh.

Owns the train state, its shardings, and the step. The step has two parts:

1. Gradients, inside a fully manual `shard_map` over all axes. Each device holds its
   parameter shards and its data-parallel rows; tensor-parallel collectives are written
   out in the model (Megatron's f and g, or sequence parallelism's gathers and scatters).
   With pipe = 1 a scan runs the microbatches; with pipe > 1 the pipeline executor runs
   the schedule. Gradients accumulate over the microbatches locally and are reduced over
   data once per step (pipelined, a tied embedding's first over the first and last
   stage, Megatron's embedding group):
   all-reduced, or with ZeRO-1 reduce-scattered into the optimizer state's shards
   (`optimizer.grad_reduce_dtype`); pipelined, each chunk's layers as soon as the
   schedule is done with them (Config.reduces_chunks_early). With FSDP (`parallel.fsdp`,
   ZeRO-3) every parameter is sharded over the fsdp axis and all-gathered where it is
   used: each matmul's weight by `dense` for that matmul alone (seeds/003's unit, one
   linear), the rest of a layer with the layer, inside a `jax.checkpoint` so the backward
   gathers it again instead of keeping it; the gather's transpose reduce-scatters each
   microbatch's gradient into the shards (per microbatch: the memory of unsharded
   gradients is what FSDP exists to avoid).
   Why fully manual: every collective is explicit and countable, the Pallas kernels see
   local shapes, and the pipeline's per-rank control flow needs manual axes anyway.
2. The update, outside it (GSPMD): clipping, AdamW or SGD on float32 masters, ZeRO-1
   optimizer state sharded over the data replicas, dynamic loss scaling for float16.
   With `offload.optimizer` the masters and the optimizer's moments live in host memory
   (pinned_host) for the whole step: unpipelined, each layer's masters are brought to the
   device where the layer is used (forward, and again in the backward: never kept) and
   its gradient goes back to host memory as soon as it is reduced (Setup.streams);
   pipelined, the masters are brought whole. The update then streams through the device
   one layer at a time (jaxptd/offload.py).

The eval step (validation loss) is the same fully manual shard_map without gradients: a
forward over the local rows, or with pipe > 1 the executor's forward-only pipeline.

The state is a dict {params, opt_state, step, rng, loss_scale} passed in and returned.
"""
from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd import model as models
from jaxptd import offload, optim, target
from jaxptd.config import Config, ConfigError
from jaxptd.mesh import BATCH, DATA, FSDP, PIPE, TENSOR
from jaxptd.model.tensor import DENSE, Layout
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.executor import pipeline_grads, pipeline_loss, round_form
from jaxptd.sharding import (GATHERED, fsdp_dims, fsdp_spec, is_spec, mark_varying, named,
                             reduce_to, regather, specs_from_logical, zero1_spec)

REDUCED = (DATA, FSDP, PIPE)  # the axes gradients are reduced over


def _is_layer_leaf(path) -> bool:
    return any(getattr(entry, "key", None) == "layers" for entry in path)


def _map_layers(fn, tree, other=lambda x: x):
    """Applies fn to every leaf under a 'layers' key (params and their optimizer moments),
    `other` to the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if _is_layer_leaf(path) else other(x), tree, is_leaf=is_spec)


class Setup:
    """Everything derived once from the config and mesh: model layout, specs, optimizer.

    Two layouts of the state. Logical (checkpoints, initialisation): each layer leaf has a
    leading [num_layers] axis in model order. In memory with pipe > 1: [v, p, L/(p v), ...]
    (chunks, stages, layers of a chunk), a free reshape of the logical order in which
    rank r's dimension-1 slice holds virtual stages r, r + p, ...; each ends leaf [p, ...]
    over pipe, held in the slot of the stage that reads it (the embedding's stage 0, the
    head's stage p - 1, a tied embedding in both, equal) and zeros in the others, which
    stay zero (no gradient, no decay of a zero). So a tied embedding's gradient is summed
    over the two stages that read it, not all p, and every replica's update is the same.
    With pipe = 1 the two layouts are the same. FSDP shards both layouts over the fsdp
    axis the same way (fsdp_spec).
    """

    def __init__(self, config: Config, mesh):
        self.config, self.mesh = config, mesh
        model, par = config.model, config.parallel
        self.pipelined = par.pipe > 1
        self.vocab = model.padded_vocab(par.tensor)
        self.arch = models.get(model)
        try:  # the hardware the step is for: its GPU code paths and its numbers
            self.target = target.resolve(config.runtime.target, mesh.devices.flat)
        except target.TargetError as e:
            raise ConfigError(str(e)) from None
        logical = self.arch.logical_axes(model, self.vocab, par.tensor)
        self.ends_readers = models.ends_readers(model, self.vocab) if self.pipelined else {}
        # Checkpoints: layers split over pipe in contiguous blocks (stage r for v = 1).
        logical_params = jax.eval_shape(
            lambda: self.arch.init_params(model, self.vocab, jax.random.key(0)))
        self.logical_param_specs = self._fsdp(specs_from_logical(
            _map_layers(lambda names: P(*(("stages",) if self.pipelined else ("layers",)),
                                        *names[1:]), logical)), logical_params, 1)
        self.abstract_params = jax.eval_shape(self.to_stacked, logical_params)
        self.stacked = 3 if self.pipelined else 1  # leading dims of a layer leaf in memory
        self.param_specs = self._fsdp(specs_from_logical(_map_layers(
            lambda names: P("chunks", "stages", *names), logical,
            lambda names: P("stages", *names))), self.abstract_params,
            self.stacked) if self.pipelined else self.logical_param_specs
        self.local_layout = Layout(self.vocab, par.tensor, TENSOR, par.sequence_parallel,
                                   config.offload.activations, self.target.platform,
                                   fsdp=self._dense_shards(), fsdp_axis=FSDP,
                                   fsdp_dtype=config.optimizer.grad_reduce_dtype)
        self.tx = optim.make_optimizer(config, self.grad_norm)
        self.schedule = optim.lr_schedule(config)
        self.state_specs = self._state_specs(self.param_specs, self.abstract_params)
        self.state_shardings = self._shardings(self.state_specs, config.offload.optimizer)
        self.device_state_shardings = self._shardings(self.state_specs, False)
        self.logical_state_shardings = self._shardings(self._state_specs(
            self.logical_param_specs, logical_params, 1), False)
        # offload.optimizer unpipelined: the masters stay in host memory for the whole
        # step, each layer's brought to the device where it is used (`fetch`), and its
        # gradient goes back there (the transpose); pipelined, the step brings them whole
        self.streams = config.offload.optimizer and not self.pipelined
        self.batch_sharding = NamedSharding(mesh, P(BATCH))
        # Every loss is a sum over tokens scaled to the global token mean.
        self.loss_norm = 1.0 / (config.train.global_batch * model.seq_len)

    def compiler_options(self) -> dict | None:
        """The XLA options the step compiles with on its target (jaxptd/target.py)."""
        return target.compiler_options(self.target)

    def _fsdp(self, specs, shapes, stacked: int):
        """With parallel.fsdp, every leaf's spec also shards it over the fsdp axis."""
        group = self.config.parallel.fsdp_size
        if group == 1:
            return specs
        return jax.tree_util.tree_map_with_path(
            lambda path, spec, x: fsdp_spec(spec, x.shape, group,
                                            stacked if _is_layer_leaf(path) else 0),
            specs, shapes, is_leaf=is_spec)

    def _dense_shards(self) -> tuple[tuple[str, int], ...]:
        """((dense name, FSDP dimension as a layer sees it), ...) of the layer weights that
        FSDP shards and `dense` gathers itself, one matmul's weight at a time
        (parallel.fsdp_unit=matmul; with `layer`, none: `gather` brings the layer whole)."""
        if self.config.parallel.fsdp_unit != "matmul":
            return ()
        dims = traverse_util.flatten_dict(fsdp_dims(self.param_specs["layers"], self.stacked))
        shards = {path[-1]: dim for path, dim in dims.items()
                  if path[-1] in DENSE and dim is not None}
        assert len(shards) == sum(path[-1] in DENSE for path in dims if dims[path] is not None)
        return tuple(sorted(shards.items()))

    def _state_specs(self, param_specs, abstract_params, stacked: int | None = None):
        moments = self._zero1(param_specs, abstract_params,
                              self.stacked if stacked is None else stacked)
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

    def _zero1(self, specs, shapes, stacked: int):
        """With optimizer.zero1: specs also split over the data replicas, on a dimension
        past the layer-stacking ones (so each layer's part is its own)."""
        replicas = self.mesh.shape[DATA]
        if not self.config.optimizer.zero1 or replicas == 1:
            return specs
        return jax.tree_util.tree_map_with_path(
            lambda path, spec, x: zero1_spec(spec, x.shape, replicas,
                                             stacked if _is_layer_leaf(path) else 0),
            specs, shapes, is_leaf=is_spec)

    @property
    def grads_specs(self):
        """Where the reduced gradients land: like the optimizer's moments (with ZeRO-1
        reduce-scattered over the data replicas, else like the parameters)."""
        return self._zero1(self.param_specs, self.abstract_params, self.stacked)

    def gather(self):
        """(gather the ends, gather a layer's subtree) for use inside the shard_map: FSDP's
        all-gathers of parameter shards in optimizer.grad_reduce_dtype, named GATHERED so
        the layer's backward gathers them again rather than keeping them; their transpose
        reduce-scatters the gradients. With parallel.fsdp_unit=matmul a layer's dense()
        weights are left to `dense`, which gathers each for its own matmul
        (local_layout.fsdp), and this gathers the rest of the layer (biases, norms: O(h)).
        (None, None) without FSDP."""
        if self.config.parallel.fsdp_size == 1:
            return None, None
        dtype = jnp.dtype(self.config.optimizer.grad_reduce_dtype)

        def gatherer(dims_tree):
            flat_dims = {path: None if path[-1] in dict(self.local_layout.fsdp) else dim
                         for path, dim in traverse_util.flatten_dict(dims_tree).items()}

            def gather(tree):  # any subtree of dims_tree, matched by path
                flat = traverse_util.flatten_dict(tree)
                for path, x in flat.items():
                    dim = flat_dims[path]
                    if dim is not None:
                        whole = lax.all_gather(x.astype(dtype), FSDP, axis=dim, tiled=True)
                        flat[path] = checkpoint_name(whole.astype(x.dtype), GATHERED)
                return traverse_util.unflatten_dict(flat)
            return gather

        return (gatherer(fsdp_dims(models.ends(self.param_specs), 0)),
                gatherer(fsdp_dims(self.param_specs["layers"], self.stacked)))

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
            self.kind(path) if self.pipelined else None, to_memory, par.chunks, par.pipe),
            tree)

    def to_stacked(self, tree):
        """Logical -> in memory: [L, ...] layer leaves -> [v, p, L/(p v), ...], ends leaves
        -> [p, ...] slots (see the class docstring)."""
        return jax.tree.map(lambda f, x: f(x), self._converters(tree, True), tree)

    def to_logical(self, tree):
        """In memory -> logical (layer leaves [L, ...], each ends leaf from its slot)."""
        return jax.tree.map(lambda f, x: f(x), self._converters(tree, False), tree)

    def square_sum(self, path, g):
        """One gradient leaf's sum of squares, a tied embedding's two slots (the same
        gradient) counted once."""
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
    """Every leaf of `state` through its converter (Setup._converters) and placed by its
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
def _converter(kind: str | None, to_memory: bool, chunks: int, pipe: int):
    """One leaf's change of layout, logical -> in memory or back (Setup's docstring)."""
    if kind is None:
        return _same
    if kind == "layer":
        if to_memory:
            return lambda x: x.reshape(chunks, pipe, -1, *x.shape[1:])
        return lambda x: x.reshape(-1, *x.shape[3:])
    held = [(i == 0 and kind != "last") or (i == pipe - 1 and kind != "first")
            for i in range(pipe)]
    if to_memory:
        return lambda x: jnp.stack([x if h else jnp.zeros_like(x) for h in held])
    at = 0 if kind != "last" else pipe - 1
    return lambda x: x[at]


@lru_cache(maxsize=None)
def _placed(convert, sharding, from_host: bool):
    """convert jitted with its output placed by `sharding` (one compile per leaf shape and
    placement, reused by every save); a leaf in host memory is brought to the device for
    it (an ends leaf's slots are built there)."""
    if from_host:
        return jax.jit(lambda x: convert(jax.device_put(x, jax.memory.Space.Device)),
                       out_shardings=sharding)
    return jax.jit(convert, out_shardings=sharding)


@jax.custom_vjp
def _add_to_gradient(p, acc):
    """p; its gradient gets acc added (the microbatches before the last)."""
    return p


_add_to_gradient.defvjp(lambda p, acc: (p, acc),
                        lambda acc, g: (jax.tree.map(jnp.add, g, acc),
                                        jax.tree.map(jnp.zeros_like, acc)))


def _reduce_scatter_gradient(axis: str, dim: int, dtype):
    """p -> p, whose gradient is reduce-scattered over `axis` on `dim` in its backward,
    this rank's part placed where it belongs in a zero gradient of p's shape (ZeRO-1: the
    step keeps only that part)."""
    @jax.custom_vjp
    def hook(p):
        return p

    def backward(_, g):
        part = lax.psum_scatter(g.astype(dtype), axis, scatter_dimension=dim, tiled=True)
        where = lax.axis_index(axis) * part.shape[dim]
        return (lax.dynamic_update_slice_in_dim(jnp.zeros_like(g), part.astype(g.dtype),
                                                where, dim),)
    hook.defvjp(lambda p: (p, None), backward)
    return hook


class _Reduction:
    """How the step reduces gradients over data (and pipe): once, after everything
    (`after`), or, unpipelined, inside the last microbatch's backward (`hooks`): each
    parameter's gradient, plus the sum of the microbatches before, is all-reduced (the
    transpose of casting the parameter to varying where a layer uses it) or with ZeRO-1
    reduce-scattered as soon as its layer's backward is done (Megatron's
    --overlap-grad-reduce), so it can overlap the backward of the layers below."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.dtype = jnp.dtype(setup.config.optimizer.grad_reduce_dtype)
        zero1 = setup.config.optimizer.zero1
        self.scatter_dims = jax.tree.map(
            lambda have, want: next((i for i, e in enumerate(want) if e == DATA and (
                len(have) <= i or have[i] != DATA)), None) if zero1 else None,
            setup.param_specs, setup.grads_specs, is_leaf=is_spec)

    def after(self, grads, part=lambda tree: tree):
        """Local gradient sums -> reduced (and ZeRO-1 scattered), at the end of the step;
        `part`: which subtree of the gradients `grads` is (e.g. models.ends). An ends
        leaf, pipelined, is held over pipe (Setup): not reduced over it, but a tied
        one summed over the first and last stage (the others hold zeros)."""
        setup = self.setup
        pipe = setup.config.parallel.pipe
        pair = [(0, pipe - 1), (pipe - 1, 0)]

        def tied_sum(path, g):  # [1, ...] this stage's slot
            if setup.kind(path) != "both":
                return g
            return g + lax.ppermute(g.astype(self.dtype), PIPE, pair).astype(g.dtype)
        grads = jax.tree_util.tree_map_with_path(tied_sum, grads)
        return reduce_to(grads, part(setup.param_specs), part(setup.grads_specs), REDUCED,
                         self.dtype)

    def scattered_varying(self, params):
        """The last microbatch's parameters: the ZeRO-1 leaves varying over data already
        (their hook scatters the gradient; a cast inside would sum it), the rest invariant
        (their gradient is summed by the transpose of the cast to varying in `hook`)."""
        return jax.tree.map(lambda p, dim: p if dim is None else mark_varying(p, (DATA,)),
                            params, self.scatter_dims)

    def hook(self, params, acc, dims):
        """params as the model uses them in the last microbatch; acc the local gradient
        sums of the microbatches before (None: it is the only one); dims: each leaf's
        ZeRO-1 dimension there."""
        def one(p, dim, a=None):
            if dim is not None:  # scattered over data once fsdp and pipe have summed it
                p = _reduce_scatter_gradient(DATA, dim, self.dtype)(p)
            # summed over the axes p is cast over (the transpose of the cast), acc first
            p = mark_varying(p, REDUCED)
            return p if a is None else _add_to_gradient(p, a)
        return jax.tree.map(one, params, dims, *(() if acc is None else (acc,)))

    def hooks(self, acc):
        """(the ends' hook, a layer's hook, the layers' values it takes: acc's) of the last
        microbatch, acc the gradient sums of those before (None: the only one)."""
        dims, setup = self.scatter_dims, self.setup
        layer_dims = jax.tree.map(lambda d: None if d is None else d - setup.stacked,
                                  dims["layers"])
        acc_ends = acc and models.ends(acc)
        if acc and setup.streams:  # (the layers' slices are brought with their layer)
            acc_ends = jax.device_put(acc_ends, jax.memory.Space.Device)
        return (lambda ends: self.hook(ends, acc_ends, models.ends(dims)),
                lambda layer, acc_layer: self.hook(layer, acc_layer, layer_dims),
                acc and acc["layers"])

    def keep_parts(self, grads):
        """After the hooks: each ZeRO-1 leaf's own part of its full-size gradient."""
        def part(g, dim):
            if dim is None:
                return g
            size = g.shape[dim] // self.setup.mesh.shape[DATA]
            return lax.dynamic_slice_in_dim(g, lax.axis_index(DATA) * size, size, dim)
        return jax.tree.map(part, grads, self.scatter_dims)


def microbatch_grads(params, batch, key, loss_scale, *, setup: Setup, deterministic: bool):
    """Unpipelined gradients: a scan over the microbatches, reduced after it, or (config
    .overlaps_grad_reduce) over those before the last, whose local sums the last one's
    backward adds in and reduces layer by layer (_Reduction). Runs inside the shard_map.

    params: local shards, invariant over data; batch [rows, s + 1] local rows.
    Returns (reduced gradients, local loss sum), both scaled to the global token mean.
    """
    config = setup.config
    micro = batch.reshape(config.parallel.microbatches, -1, batch.shape[-1])  # [m, b, s+1]
    gather_ends, gather_layer = setup.gather()
    reduction = _Reduction(setup)

    def loss_fn(p, mb, k, hooks=None):
        ends_fn = _compose(gather_ends, hooks and hooks[0], setup.streams)
        layer_fn = _compose(gather_layer, hooks and hooks[1], setup.streams)
        extra = hooks and hooks[2]
        loss = models.loss_sum(p, mb, k, config.model, setup.local_layout, deterministic,
                               prepare_ends=ends_fn, prepare=layer_fn, extra=extra,
                               keep=regather if gather_layer or setup.streams else None
                               ) * setup.loss_norm
        return loss * loss_scale, loss

    varying = mark_varying(params, REDUCED)
    loss0 = mark_varying(jnp.float32(0), REDUCED)  # like the model's loss

    def grads_of(index):
        return jax.grad(loss_fn, has_aux=True)(varying, micro[index],
                                               jax.random.fold_in(key, index))

    def one(carry, index):
        grads, loss = grads_of(index)
        return (jax.tree.map(jnp.add, carry[0], grads), carry[1] + loss), None

    def sums(count):
        """(local gradient sums, loss sum) of the first `count` microbatches: a scan from
        zeros, or with Setup.streams from the first one's gradients (the sums live in host
        memory, where zeros would be made on the device and moved)."""
        if not setup.streams:
            zeros = jax.tree.map(jnp.zeros_like, varying)
            return lax.scan(one, (zeros, loss0), jnp.arange(count))[0]
        grads, loss = grads_of(0)
        first = (grads, loss0 + loss)
        return lax.scan(one, first, jnp.arange(1, count))[0] if count > 1 else first

    m = micro.shape[0]
    if not config.overlaps_grad_reduce:  # every microbatch in the scan, reduced after
        grads, loss = sums(m)
        return reduction.after(grads), loss
    acc, loss = None, loss0  # (no loop at all for one microbatch: not even its buffers)
    if m > 1:
        acc, loss = sums(m - 1)
    grads, last = jax.grad(loss_fn, has_aux=True)(
        reduction.scattered_varying(params), micro[-1], jax.random.fold_in(key, m - 1),
        reduction.hooks(acc))
    return reduction.keep_parts(grads), loss + last


def _compose(gather, hook, fetch: bool = False):
    """The parameter preparation of one use (the ends, or one layer and its slice of the
    extra values), None when there is nothing to do: with `fetch` (Setup.streams) the
    stored values brought from host memory to the device, then the reduction hook, then
    FSDP's gather."""
    if hook is None and gather is None and not fetch:
        return None

    def prepare(tree, *more):
        if fetch:  # (the transpose sends the gradient back to host memory)
            tree, more = jax.device_put((tree, more), jax.memory.Space.Device)
            tree = jax.tree.map(lambda x: checkpoint_name(x, GATHERED), tree)  # not kept
        if hook is not None:
            tree = hook(tree, *more)
        return tree if gather is None else gather(tree)
    return prepare


def pipeline_context(setup: Setup) -> Context:
    """What the pipeline executor reads (pipeline.context.Context), from the config and
    Setup: the schedule, the stash, the round form for the target, the model's functions,
    the local layout and FSDP's gathers."""
    par = setup.config.parallel
    gather_ends, gather_layer = setup.gather()
    return Context(
        schedule=par.schedule, pipe=par.pipe, chunks=par.chunks,
        microbatches=par.microbatches, stash=par.stash,
        round_form=round_form(setup.config, setup.target.platform),
        # PTD-P's scatter/gather splits a message over tensor; with sequence parallelism
        # the activations are already split over the sequence
        message_split=1 if setup.local_layout.split_sequence else par.tensor,
        model=setup.config.model, layout=setup.local_layout, arch=setup.arch,
        loss_norm=setup.loss_norm, gather_ends=gather_ends, gather_layer=gather_layer)


def build_grads(setup: Setup, deterministic: bool):
    """shard_map'd (params, batch, rng, step, scale) -> (grads, loss), reduced over data
    (ZeRO-1: scattered into the optimizer's shards)."""
    config = setup.config
    if config.parallel.pipe > 1:
        context = pipeline_context(setup)
        reduction = _Reduction(setup)

        early = config.reduces_chunks_early
        by_chunk = partial(reduction.after, part=lambda tree: tree["layers"])

        def local_fn(params, batch, key, scale):
            grads, loss = pipeline_grads(mark_varying(params, REDUCED), batch, key, scale,
                                         context=context, deterministic=deterministic,
                                         reduce_chunk=by_chunk if early else None)
            if not early:
                return reduction.after(grads), loss
            return {**reduction.after(models.ends(grads), models.ends),  # layers: reduced
                    "layers": grads["layers"]}, loss
    else:
        local_fn = partial(microbatch_grads, setup=setup, deterministic=deterministic)

    def local(params, batch, rng, step, scale):
        key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
        key = jax.random.fold_in(key, lax.axis_index(BATCH))
        grads, loss = local_fn(params, batch, key, scale)
        return grads, lax.psum(loss, REDUCED)

    return jax.shard_map(
        local, mesh=setup.mesh,
        in_specs=(setup.param_specs, P(BATCH), P(), P(), P()),
        out_specs=(setup.grads_specs, P()))


def build_train_step(setup: Setup):
    """The jitted step: (state, batch [global_batch, s + 1]) -> (state, metrics)."""
    config = setup.config
    dynamic = config.optimizer.loss_scale == "dynamic"
    grads_fn = build_grads(setup, deterministic=config.model.dropout == 0.0)
    on_device = setup.device_state_shardings

    def step_fn(state, batch):
        scale = state["loss_scale"]
        # offload.optimizer pipelined: the executor reads the masters on the device
        params = state["params"] if setup.streams else jax.device_put(
            state["params"], on_device["params"])
        grads, loss = grads_fn(params, batch, state["rng"], state["step"], scale.scale)
        if config.offload.optimizer:  # one layer's state on the device at a time
            new_params, opt_state, grad_norm, finite = offload.streamed_update(
                setup, state["params"], state["opt_state"], grads, scale.scale, dynamic)
        else:
            new_params, opt_state, grad_norm, finite = _update(
                setup, params, state["opt_state"], grads, scale.scale, dynamic)
        loss_scale = scale.update(finite) if dynamic else scale
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                     "rng": state["rng"], "loss_scale": loss_scale}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": setup.schedule(state["step"]),
                   "loss_scale": loss_scale.scale}
        return new_state, metrics

    return jax.jit(step_fn, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


def _update(setup: Setup, params, opt_state, grads, scale, dynamic: bool):
    """The optimizer step on the device: (new params, new opt_state, gradient norm, all
    gradients finite) from grads scaled by `scale`; with dynamic loss scaling a step whose
    gradients overflowed leaves params and opt_state as they were."""
    grads = jax.tree.map(lambda g: g / scale, grads)
    updates, new_opt = setup.tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = optim.all_finite(grads) if dynamic else jnp.bool_(True)
    if dynamic:
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
    return new_params, new_opt, setup.grad_norm(grads), finite


def build_eval_step(setup: Setup):
    """The jitted validation loss: (params, batch) -> mean token loss (no dropout). With
    pipe > 1 the pipeline runs the schedule's forwards alone (no gradient program)."""
    config = setup.config
    gather_ends, gather_layer = setup.gather()
    if config.parallel.pipe > 1:
        context = pipeline_context(setup)

        def local_loss(params, batch):
            loss = pipeline_loss(mark_varying(params, REDUCED), batch, context=context)
            return lax.psum(loss, REDUCED)
    else:
        def local_loss(params, batch):
            loss = models.loss_sum(params, batch, jax.random.key(0), config.model,
                                   setup.local_layout, True,
                                   prepare_ends=_compose(gather_ends, None, setup.streams),
                                   prepare=_compose(gather_layer, None, setup.streams))
            # (the loss varies over data and fsdp only; pipe is 1 here)
            return lax.psum(mark_varying(loss, REDUCED), REDUCED) * setup.loss_norm

    eval_fn = jax.shard_map(local_loss, mesh=setup.mesh,
                            in_specs=(setup.param_specs, P(BATCH)), out_specs=P())
    return jax.jit(lambda params, batch: eval_fn(params if setup.streams else jax.device_put(
        params, setup.device_state_shardings["params"]), batch),
        in_shardings=(setup.state_shardings["params"], setup.batch_sharding))
