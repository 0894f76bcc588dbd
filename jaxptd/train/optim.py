"""Optimizer: AdamW with Megatron's recipe (or SGD), the LR schedule, mixed precision, loss
scaling.

Owns the optax chain (global-norm clipping, then AdamW with weight decay on matrices only,
or SGD with momentum, optimizer.name: the PyTorch FSDP post trained its 175B and 1T models
with SGD), the learning-rate schedule (linear warm-up, cosine decay to a minimum,
Megatron-LM 2019), the optimizer-state shardings (mirroring the parameters, or ZeRO-1: also
split over data), and dynamic loss scaling for float16. Master weights and optimizer state
are float32 whatever the compute dtype (model.dtype); the model casts weights at use.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxptd.config import Config
from jaxptd.model import weight_decay_mask
from jaxptd.parallel.sharding import is_spec


def lr_schedule(config: Config) -> optax.Schedule:
    """Linear warm-up from 0 to optimizer.lr, then cosine decay to optimizer.min_lr."""
    opt = config.optimizer
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=opt.warmup_steps,
        decay_steps=max(config.decay_length, opt.warmup_steps + 1), end_value=opt.min_lr)


def make_optimizer(config: Config, norm=optax.tree.norm) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW (decoupled decay) or SGD (the decay added to the
    gradient before the momentum, as torch.optim.SGD's weight_decay), neither decaying
    biases and LayerNorm. `norm`: the gradient tree's global norm (the pipelined layout's
    counts a tied embedding once)."""
    opt = config.optimizer
    if opt.name == "sgd":
        update = optax.chain(
            optax.add_decayed_weights(opt.weight_decay, mask=weight_decay_mask),
            optax.sgd(lr_schedule(config), momentum=opt.momentum or None))
    else:
        update = optax.adamw(lr_schedule(config), b1=opt.beta1, b2=opt.beta2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=weight_decay_mask)
    return optax.chain(
        clip_by_global_norm(opt.clip_norm, norm) if opt.clip_norm else optax.identity(),
        update)


def clip_by_global_norm(max_norm: float, norm) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (the same arithmetic) with the norm a function of the tree."""
    def update(updates, state, params=None):
        g_norm = norm(updates)
        return jax.tree.map(lambda t: jnp.where(g_norm < max_norm, t, (
            t / g_norm.astype(t.dtype)) * max_norm), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer_specs(tx, abstract_params, moment_specs):
    """PartitionSpecs for the optimizer state: each moment as `moment_specs` says (like its
    parameter, or with ZeRO-1 also split over the data replicas); counters replicated."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    return optax.tree_map_params(
        tx, lambda _, spec: spec, abstract_state, moment_specs,
        transform_non_params=lambda _: P(), is_leaf=is_spec)


class LossScale(NamedTuple):
    """Dynamic loss scale for float16: halve on overflow, double after `period` good steps."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar

    @staticmethod
    def create(enabled: bool) -> "LossScale":
        return LossScale(jnp.float32(2.0**15 if enabled else 1.0), jnp.int32(0))

    def update(self, finite, period: int = 2000) -> "LossScale":
        grow = finite & (self.good_steps + 1 >= period)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2, self.scale),
                          jnp.maximum(self.scale / 2, 1.0))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return LossScale(scale, good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
