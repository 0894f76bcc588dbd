"""The training step: one jitted SPMD program over the (data, fsdp, pipe, tensor) mesh.

Owns the step's parts (`Setup`, `Policy`) and its programs. The step has two parts:

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
   used: each matmul's weight by `dense` for that matmul alone (the PyTorch FSDP runs' unit, one
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
   its gradient goes back to host memory as soon as it is reduced (Policy.streams);
   pipelined, the masters are brought whole. The update then streams through the device
   one layer at a time (jaxptd/train/offload.py).

The eval step (validation loss) is the same fully manual shard_map without gradients: a
forward over the local rows, or with pipe > 1 the executor's forward-only pipeline.

Both report the mean token loss over the targets that take loss, and train on its
gradient: every loss is a sum over tokens times `loss_norm`, 1 / (global batch x seq_len),
or with packed rows 1 / the batch's counted targets (the target after a document end takes
none), a count made once a step inside the shard_map; the mixture of experts' balance
terms stay a mean over every token (Policy.token_norm).

The state is a dict {params, opt_state, step, rng, loss_scale} passed in and returned; its
layouts and shardings are jaxptd/train/state.py's, the gathers and reductions of its parameters'
way through the shard_map jaxptd/train/reduction.py's. This module owns the step's policy and the
step's programs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxptd import model as models
from jaxptd.train import offload, optim
from jaxptd.runtime import target
from jaxptd.config import Config, ConfigError
from jaxptd.parallel.mesh import BATCH, CONTEXT, EXPERT, FSDP, PIPE, TENSOR, TOKENS
from jaxptd.model import fp8, moe, sequence
from jaxptd.model.tensor import Layout
from jaxptd.pipeline.context import Context
from jaxptd.pipeline.executor import pipeline_grads, pipeline_loss
from jaxptd.pipeline.scans import head_pieces, headless_stretch, round_form
from jaxptd.plan.program import recomputation
from jaxptd.train.reduction import REDUCED, Reduction, compose, fsdp_gathers
from jaxptd.parallel.sharding import regather
from jaxptd.parallel.varying import mark_varying, zeros_as
from jaxptd.train.state import StateLayout


@dataclass(frozen=True)
class Policy:
    """The step's policy, decided once from the config: what the step does, apart from
    where things are (StateLayout) and what a layer computes (the model)."""
    microbatches: int  # of the local rows, run one after another
    deterministic: bool  # no dropout (model.dropout = 0)
    dynamic_loss_scale: bool  # float16: optimizer.loss_scale = dynamic
    overlaps_grad_reduce: bool  # unpipelined: reduced in the last microbatch's backward
    reduces_chunks_early: bool  # pipelined: each chunk's layers when the schedule is done
    offload_optimizer: bool  # the masters and moments in host memory, a streamed update
    streams: bool  # offload.optimizer unpipelined: each layer's masters fetched where used
    # 1 / (global batch x seq_len): a mean over the batch's tokens, the balance terms'
    # (every token is routed) and the loss's unless packed (`loss_norm`)
    token_norm: float

    @classmethod
    def of(cls, config: Config) -> "Policy":
        return cls(
            microbatches=config.parallel.microbatches,
            deterministic=config.model.dropout == 0.0,
            dynamic_loss_scale=config.optimizer.loss_scale == "dynamic",
            overlaps_grad_reduce=config.overlaps_grad_reduce,
            reduces_chunks_early=config.reduces_chunks_early,
            offload_optimizer=config.offload.optimizer,
            streams=config.offload.optimizer and config.parallel.pipe == 1,
            token_norm=1.0 / (config.train.global_batch * config.model.seq_len))


class Setup:
    """The step's parts, each decided once from the config and mesh by its owner: the
    hardware it compiles for (`target`), the model family (`arch`), the state's layouts
    and shardings (`state_layout`, jaxptd/train/state.py), the model's view of one device
    (`local_layout`), the step's policy (`policy`) and where a batch lives."""

    def __init__(self, config: Config, mesh, for_target: target.Target | None = None):
        """for_target: the GPU a step on CPU devices is lowered for, where those devices
        stand in for it (jaxptd/plan/stand_in.py); None: the mesh's own devices'."""
        self.config, self.mesh = config, mesh
        model, par = config.model, config.parallel
        try:  # the hardware the step is for: its GPU code paths and its numbers
            self.target = for_target or target.resolve(config.runtime.target,
                                                       mesh.devices.flat)
        except target.TargetError as e:
            raise ConfigError(str(e)) from None
        if model.fp8 != "none" and self.target.platform == "gpu" and self.target.chip and \
                not self.target.peak_fp8:
            raise ConfigError(f"model.fp8={model.fp8}: {self.target.name} GPUs have no FP8 "
                              "tensor cores (Hopper and newer: h100, h200); set model.fp8=none")
        self.arch = models.get(model)
        self.vocab = model.padded_vocab(par.tensor)
        self.state_layout = StateLayout(config, mesh, self.arch, self.vocab)
        self.local_layout = Layout(self.vocab, par.tensor, TENSOR, par.sequence_parallel,
                                   config.offload.activations, self.target.platform,
                                   fsdp=self.state_layout.dense_shards(), fsdp_axis=FSDP,
                                   fsdp_dtype=config.optimizer.grad_reduce_dtype,
                                   context=par.context, context_axis=CONTEXT,
                                   context_attention=par.context_attention,
                                   expert=par.expert, expert_axis=EXPERT, fp8=model.fp8,
                                   fp8_margin=model.fp8_margin)
        self.policy = Policy.of(config)
        self.lr_schedule = optim.lr_schedule(config)
        self.batch_sharding = NamedSharding(mesh, P(BATCH))

    def compiler_options(self) -> dict | None:
        """The XLA options the step compiles with on its target (jaxptd/runtime/target.py)."""
        return target.compiler_options(self.target, pipelined=self.config.parallel.pipe > 1)

    def compile(self, lowered):
        """The step's compiled program, with `compiler_options` (those this XLA knows)."""
        return target.compile_lowered(lowered, self.compiler_options())

    def gathers(self):
        """FSDP's (ends, layer) gathers inside the shard_map (reduction.fsdp_gathers)."""
        return fsdp_gathers(self.state_layout, self.local_layout)


def loss_norm(rows, setup: Setup):
    """The loss's normalisation, inside the shard_map: 1 / the targets of the global batch
    that take loss, from this data rank's rows [r, s + 1]. Unpacked all B s do (Policy
    .token_norm, static); packed rows (model.document_end) leave out the target after each
    document end, and the loss is the mean over the rest, as Megatron's (eod_mask_loss
    divides by the loss mask's sum) and transformers' (the labels not -100): a count of
    the local rows summed over the data ranks (the context, pipe and tensor ranks hold the
    same whole rows), so that every layout has the single device's mean. At least 1: a
    batch with no counted target has loss 0, not NaN (Megatron clamps it so too)."""
    model = setup.config.model
    if not sequence.packed(model):
        return setup.policy.token_norm
    count = lax.psum(sequence.counted_targets(rows, model), BATCH)  # [] int32
    return 1.0 / jnp.maximum(count, 1).astype(jnp.float32)


def _microbatch_loss(setup: Setup, deterministic: bool, loss_scale, norm):
    """One unpipelined microbatch's loss function: (params, rows [b, s + 1], key, hooks)
    -> (objective x loss_scale, (loss, statistics)), the loss sum scaled by `norm`
    (loss_norm), the balance terms by Policy.token_norm; hooks: the last microbatch's
    reduction hooks (config.overlaps_grad_reduce), else None."""
    config, policy = setup.config, setup.policy
    gather_ends, gather_layer = setup.gathers()

    def loss_fn(p, mb, k, hooks=None):
        ends_fn = compose(gather_ends, hooks and hooks[0], policy.streams)
        layer_fn = compose(gather_layer, hooks and hooks[1], policy.streams)
        loss, stats = models.loss_terms(
            p, mb, k, config.model, setup.local_layout, deterministic, prepare_ends=ends_fn,
            prepare=layer_fn, extra=hooks and hooks[2],
            keep=regather if gather_layer or policy.streams else None,
            reduced=hooks is not None and gather_layer is None)
        loss = loss * norm
        objective = loss + moe.objective(stats, config.model) * policy.token_norm
        return objective * loss_scale, (loss, stats)
    return loss_fn


def microbatch_grads(params, batch, key, loss_scale, norm, *, setup: Setup,
                     deterministic: bool):
    """Unpipelined gradients: a scan over the microbatches, reduced after it, or (config
    .overlaps_grad_reduce) over those before the last, whose local sums the last one's
    backward adds in and reduces layer by layer (reduction.Reduction). Runs inside the
    shard_map.

    params: local shards, invariant over data; batch [rows, s + 1] local rows; norm:
    loss_norm's. Returns (reduced gradients, local loss sum, statistics), the gradients
    and loss scaled by `norm` (the global mean's part).
    """
    micro = batch.reshape(setup.policy.microbatches, -1, batch.shape[-1])  # [m, b, s+1]
    reduction = Reduction(setup.state_layout, setup.policy.streams)
    loss_fn = _microbatch_loss(setup, deterministic, loss_scale, norm)
    varying = fp8.spread(mark_varying(params, REDUCED), (TENSOR,))
    loss0 = mark_varying(jnp.float32(0), REDUCED)  # like the model's loss

    def grads_of(index):
        return jax.grad(loss_fn, has_aux=True)(varying, micro[index],
                                               jax.random.fold_in(key, index))

    def one(carry, index):  # (amax histories' entries: their maximum, fp8.accumulate)
        return fp8.accumulate(carry, grads_of(index)), None

    def sums(count):
        """(local gradient sums, (loss sum, statistics' sums)) of the first `count`
        microbatches: a scan from zeros, or with Policy.streams from the first one's
        gradients (the sums live in host memory, where zeros would be made on the device
        and moved)."""
        if not setup.policy.streams:
            stats0 = None if not setup.config.model.moe else zeros_as(  # (a trace's shapes)
                jax.eval_shape(lambda: grads_of(0)[1][1]))
            zeros = (jax.tree.map(jnp.zeros_like, varying), (loss0, stats0))
            return lax.scan(one, zeros, jnp.arange(count))[0]
        first = grads_of(0)
        return lax.scan(one, first, jnp.arange(1, count))[0] if count > 1 else first

    m = micro.shape[0]
    if not setup.policy.overlaps_grad_reduce:  # every microbatch in the scan, reduced after
        grads, (loss, stats) = sums(m)
        return reduction.after(grads), loss, stats
    acc, loss, stats = None, loss0, None  # (one microbatch: no loop at all, not its buffers)
    if m > 1:
        acc, (loss, stats) = sums(m - 1)
    grads, (last, last_stats) = jax.grad(loss_fn, has_aux=True)(
        reduction.scattered_varying(params), micro[-1], jax.random.fold_in(key, m - 1),
        reduction.hooks(acc))
    stats = last_stats if stats is None else jax.tree.map(jnp.add, stats, last_stats)
    return reduction.keep_parts(grads), loss + last, stats


def pipeline_context(setup: Setup) -> Context:
    """What the pipeline executor reads (pipeline.context.Context), from the config and
    Setup: the schedule, the stash, the round form for the target, the model's functions,
    the local layout and FSDP's gathers."""
    par = setup.config.parallel
    gather_ends, gather_layer = setup.gathers()
    form = round_form(setup.config, setup.target.platform)
    return Context(
        schedule=par.schedule, pipe=par.pipe, chunks=par.chunks,
        microbatches=par.microbatches, stash=par.stash, round_form=form,
        # PTD-P's scatter/gather splits a message over tensor; with sequence parallelism
        # the activations are already split over the sequence
        message_split=1 if setup.local_layout.split_sequence else par.tensor,
        model=setup.config.model, layout=setup.local_layout, arch=setup.arch,
        token_norm=setup.policy.token_norm,
        head_pieces=head_pieces(setup.config, form),
        headless=headless_stretch(setup.config, recomputation(setup.config)),
        gather_ends=gather_ends, gather_layer=gather_layer)


def build_grads(setup: Setup, deterministic: bool):
    """shard_map'd (params, batch, rng, step, scale) -> (grads, loss, stats): the batch's
    mean token loss (over the targets that take loss: loss_norm) and its gradients times
    `scale`, reduced over data (ZeRO-1: scattered into the optimizer's shards); stats: the
    mixture of experts' per-layer statistics summed over the global batch, laid out as the
    layers (None for a dense model)."""
    config = setup.config
    pipelined = config.parallel.pipe > 1
    if pipelined:
        context = pipeline_context(setup)
        reduction = Reduction(setup.state_layout, setup.policy.streams)

        early = setup.policy.reduces_chunks_early
        by_chunk = partial(reduction.after, part=lambda tree: tree["layers"])

        def local_fn(params, batch, key, scale, norm):
            grads, loss, stats = pipeline_grads(
                fp8.spread(mark_varying(params, REDUCED), (TENSOR,)), batch, key, scale,
                norm, context=context,
                deterministic=deterministic, reduce_chunk=by_chunk if early else None)
            if not early:
                return reduction.after(grads), loss, stats
            return {**reduction.after(models.ends(grads), models.ends),  # layers: reduced
                    "layers": grads["layers"]}, loss, stats
    else:
        local_fn = partial(microbatch_grads, setup=setup, deterministic=deterministic)

    def local(params, batch, rng, step, scale):
        key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
        key = jax.random.fold_in(key, lax.axis_index(BATCH))  # (context: model/layers.py)
        grads, loss, stats = local_fn(params, batch, key, scale, loss_norm(batch, setup))
        # pipelined, each rank's statistics are its own layers' [v, 1, Lc, ...]
        stats = jax.tree.map(lambda v: lax.psum(v, TOKENS if pipelined else REDUCED), stats)
        return grads, lax.psum(loss, REDUCED), stats

    stats_spec = P(None, PIPE) if pipelined else P()
    return jax.shard_map(
        local, mesh=setup.mesh,
        in_specs=(setup.state_layout.param_specs, P(BATCH), P(), P(), P()),
        out_specs=(setup.state_layout.grads_specs, P(), stats_spec))


def build_train_step(setup: Setup):
    """The jitted step: (state, batch [global_batch, s + 1]) -> (state, metrics); metrics
    'moe': the mixture of experts' statistics (build_grads), absent for a dense model."""
    policy, layout = setup.policy, setup.state_layout
    dynamic = policy.dynamic_loss_scale
    grads_fn = build_grads(setup, deterministic=policy.deterministic)
    on_device = layout.device_state_shardings
    model = setup.config.model

    def step_fn(state, batch):
        scale = state["loss_scale"]
        # offload.optimizer pipelined: the executor reads the masters on the device
        params = state["params"] if policy.streams else jax.device_put(
            state["params"], on_device["params"])
        grads, loss, stats = grads_fn(params, batch, state["rng"], state["step"],
                                      scale.scale)
        if policy.offload_optimizer:  # one layer's state on the device at a time
            new_params, opt_state, grad_norm, finite = offload.streamed_update(
                layout, state["params"], state["opt_state"], grads, scale.scale, dynamic)
        else:
            new_params, opt_state, grad_norm, finite = _update(
                layout, params, state["opt_state"], grads, scale.scale, dynamic)
        if model.moe_bias_rate:
            new_params = moe.update_bias(new_params, stats["load"], finite, model)
        loss_scale = scale.update(finite) if dynamic else scale
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                     "rng": state["rng"], "loss_scale": loss_scale}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": setup.lr_schedule(state["step"]),
                   "loss_scale": loss_scale.scale}
        if stats is not None:
            metrics["moe"] = stats
        return new_state, metrics

    return jax.jit(step_fn, in_shardings=(layout.state_shardings, setup.batch_sharding),
                   out_shardings=(layout.state_shardings, None), donate_argnums=0)


def _update(layout: StateLayout, params, opt_state, grads, scale, dynamic: bool):
    """The optimizer step on the device: (new params, new opt_state, gradient norm, all
    gradients finite) from grads scaled by `scale`; with dynamic loss scaling a step whose
    gradients overflowed leaves params and opt_state as they were. model.fp8=delayed's
    amax histories take this step's amaxes (their gradients' entries), not an update."""
    grads, amaxes = fp8.observed(grads)
    grads = jax.tree.map(lambda g: g / scale, grads)
    updates, new_opt = layout.tx.update(grads, opt_state, params)
    new_params = fp8.advance(optax.apply_updates(params, updates), params, amaxes)
    finite = optim.all_finite(grads) if dynamic else jnp.bool_(True)
    if dynamic:
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
    return new_params, new_opt, layout.grad_norm(grads), finite


def build_eval_step(setup: Setup):
    """The jitted validation loss: (params, batch) -> the mean token loss over the targets
    that take loss (loss_norm: packed rows' as training's; no dropout, no mixture-of-experts
    balance terms). With pipe > 1 the pipeline runs the schedule's forwards alone (no
    gradient program)."""
    config, policy, layout = setup.config, setup.policy, setup.state_layout
    gather_ends, gather_layer = setup.gathers()
    if config.parallel.pipe > 1:
        context = pipeline_context(setup)

        def local_loss(params, batch):
            loss = pipeline_loss(mark_varying(params, REDUCED), batch,
                                 loss_norm(batch, setup), context=context)
            return lax.psum(loss, REDUCED)
    else:
        def local_loss(params, batch):
            loss, _ = models.loss_terms(
                params, batch, jax.random.key(0), config.model, setup.local_layout, True,
                prepare_ends=compose(gather_ends, None, policy.streams),
                prepare=compose(gather_layer, None, policy.streams))
            # (the loss varies over data and fsdp only; pipe is 1 here)
            return lax.psum(mark_varying(loss, REDUCED), REDUCED) * loss_norm(batch, setup)

    eval_fn = jax.shard_map(local_loss, mesh=setup.mesh,
                            in_specs=(layout.param_specs, P(BATCH)), out_specs=P())
    return jax.jit(lambda params, batch: eval_fn(params if policy.streams else jax.device_put(
        params, layout.device_state_shardings["params"]), batch),
        in_shardings=(layout.state_shardings["params"], setup.batch_sharding))
