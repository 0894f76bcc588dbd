"""The optimizer step of offloaded state (offload.optimizer): streamed through the device,
one layer at a time.

Owns the update when the float32 masters and the optimizer's moments live in host memory
(pinned_host) for the whole step; unpipelined so do the layers' gradients, which the
backward sends there as each layer's is done (jaxptd/train/step.py: Policy.streams). The update
goes over units, the ends (embedding, positions, final norm) and then each layer (a slice
of the stacked layer axis: [L] -> [1], pipelined [v, p, L/(p v)] -> [v, p, 1]): it brings
the unit's masters, moments and gradients to the device, applies the optax chain of
jaxptd/train/optim.py to them there, and writes the new masters and moments back into the host
arrays in place (the state is donated). A first pass over the gradients gives what every
unit needs first: the global norm (clipping) and whether all are finite (dynamic loss
scaling skips the step). The device holds one unit's state and its update at a time, not
the model's: 2 x (4 + 4 + 4 x moments) bytes a parameter of one layer.

The arithmetic is the device-resident step's, unit by unit: the same division by the loss
scale, the same elementwise chain (a unit is the whole parameter tree with the leaves of
the other units empty, so every transformation, its weight-decay mask and its counters
see the structure they were built for), and the clipping with the same norm, summed by
leaf then over layers (an fp32 rounding apart).

Why streamed on the device, not run on the host (jax.experimental.compute_on('device_host'),
which PyTorch FSDP's CPU offload corresponds to): the update stays the XLA:GPU program the
device-resident step runs, at HBM bandwidth; host computations inside an XLA:GPU program
are not a documented JAX feature for GPUs (compute_on compiles for an H100 without one,
but we could not run it), while moving slices between pinned_host and the device in a
loop is XLA's host-offloading pattern (activation offloading uses it); and a node's host
memory bandwidth is shared by its eight GPUs and their offloaded layer inputs. The cost is
PCIe traffic: each step reads the gradients twice and the masters and moments once, and
writes the masters and moments back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxptd.model import fp8
from jaxptd.train import optim

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host


def _to_device(x):
    return jax.device_put(x, DEVICE)


def _put_like(x, like):
    """x placed in the memory `like` lives in (host or device)."""
    return jax.device_put(x, jax.typeof(like).memory_space)


def _empty(x, axis: int):
    """x with no elements along `axis`, on the device: a leaf outside the unit updated."""
    return _to_device(lax.slice_in_dim(x, 0, 0, axis=axis))


class _Units:
    """Which leaves of the parameter tree and of the optimizer state are the layers', and
    the views of one unit (StateLayout.kind: 'layer' leaves are stacked on `axis`)."""

    def __init__(self, layout: StateLayout, opt_state):
        self.axis = layout.stacked - 1  # the layer axis of a layer leaf in memory
        self.tx = layout.tx
        abstract = layout.abstract_params
        self.params = jax.tree_util.tree_map_with_path(
            lambda path, _: layout.kind(path) == "layer", abstract)
        self.state = optax.tree_map_params(self.tx, lambda _, is_layer: is_layer, opt_state,
                                           self.params, transform_non_params=lambda _: None)
        self.layers = next(x.shape[self.axis] for x, is_layer in zip(
            jax.tree.leaves(abstract), jax.tree.leaves(self.params)) if is_layer)

    @staticmethod
    def view(tree, mask, layer, ends):
        """tree (params-shaped, or optimizer-state-shaped with the mask self.state) with
        layer(x) at its layer leaves, ends(x) at the others and counters on the device (a
        host counter would make XLA run the arithmetic it reaches, the whole update, on
        the host)."""
        return jax.tree.map(lambda x, m: _to_device(x) if m is None else layer(x) if m
                            else ends(x), tree, mask)

    @staticmethod
    def merge(stored, new, mask, place_layer=None):
        """stored with new's layer leaves placed by place_layer(stored, new) (the others
        kept), or without it new's other leaves and counters (the layers kept), each put
        where the stored leaf lives."""
        def one(x, n, m):
            if m:
                return place_layer(x, n) if place_layer else x
            return x if place_layer else _put_like(n, x)
        return jax.tree.map(one, stored, new, mask)

    def layer(self, tree, mask, i):
        """Layer i's unit of a stored tree, on the device (the ends left empty)."""
        return self.view(tree, mask, lambda x: _to_device(
            lax.dynamic_slice_in_dim(x, i, 1, self.axis)), lambda x: _empty(x, 0))

    def ends(self, tree, mask):
        """The ends' unit of a stored tree, on the device (the layers left empty)."""
        return self.view(tree, mask, lambda x: _empty(x, self.axis), _to_device)


def norm_and_finite(layout: StateLayout, units: _Units, grads, scale):
    """(global norm of grads / scale, whether every element is finite), the gradients
    streamed: each layer leaf's sum of squares accumulated layer by layer, then the
    leaves' sums added in the tree's order (StateLayout.grad_norm's)."""
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    is_layer = jax.tree.leaves(units.params)
    layer_leaves = [g for (_, g), m in zip(flat, is_layer) if m]

    def one_layer(i, carry):
        sums, finite = carry
        parts = [_to_device(lax.dynamic_slice_in_dim(g, i, 1, units.axis)) / scale
                 for g in layer_leaves]
        return ([s + jnp.sum(jnp.square(p)) for s, p in zip(sums, parts)],
                finite & optim.all_finite(parts))
    sums, finite = lax.fori_loop(0, units.layers, one_layer,
                                 ([jnp.float32(0)] * len(layer_leaves), jnp.bool_(True)))
    sums, total = iter(sums), []
    for (path, g), m in zip(flat, is_layer):
        if m:
            total.append(next(sums))
        else:
            g = _to_device(g) / scale
            total.append(layout.square_sum(path, g))
            finite = finite & optim.all_finite([g])
    return jnp.sqrt(sum(total)), finite


def streamed_update(layout: StateLayout, params, opt_state, grads, scale, dynamic: bool):
    """The optimizer step of stored (host) params and opt_state with grads (host, or on
    the device) scaled by `scale`: (new params, new opt_state, grad norm, all finite),
    the new state in the memory the old one was in (module docstring)."""
    units = _Units(layout, opt_state)
    norm, finite = norm_and_finite(layout, units, grads, scale)
    tx = optim.make_optimizer(layout.config, lambda _: norm)

    def update(p, g, s):  # one unit, on the device (fp8: as step._update)
        g, amaxes = fp8.observed(g)
        updates, new_s = tx.update(jax.tree.map(lambda x: x / scale, g), s, p)
        new_p = fp8.advance(optax.apply_updates(p, updates), p, amaxes)
        if dynamic:  # a step that overflowed leaves the state as it was
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            new_p, new_s = keep(new_p, p), keep(new_s, s)
        return new_p, new_s

    ends_p, ends_s = update(units.ends(params, units.params), units.ends(grads, units.params),
                            units.ends(opt_state, units.state))

    def one_layer(i, stored):  # layer i's unit read, updated on the device, written back
        # (read here, not carried from the iteration before: a carried unit's copy from
        # the host is one XLA's GPU compiler keeps in host memory, the update then run on
        # the host, or with offloaded layer inputs too, fails to lay out)
        new_p, new_s = update(units.layer(stored[0], units.params, i),
                              units.layer(grads, units.params, i),
                              units.layer(stored[1], units.state, i))
        write = lambda x, n: lax.dynamic_update_slice_in_dim(x, _put_like(n, x), i, units.axis)
        return (units.merge(stored[0], new_p, units.params, write),
                units.merge(stored[1], new_s, units.state, write))
    params, opt_state = lax.fori_loop(0, units.layers, one_layer, (params, opt_state))
    return (units.merge(params, ends_p, units.params),
            units.merge(opt_state, ends_s, units.state), norm, finite)
