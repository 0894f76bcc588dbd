"""The GPT model (the papers' GPT-2-shaped decoder) as pure functions over a parameter tree,
ready to be cut into stages.

Parameter tree (global shapes; L = num_layers, V = padded vocabulary):

    embed/wte [V, h], embed/wpe [seq, h]
    layers/{ln1, attn, ln2, mlp}/...  each with a leading [L] axis (model order)
    final_norm/{scale, bias} [h]

Learned positions, LayerNorm, GeLU MLP, biases, and the tied embedding as the output
layer. `ARCH` gathers the functions as the architecture interface
(jaxptd/arch/interface.py; config rules and Hugging Face names: jaxptd/arch/gpt.py);
`Layout` (tensor.py) says how they see the parameters. The model never sees a mesh.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax

from jaxptd.arch.interface import Architecture, Decoder
from jaxptd.config import ModelConfig
from jaxptd.model import stack
from jaxptd.model.layers import MLP, Block, layer_norm
from jaxptd.model.moe import MoE, mlp_flops
from jaxptd.model.tensor import Layout, enter_tensor
from jaxptd.model.vocab import Embed


def block(cfg: ModelConfig, layout: Layout) -> nn.Module:
    """The layer stack's element (stack.block; applied by jaxptd.model.apply_layers): a
    layer, with model.moe_experts a mixture of GeLU experts (model/moe.py) as its MLP, in
    every model.moe_every-th layer."""
    return stack.block(cfg, layout, Block, functools.partial(MoE, shared=MLP, gated=False))


def _embed(cfg: ModelConfig, layout: Layout) -> Embed:
    return Embed(cfg, layout, positions=cfg.seq_len)


def _boxed_init(cfg: ModelConfig, vocab: int, key):
    """Global parameters as Flax `Partitioned` boxes (values plus logical names)."""
    return stack.boxed_init(cfg, vocab, key, block, {"embed": (_embed, True)},
                            {"final_norm": layer_norm(cfg)})


def init_params(cfg: ModelConfig, vocab: int, key):
    """Global float32 parameters (N(0, 0.02); residual outputs scaled by 1/sqrt(2L))."""
    return nn.unbox(_boxed_init(cfg, vocab, key))


def logical_axes(cfg: ModelConfig, vocab: int, tensor: int = 1):
    """A tree (like the parameters) of PartitionSpecs holding logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(cfg, vocab, jax.random.key(0))))


def logits(ends, x, cfg: ModelConfig, layout: Layout):
    """Final LayerNorm and the tied output layer: x [b, s, h] ([b, s/t, h] with sequence
    parallelism, gathered here) -> [b, s, V/t] float32."""
    x = layer_norm(cfg, layout=layout).apply({"params": ends["final_norm"]}, x)
    return _embed(cfg, layout).apply({"params": ends["embed"]}, enter_tensor(x, layout),
                                     method=Embed.logits)


embed, head_loss, decode, attention_rows = stack.decoder(_embed, block, logits)


def init_cache(cfg: ModelConfig, layout: Layout, batch: int, length: int):
    return stack.init_cache(cfg, cfg.num_heads // layout.tensor, batch, length)


def max_length(cfg: ModelConfig) -> int:
    """Longest sequence the model can read: its learned positions."""
    return cfg.seq_len


def forward_flops(cfg: ModelConfig, vocab: int) -> dict:
    """Matmul FLOPs per token of one forward pass: a layer (24 h^2 + 4 s h with ffn = 4h,
    PTD-P eq. 3; the MLP's moe.mlp_flops, with a mixture of experts its active part), its
    attention core (4 s h) and q, k, v projection (6 h^2), and the logit layer (2 h V)."""
    h, s = cfg.hidden_size, cfg.seq_len
    mlp = mlp_flops(cfg, 4)
    return {"layer": 8 * h * h + mlp + 4 * s * h, "core": 4 * s * h, "qkv": 6 * h * h,
            "head": 2 * h * vocab}


ARCH = Architecture(init_params=init_params, logical_axes=logical_axes, embed=embed,
                    block=block, head_loss=head_loss, forward_flops=forward_flops,
                    attention_mask=attention_rows,
                    decoder=Decoder(logits, decode, init_cache, max_length))
