"""Flash-attention blocks for the context-parallel ring: one block's forward with its
log-sum-exp, and its backward given the log-sum-exp and output of the WHOLE attention;
and `attention`, one whole attention made of them (model.attention=flash).

Owns: the two calls into JAX's Pallas (Triton) flash-attention kernels
(`jax.experimental.pallas.ops.gpu.attention`: `mha` and its backward `_mha_backward`), the
grouped-query heads around them and the log-sum-exp's units. Not a kernel of our own:
JAX's is the maintained one, and the ring needs only what it computes.

Why a block's backward takes another attention's statistics: the ring combines c blocks
by their log-sum-exps, so the gradient of a block's keys and values is the flash
backward with the ring's final output O and log-sum-exp L (P = exp(S - L) is then the
block's share of the whole softmax, and D = rowsum(dO O) the whole row's), not the
block's own. `jax.nn.dot_product_attention(implementation="cudnn")` returns a block's
log-sum-exp but drops its cotangent and takes no outside statistics in its backward, so
cuDNN cannot be this block; Pallas's backward takes (out, lse) as plain arguments.

Contract (both functions): q [b, n, heads, d], k, v [b, m, kv_heads, d] (heads a multiple
of kv_heads: each key/value head repeated for its query group, its gradients summed back),
n and m multiples of 32 with n / 32 == m / 32 blocks for the fused backward (the ring's
blocks are square); d up to 256 (the kernels pad it to a power of two; above 128 they
take smaller tiles, `_tiles`: the default ones of a head padded to 256 need more shared
memory than an A100 has); `causal`: query i sees keys j <= i (top-left aligned; the ring's
diagonal block in its local order); log-sum-exps in natural log, [b, n, heads] float32
(the kernels keep base 2, [b, heads, n]). No mask beyond causal: packed documents and
padding take the ring's XLA blocks.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as _mha

from jaxptd.hlo.cost import FLASH_CAUSAL
from pallas_kernels import backend

_LOG2 = math.log(2.0)


def _scope(causal: bool) -> str:
    """The op-name scope of a block's calls: the static cost report (jaxptd/hlo/cost.py)
    halves a causal block's FLOPs, which the kernel's HLO does not show."""
    return FLASH_CAUSAL if causal else "flash_block"


def _grouped(q, k, v):
    """k, v with each key/value head repeated for its group of query heads."""
    group = q.shape[2] // k.shape[2]
    return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def _tiles(d: int) -> tuple:
    """(block sizes, pipeline stages) of the kernels for head width d (contract above)."""
    if d <= 128:
        return _mha.BlockSizes.get_default(), 2
    return _mha.BlockSizes(block_q=64, block_k=64, block_q_dkv=32, block_kv_dkv=32,
                           block_q_dq=32, block_kv_dq=32), 1


def flash_block(q, k, v, *, scale: float, causal: bool, interpret: bool | None = None):
    """(out [b, n, heads, d] float32, lse [b, n, heads] float32) of q over one key block."""
    k_all, v_all = _grouped(q, k, v)
    interpret = backend.mode(interpret) == "interpret"
    blocks, stages = _tiles(q.shape[-1])

    def run(q, k, v):
        return _mha.mha(q, k, v, None, sm_scale=scale, causal=causal, block_sizes=blocks,
                        num_stages=stages, interpret=interpret, return_residuals=True)
    with jax.named_scope(_scope(causal)):
        out, lse2 = backend.call(run, q, k_all, v_all, interpret=interpret, checked=False)
    return out.astype(jnp.float32), jnp.swapaxes(lse2, 1, 2) * _LOG2


def flash_block_grads(q, k, v, out, lse, d_out, *, scale: float, causal: bool,
                      interpret: bool | None = None):
    """(dq, dk, dv) float32 of one key block's share of an attention whose output is `out`
    [b, n, heads, d] and log-sum-exp `lse` [b, n, heads], given its cotangent d_out."""
    k_all, v_all = _grouped(q, k, v)
    interpret = backend.mode(interpret) == "interpret"
    blocks, stages = _tiles(q.shape[-1])

    def run(q, k, v, out, lse2, d_out):
        dq, dk, dv, _ = _mha._mha_backward(
            scale, causal, blocks, "triton", None, stages, None,
            interpret, False, False, (q, k, v, None, out, lse2), d_out)
        return dq, dk, dv
    with jax.named_scope(_scope(causal)):
        dq, dk, dv = backend.call(run, q, k_all, v_all, out.astype(q.dtype),
                                  jnp.swapaxes(lse, 1, 2) / _LOG2, d_out.astype(q.dtype),
                                  interpret=interpret, checked=False)
    b, m, heads, d = dk.shape
    kv_heads = k.shape[2]

    def summed(x):  # [b, m, heads, d] -> [b, m, kv_heads, d]: the group's gradients added
        return x.astype(jnp.float32).reshape(b, m, kv_heads, heads // kv_heads, d).sum(3)
    return dq.astype(jnp.float32), summed(dk), summed(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def attention(q, k, v, scale: float, causal: bool, interpret: bool | None = None):
    """softmax(scale q k^T) v of q [b, n, heads, d] over k, v [b, m, kv_heads, d] (n = m,
    one block: the contract above) -> [b, n, heads, d] in q's dtype; no [n, m] scores in
    memory, forward or backward (which keeps q, k, v, the output and its log-sum-exp)."""
    return _attention_fwd(q, k, v, scale, causal, interpret)[0]


def _attention_fwd(q, k, v, scale, causal, interpret):
    out, lse = flash_block(q, k, v, scale=scale, causal=causal, interpret=interpret)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _attention_bwd(scale, causal, interpret, residuals, d_out):
    q, k, v, out, lse = residuals
    dq, dk, dv = flash_block_grads(q, k, v, out, lse, d_out, scale=scale, causal=causal,
                                   interpret=interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


attention.defvjp(_attention_fwd, _attention_bwd)
