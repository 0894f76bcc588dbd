"""The training step: one jitted SPMD program over the (data, pipe, tensor) mesh.

Owns the train state, its shardings, and the step. The step has two parts:

1. Gradients, inside a fully manual `shard_map` over all three axes. Each device holds its
   parameter shards and its data-parallel rows; tensor-parallel collectives are written
   out in the model (Megatron's f and g). Gradients accumulate over the microbatches
   locally and are reduced over data (and over pipe for parameters every stage holds)
   once per step. With pipe = 1 a scan runs the microbatches; with pipe > 1 the pipeline
   executor runs the schedule.
   Why fully manual: every collective is explicit and countable, the Pallas kernels see
   local shapes, and the pipeline's per-rank control flow (lax.cond on the pipe rank)
   needs manual axes anyway.
2. The update, outside it (GSPMD): clipping, AdamW on float32 masters, ZeRO-1 optimizer
   state sharded over data, dynamic loss scaling for float16.

The eval step (validation loss) is the same fully manual shard_map without gradients: a
forward over the local rows, or with pipe > 1 the executor's forward-only pipeline.

The state is a dict {params, opt_state, step, rng, loss_scale} passed in and returned.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd import optim
from jaxptd.config import Config
from jaxptd.mesh import DATA, PIPE, TENSOR
from jaxptd import model as models
from jaxptd.model.layers import Layout
from jaxptd.sharding import is_spec, mark_varying, named, reduce_to, specs_from_logical


def _is_layer_leaf(path) -> bool:
    return any(getattr(entry, "key", None) == "layers" for entry in path)


def _map_layers(fn, tree):
    """Applies fn to every leaf under a 'layers' key (params and their optimizer moments)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if _is_layer_leaf(path) else x, tree, is_leaf=is_spec)


class Setup:
    """Everything derived once from the config and mesh: model layout, specs, optimizer.

    Two layouts of the state. Logical (checkpoints, initialisation): each layer leaf has a
    leading [num_layers] axis in model order. In memory with pipe > 1: [v, p, L/(p v), ...]
    (chunks, stages, layers of a chunk), a free reshape of the logical order in which
    rank r's dimension-1 slice holds virtual stages r, r + p, ... With pipe = 1 the two are
    the same.
    """

    def __init__(self, config: Config, mesh):
        self.config, self.mesh = config, mesh
        model, par = config.model, config.parallel
        self.pipelined = par.pipe > 1
        self.vocab = model.padded_vocab(par.tensor)
        self.arch = models.get(model)
        self.local_layout = Layout(self.vocab, par.tensor, TENSOR)
        logical = self.arch.logical_axes(model, self.vocab, par.tensor)
        # Checkpoints: layers split over pipe in contiguous blocks (stage r for v = 1).
        self.logical_param_specs = specs_from_logical(
            _map_layers(lambda names: P(*(("stages",) if self.pipelined else ("layers",)),
                                        *names[1:]), logical))
        self.param_specs = specs_from_logical(_map_layers(
            lambda names: P("chunks", "stages", *names), logical)) if self.pipelined \
            else self.logical_param_specs
        self.abstract_params = jax.eval_shape(
            lambda: self.to_stacked(self.arch.init_params(model, self.vocab, jax.random.key(0))))
        self.tx = optim.make_optimizer(config)
        self.schedule = optim.lr_schedule(config)
        self.state_specs = self._state_specs(self.param_specs, self.abstract_params)
        self.state_shardings = named(mesh, self.state_specs)
        self.logical_state_shardings = named(mesh, self._state_specs(
            self.logical_param_specs, jax.eval_shape(self.to_logical, self.abstract_params)))
        self.batch_sharding = NamedSharding(mesh, P(DATA))

    def _state_specs(self, param_specs, abstract_params):
        opt = self.config.optimizer
        return {
            "params": param_specs,
            "opt_state": optim.optimizer_specs(self.tx, abstract_params, param_specs,
                                               opt.zero1, self.config.parallel.data),
            "step": P(),
            "rng": P(),
            "loss_scale": optim.LossScale(P(), P()),
        }

    def to_stacked(self, tree):
        """Logical [L, ...] layer leaves -> the in-memory [v, p, L/(p v), ...] (a reshape)."""
        if not self.pipelined:
            return tree
        par = self.config.parallel
        return _map_layers(lambda x: x.reshape(par.chunks, par.pipe, -1, *x.shape[1:]), tree)

    def to_logical(self, tree):
        """The in-memory layer layout -> logical [L, ...] (a reshape)."""
        if not self.pipelined:
            return tree
        return _map_layers(lambda x: x.reshape(-1, *x.shape[3:]), tree)

    def _fresh_state(self, seed: int, dynamic: bool):
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
        dynamic = self.config.optimizer.loss_scale == "dynamic"
        return jax.jit(lambda: self._fresh_state(seed, dynamic),
                       out_shardings=self.state_shardings)()

    def abstract_state(self, logical: bool = False):
        """ShapeDtypeStructs with shardings (in-memory or logical layout): what a checkpoint
        restores into."""
        convert = self.to_logical if logical else (lambda state: state)
        shapes = jax.eval_shape(lambda: convert(self._fresh_state(0, False)))
        shardings = self.logical_state_shardings if logical else self.state_shardings
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)

    def state_to_logical(self, state):
        """The train state in the checkpoint layout (a resharding copy when pipelined)."""
        if not self.pipelined:
            return state
        return jax.jit(self.to_logical, out_shardings=self.logical_state_shardings)(state)

    def state_from_logical(self, state):
        """A restored logical state -> the in-memory layout and shardings."""
        if not self.pipelined:
            return state
        return jax.jit(self.to_stacked, out_shardings=self.state_shardings)(state)


def microbatch_grads(params, batch, key, loss_scale, *, setup: Setup, deterministic: bool):
    """Unpipelined local gradients: a scan over microbatches. Runs inside the shard_map.

    params: local shards, varying over data and pipe; batch [rows, s + 1] local rows.
    Returns (local gradient sums, local loss sum), both scaled to the global token mean.
    """
    config = setup.config
    micro = batch.reshape(config.parallel.microbatches, -1, batch.shape[-1])  # [m, b, s+1]
    norm = 1.0 / (config.train.global_batch * config.model.seq_len)

    def loss_fn(p, mb, k):
        loss = models.loss_sum(p, mb, k, config.model, setup.local_layout, deterministic) * norm
        return loss * loss_scale, loss

    def one(carry, xs):
        grads_acc, loss_acc = carry
        mb, index = xs
        grads, loss = jax.grad(loss_fn, has_aux=True)(params, mb, jax.random.fold_in(key, index))
        return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    loss0 = mark_varying(jnp.float32(0), (DATA, PIPE))  # like the model's loss
    (grads, loss), _ = lax.scan(one, (zeros, loss0), (micro, jnp.arange(micro.shape[0])))
    return grads, loss


def build_grads(setup: Setup, deterministic: bool):
    """shard_map'd (params, batch, rng, step, scale) -> (grads, loss), reduced once."""
    config = setup.config
    if config.parallel.pipe > 1:
        from jaxptd.pipeline.executor import pipeline_grads
        local_fn = partial(pipeline_grads, setup=setup, deterministic=deterministic)
    else:
        local_fn = partial(microbatch_grads, setup=setup, deterministic=deterministic)

    def local(params, batch, rng, step, scale):
        key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
        key = jax.random.fold_in(key, lax.axis_index(DATA))
        params = mark_varying(params, (DATA, PIPE))
        grads, loss = local_fn(params, batch, key, scale)
        return reduce_to(grads, setup.param_specs, (DATA, PIPE)), lax.psum(loss, (DATA, PIPE))

    return jax.shard_map(
        local, mesh=setup.mesh,
        in_specs=(setup.param_specs, P(DATA), P(), P(), P()),
        out_specs=(setup.param_specs, P()))


def build_train_step(setup: Setup):
    """The jitted step: (state, batch [global_batch, s + 1]) -> (state, metrics)."""
    config = setup.config
    dynamic = config.optimizer.loss_scale == "dynamic"
    grads_fn = build_grads(setup, deterministic=config.model.dropout == 0.0)

    def step_fn(state, batch):
        params, scale = state["params"], state["loss_scale"]
        grads, loss = grads_fn(params, batch, state["rng"], state["step"], scale.scale)
        grads = jax.tree.map(lambda g: g / scale.scale, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, opt_state = setup.tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        loss_scale = scale
        if dynamic:  # skip the update on overflow and adjust the scale
            finite = optim.all_finite(grads)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            new_params, opt_state = keep(new_params, params), keep(opt_state, state["opt_state"])
            loss_scale = scale.update(finite)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                     "rng": state["rng"], "loss_scale": loss_scale}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": setup.schedule(state["step"]),
                   "loss_scale": loss_scale.scale}
        return new_state, metrics

    return jax.jit(step_fn, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


def build_eval_step(setup: Setup):
    """The jitted validation loss: (params, batch) -> mean token loss (no dropout). With
    pipe > 1 the pipeline runs the schedule's forwards alone (no gradient program)."""
    config = setup.config
    if config.parallel.pipe > 1:
        from jaxptd.pipeline.executor import pipeline_loss

        def local_loss(params, batch):
            loss = pipeline_loss(mark_varying(params, (DATA, PIPE)), batch, setup=setup)
            return lax.psum(loss, (DATA, PIPE))
    else:
        tokens = config.train.global_batch * config.model.seq_len

        def local_loss(params, batch):
            loss = models.loss_sum(params, batch, jax.random.key(0), config.model,
                                setup.local_layout, True)
            return lax.psum(loss, DATA) / tokens

    eval_fn = jax.shard_map(local_loss, mesh=setup.mesh,
                            in_specs=(setup.param_specs, P(DATA)), out_specs=P())
    return jax.jit(eval_fn, in_shardings=(setup.state_shardings["params"],
                                          setup.batch_sharding))
