"""What a zero-bubble schedule's split backward needs of a layer stack (pipeline/training.py
runs it): B's taps (`perturbations`: zeros added to every dense() output, so their
gradient is the output gradient), a layer's dense() weights apart from the rest
(`split_dense`: W's and B's parameters), and W itself (`dense_weight_grads`: the weights'
gradients from the taped inputs and output gradients, no forward).
"""
from __future__ import annotations

import jax
from flax import traverse_util
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model.registry import get
from jaxptd.model.fp8 import HISTORY
from jaxptd.model.tensor import DENSE, ENTERED, PERTURBATIONS, Layout, enter_tensor, matmul
from jaxptd.parallel.varying import zeros_as


def perturbations(layers, x, cfg: ModelConfig, layout: Layout, prepare=None):
    """Zeros shaped and typed (varying manual axes included) like every dense() output of
    the stack, [n, ...]: what `apply_layers` takes to tape a backward. Traces nothing."""
    layer = get(cfg).block(cfg, layout)

    def one_layer(x, params):
        params = params if prepare is None else prepare(params, None)
        y, state = layer.apply({"params": params}, x, True, None, mutable=[PERTURBATIONS])
        return y, state[PERTURBATIONS]

    return zeros_as(jax.eval_shape(lambda: lax.scan(one_layer, x, layers)[1]))


def split_dense(layers) -> tuple[dict, dict]:
    """A layer tree -> (its dense() weights, everything else): what W computes the
    gradients of, and what B does."""
    flat = traverse_util.flatten_dict(layers)
    dense = {k: v for k, v in flat.items() if k[-1] in DENSE}
    rest = {k: v for k, v in flat.items() if k[-1] not in DENSE}
    return traverse_util.unflatten_dict(dense), traverse_util.unflatten_dict(rest)


def merge_dense(dense: dict, rest: dict) -> dict:
    """The inverse of split_dense."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(dense),
                                         **traverse_util.flatten_dict(rest)})


def dense_weight_grads(dense, inputs, output_grads, layout: Layout, prepare=None,
                       rest=None):
    """Gradients of a stack's dense() weights [n, ...] from the input and the output gradient
    of each of their matmuls ([n, ...] trees with the weights' paths): a zero-bubble W, no
    forward; `layer_dense_weight_grads` of each layer (rest: the stack's other leaves)."""
    return jax.vmap(lambda w, x, g, r: layer_dense_weight_grads(w, x, g, layout, prepare, r))(
        dense, inputs, output_grads, rest)


def layer_dense_weight_grads(dense, inputs, output_grads, layout: Layout, prepare=None,
                             rest=None):
    """Gradients of one layer's dense() weights from the input and the output gradient of
    each of their matmuls (trees with the weights' paths). Each is the transpose of its
    matmul in the weight as the layer uses it: `prepare`d as apply_layers prepares it
    (FSDP's layer gather), then as dense() multiplies it (tensor.matmul: cast, and an FSDP
    shard gathered for it alone); the gathers' transposes reduce-scatter the gradient into
    the shard. XLA drops the matmul's unused forward. The inputs of tensor.ENTERED matmuls
    are recorded before f (under the name ENTERED gives) and enter the tensor region again
    here (sequence parallelism: all-gathered). With model.fp8=delayed each takes its amax
    history from `rest` (the layer's other leaves): the scales B used; B's backward, which
    differentiates the histories, returned their amaxes."""
    flat_inputs = traverse_util.flatten_dict(inputs)
    flat_grads = traverse_util.flatten_dict(output_grads)
    flat_rest = traverse_util.flatten_dict(rest) if rest else {}

    def one(path, w):  # w: float32 master weight (or shard) of one dense name
        product = matmul(path[-1], layout)
        if path[-1] in ENTERED:
            x = enter_tensor(flat_inputs[(*path[:-1], ENTERED[path[-1]])], layout)
        else:
            x = flat_inputs[path]

        history = flat_rest.get((*path[:-1], path[-1] + HISTORY))

        def use(v):
            if prepare is not None:
                v = traverse_util.flatten_dict(
                    prepare(traverse_util.unflatten_dict({path: v}), None))[path]
            return product(x, v, history)
        return jax.vjp(use, w)[1](flat_grads[path])[0]

    flat = traverse_util.flatten_dict(dense)
    with jax.named_scope("Block"):  # a layer's work, as the static cost report counts it
        return traverse_util.unflatten_dict({path: one(path, w) for path, w in flat.items()})
