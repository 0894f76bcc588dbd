"""The models: the shared pieces (tensor.py: a tensor rank's view of parameters, matmuls
and collectives; products.py: the products those matmuls hand a weight to (float32 weight
gradients, FP8, FSDP gathered); layers.py: the layer's Flax modules; vocab.py: the vocabulary-parallel
embedding and loss; stack.py: the layer stack's element, its initialisation and decoding;
moe.py and moe_dispatch.py: the mixture of experts), one module per architecture (gpt.py,
llama.py, bert.py, each with its `ARCH` record: the interface of jaxptd/arch/interface.py),
and what every part outside model/ uses, so that nothing else branches on the
architecture:

    registry.py     `get(cfg)` (model.arch's record, through the registry jaxptd/arch), the
                    batch rows and reserved ids it declares
    tree.py         the parameter tree's parts: the ends and who reads them, a stack's
                    layers, the weight-decay rule
    apply.py        the layer stack in training (`apply_layers`, model.remat's policies)
                    and the whole model's loss (`loss_terms`, `loss_sum`, `forward_logits`)
    ordering.py     the order of a stack's backward on a GPU (`weight_gradients_first`,
                    `reduced_ahead`, `waiting_attention_out`)
    zero_bubble.py  a zero-bubble backward's taps and W (`perturbations`, `split_dense`,
                    `dense_weight_grads`)

This package re-exports their names: `from jaxptd import model as models; models.get`.
"""
from jaxptd.model.apply import (LAYER_INPUT, MINIMAL, MINIMAL_MLP, OFFLOAD_LAYER_INPUTS,
                                apply_layer, apply_layers, forward_logits, layer_function,
                                loss_sum, loss_terms, scans_layers)
from jaxptd.model.ordering import (AHEAD, reduced_ahead, waiting_attention_out,
                                   weight_gradients_first, weights_first)
from jaxptd.model.registry import batch_width, get, make_batch, reserved_ids
from jaxptd.model.tensor import DENSE
from jaxptd.model.tree import ends, ends_readers, per_layer, stacked, weight_decay_mask
from jaxptd.model.zero_bubble import (dense_weight_grads, layer_dense_weight_grads,
                                      merge_dense, perturbations, split_dense)

__all__ = [
    "AHEAD", "DENSE", "LAYER_INPUT", "MINIMAL", "MINIMAL_MLP", "OFFLOAD_LAYER_INPUTS",
    "apply_layer", "apply_layers", "batch_width", "dense_weight_grads", "ends",
    "ends_readers", "forward_logits", "get", "layer_dense_weight_grads", "layer_function",
    "loss_sum", "loss_terms", "make_batch", "merge_dense", "per_layer", "perturbations",
    "reduced_ahead", "reserved_ids", "scans_layers", "split_dense", "stacked",
    "waiting_attention_out", "weight_decay_mask", "weight_gradients_first", "weights_first",
]
