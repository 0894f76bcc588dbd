"""One tensor-parallel rank's view of the model: `Layout`, parameter creation, every matmul
with a weight (`dense`, with FSDP's gather) and the collectives of Megatron's intra-layer
partitioning (Megatron-LM 2019, §3, Fig. 3) and of sequence parallelism.

Parameter shapes are *local*: a module built with `layout.tensor = t` holds 1/t of the
heads, of the MLP columns and of the vocabulary. Global parameters are created with t = 1;
inside the training step's manual shard_map each rank applies the same modules with t = mesh
size on its shards. Collectives run over `layout.tensor_axis` (None: one device, none):

- f, `enter_tensor`, before a column-parallel linear: identity forward, all-reduce backward,
  implicit in JAX's varying-axes typing (an activation that is the same on every tensor rank
  meeting a rank-local weight is broadcast, and the transpose of that is the all-reduce);
- g, `exit_tensor`, after the row-parallel attention output and second MLP layer: the
  explicit all-reduce, exactly two per layer in the forward pass.
With sequence parallelism (`layout.sequence_parallel`; Korthikanti et al. 2022) the
activations outside attention and the MLP are split over the tokens on the tensor axis,
[b, s/t, h]: f becomes an all-gather of the tokens (a reduce-scatter in the backward, as
the transpose of a tiled all-gather) and g a reduce-scatter (an all-gather backward); the
LayerNorms, dropouts and residual adds work on 1/t of the tokens, with dropout masks that
differ per tensor rank. A rank's part is a block of the microbatch's b s tokens in row
order (rank k: tokens k b s / t onwards), shaped [b, s/t, h]: Megatron splits its
[s, b, h] activations on the leading axis for the same reason, a gather or scatter of a
contiguous block (a split of the sequence axis of [b, s, h] made XLA transpose around
every collective, gigabytes a step on an H100). The ops between them are token-wise;
only the positions a rank's tokens have depend on the split (`token_positions`).

Every matmul with a weight goes through `dense` (`entered` for the column-parallel ones
after f), which names it by its weight and keeps its einsum as data (`DENSE`): with the
zero-bubble split of the backward (pipeline executor), `dense` records its input (collection
'dense_inputs') and takes a zero perturbation on its output (collection 'perturbations',
whose gradient is the output gradient), so a weight gradient can be computed later from
those two alone, without another forward. The input a column-parallel matmul on the residual
stream takes from f (`ENTERED`) is recorded as it was before f, with sequence parallelism
[b, s/t, h] (half the tape's bytes at t = 2, the gathered norm outputs being 2 of its 4.5
sbh per layer), once for the matmuls that take the same, and gathered again where the weight
gradient is made, as Megatron's backward gathers it again. With sequence parallelism and no
recomputation the backward's own weight gradients gather it again too: a layer keeps it
split (`entered`).

Every parameter carries logical axis names (see jaxptd/parallel/sharding.py for the rules).
Master weights are float32; each op casts them to the compute dtype at use.
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxptd.model import fp8, products


@dataclass(frozen=True)
class Layout:
    """How the model functions see the parameters: global (tensor=1, no collectives) for the
    single-device reference and initialisation, or one tensor rank's shards inside the
    manual shard_map (tensor=t, collectives over `tensor_axis`)."""
    vocab: int  # padded vocabulary (global); the real one to draw parameters (stack.boxed_init)
    tensor: int = 1  # parameter shapes are global / tensor
    tensor_axis: str | None = None  # collectives over this axis; None: a single device
    sequence_parallel: bool = False  # activations outside attention/MLP are [b, s/t, h]
    offload_activations: bool = False  # each layer's checkpointed input in host memory
    platform: str = "cpu"  # the target's (jaxptd/runtime/target.py): "gpu" takes cuDNN and Triton
    # FSDP: ((dense name, dimension), ...) of the layer weights held as shards over
    # `fsdp_axis`, split on that dimension, which `dense` gathers in `fsdp_dtype`
    fsdp: tuple[tuple[str, int], ...] = ()
    fsdp_axis: str | None = None
    fsdp_dtype: str = "float32"
    # context parallelism: each rank holds s / context of every row's tokens
    # (model/sequence.py), attention across `context_axis` by `context_attention`
    context: int = 1
    context_axis: str | None = None
    context_attention: str = "ring"
    # expert parallelism: each rank holds moe_experts / expert of a mixture of experts'
    # routed experts, tokens exchanged over `expert_axis` (model/moe.py)
    expert: int = 1
    expert_axis: str | None = None
    # a layer's backward runs in another program slot than its forward (a pipeline's kept
    # backward, models.layer_function's `apart`): what it recomputes needs no barrier
    # against XLA merging it with the forward (jax.checkpoint's prevent_cse); its weight
    # gradients come out in float32 (apart_einsum; the spread head's too, head.py)
    apart: bool = False
    fp8: str = "none"  # model.fp8: the layers' linears as FP8 GEMMs (model/fp8.py)
    fp8_margin: int = 0  # model.fp8_margin: delayed scaling's headroom, a power of 2

    @property
    def split_sequence(self) -> bool:
        """True when activations between the tensor-parallel blocks are [b, s/t, h]."""
        return self.sequence_parallel and self.tensor_axis is not None

    def fsdp_dim(self, name: str) -> int | None:
        """The dimension on which the dense() weight `name` is an FSDP shard (None: whole)."""
        return dict(self.fsdp).get(name)

    def fp8_axes(self, name: str) -> tuple[str, ...] | None:
        """For a dense() matmul that runs in FP8 (model.fp8, a layer linear): the mesh axes
        over which its tensors may be split (fp8.einsum's amax reduction); else None."""
        if self.fp8 == "none" or name not in fp8.LINEARS:
            return None
        return tuple(a for a in (self.tensor_axis, self.context_axis, self.expert_axis) if a)


def normal(std: float, names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def zeros(names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


def psum(x, axis: str | None):
    return x if axis is None else lax.psum(x, axis)


# name -> einsum of (input, weight) for every weight-bearing matmul of the layers.
DENSE = {
    # q, k and v side by side: the GEMM's own output layout [b s, 3 n d] (a leading c made
    # XLA transpose it, and transpose the gradient back: two copies a layer)
    "w_qkv": "bsh,hcnd->bscnd",  # column-parallel (by heads)
    "w_out": "bqnd,ndh->bqh",  # row-parallel: a partial sum over this rank's heads
    "w_fc1": "bsh,hf->bsf",  # column-parallel
    "w_fc2": "bsf,fh->bsh",  # row-parallel: a partial sum over this rank's ffn/t
    # Llama (llama.py)
    "w_q": "bsh,hnd->bsnd",  # column-parallel (by heads)
    "w_kv": "bsh,hcnd->bscnd",  # column-parallel by key/value heads (or replicated)
    "w_o": "bqnd,ndh->bqh",  # row-parallel
    "w_gate": "bsh,hf->bsf",  # column-parallel
    "w_up": "bsh,hf->bsf",  # column-parallel
    "w_down": "bsf,fh->bsh",  # row-parallel
    "w_head": "bsh,hv->bsv",  # untied output layer, column-parallel (by vocabulary)
    # BERT's heads (bert.py), replicated
    "w_mlm": "bsh,hk->bsk",
    "w_pool": "bh,hk->bk",
    "w_sop": "bh,hc->bc",
}
# Row-parallel matmuls: their output is a partial sum that the all-reduce after them (g)
# completes; model.remat=minimal keeps the residual stream after it, not the partial sum.
ROW_PARALLEL = ("w_out", "w_fc2", "w_o", "w_down")
DENSE_INPUTS = "dense_inputs"  # collection of `dense` inputs (when mutable)
# checkpoint names of what model.remat=minimal keeps of the matmuls, every other dense()
# output: the attention's q, k, v projection (QKV_OUTPUT; minimal_mlp recomputes it) and
# the rest (DENSE_OUTPUT); the residual stream minimal also keeps is layers.RESIDUAL
DENSE_OUTPUT = "dense_output"
QKV_OUTPUT = "qkv_output"
QKV = ("w_qkv", "w_q", "w_kv")
ATTENTION_OUT = ("w_out", "w_o")  # the attention's output projection (row-parallel)
PERTURBATIONS = "perturbations"  # collection of zeros added to `dense` outputs (when given)
# the layers' column-parallel matmuls whose input is the residual stream entering the
# tensor region (enter_tensor, `entered`), which records that input as it was before f,
# once where two take the same input (Llama's q and k, v; gate and up): name -> the name
# it is recorded under
ENTERED = {"w_qkv": "w_qkv", "w_fc1": "w_fc1", "w_q": "w_q", "w_kv": "w_q",
           "w_gate": "w_gate", "w_up": "w_gate"}


def dense(module: nn.Module, name: str, x, w, twin=None):
    """x times the weight `name` (its einsum is DENSE[name]) in x's dtype; the weight is cast
    (an FSDP shard is gathered for this matmul alone: `matmul`). Records x and perturbs the
    output when the caller asks (see the module docstring); otherwise exactly the einsum.
    The column-parallel matmuls of the residual stream (`ENTERED`) go through `entered`.
    twin: x computed again for its amax under model.fp8=delayed (`fp8_twin`)."""
    assert name not in ENTERED, f"{name}: its input enters the tensor region (entered())"
    _record(module, name, x)
    history = fp8_history(module, name)
    twins = () if twin is None or history is None else (twin,)
    return _output(module, name, matmul(name, module.layout)(x, w, history, *twins))


def fp8_twin(layout: Layout, fn, *args):
    """fn(*args) computed again for a dense() input's amax under model.fp8=delayed (else
    None; fp8.delayed_einsum's twin): not differentiated, its arguments behind an
    optimization barrier, the one fn's backward reads them through (fused._recompute),
    so that XLA can make the amax a reduction in that backward's kernel."""
    if layout.fp8 != "delayed":
        return None
    return fn(*lax.optimization_barrier(jax.tree.map(lax.stop_gradient, args)))


def entered(module: nn.Module, x, *weights):
    """The column-parallel matmuls of the residual stream x entering the tensor region
    (f, `enter_tensor`): ((name, w), ...) -> each one's dense() output, from one f.

    x is recorded as it was before f (with sequence parallelism [b, s/t, h], under the
    first name: `ENTERED`). With sequence parallelism the all-gathered [b, s, h] is not
    kept for the backward, which gathers it again for the weight gradients, as Megatron's
    backward does (Korthikanti et al. 2022 count the norm's output, s b h / t): kept, it
    was two [b, s, h] values a layer, at the same static time. Only where the layer keeps
    what it computes (model.remat none or selective): the other policies keep no gathered
    value, and under them this jax.checkpoint's barriers only cost copies. Its barriers
    also kept XLA from overlapping a pipeline's kept backward's reduce-scatters with GEMMs,
    where no barrier is needed (`Layout.apart`; unpipelined, without the barriers XLA
    merges the gather again with the forward's). The weights are cast before it: cast
    inside, the backward cast them again and kept the float32 slices of the layer stack
    instead; a custom vjp that keeps x and the weights as given and gathers again behind a
    barrier on x kept more. (The H100 compile's figures: BENCHMARKS.md and the git log.)
    """
    names = [name for name, _ in weights]
    assert all(ENTERED[n] == names[0] for n in names), f"{names}: ENTERED's inputs"
    _record(module, names[0], x)
    layout = module.layout
    histories = [fp8_history(module, name) for name in names]

    def products(x, ws):
        x = enter_tensor(x, layout)
        return [matmul(name, layout)(x, w, h) for name, w, h in zip(names, ws, histories)]
    if layout.split_sequence and module.cfg.remat in ("none", "selective"):
        products = jax.checkpoint(products, policy=jax.checkpoint_policies.nothing_saveable,
                                  prevent_cse=not layout.apart)
    ys = products(x, [w if layout.fsdp_dim(name) is not None else w.astype(x.dtype)
                      for name, w in weights])
    return [_output(module, name, y) for name, y in zip(names, ys)]


def _record(module: nn.Module, name: str, x):
    """x as the input of matmul `name` in DENSE_INPUTS (where the caller made it mutable)."""
    module.sow(DENSE_INPUTS, name, x, init_fn=lambda: None, reduce_fn=lambda _, new: new)


def _output(module: nn.Module, name: str, y):
    """A dense() output as a layer keeps it: named for model.remat=minimal, perturbed."""
    if name not in ROW_PARALLEL:
        y = checkpoint_name(y, QKV_OUTPUT if name in QKV else DENSE_OUTPUT)
    return module.perturb(name, y, collection=PERTURBATIONS)


def weight(module: nn.Module, name: str, init, shape: tuple[int, ...]):
    """The dense() weight `name` of a layer, float32 [shape] (one tensor rank's). Under FSDP
    (layout.fsdp names it) the layer holds its shard, which `dense` gathers where it
    multiplies: read as it is, past Flax's check that a parameter has `shape`. With
    model.fp8=delayed a layer linear also has its amax history (fp8.HISTORY), made here."""
    fp8_history(module, name, make=True)
    if module.layout.fsdp_dim(name) is None or module.is_initializing():
        return module.param(name, init, shape, jnp.float32)
    return module.get_variable("params", name)


def fp8_history(module: nn.Module, name: str, make: bool = False):
    """The amax history of the layer linear `name` (model.fp8=delayed: a dense() weight of
    fp8.LINEARS, or a mixture's expert weight, w_experts_*), else None; `make`: declare it
    (where its weight is made; it draws no key, so the weights drawn after it are those of
    every precision)."""
    if module.layout.fp8 != "delayed" or not (name in fp8.LINEARS or
                                              name.startswith("w_experts_")):
        return None
    if make:
        history = (fp8.OPERANDS, module.cfg.fp8_history)
        module.variable("params", name + fp8.HISTORY, lambda: nn.Partitioned(
            jnp.zeros(history, jnp.float32), ("fp8_operands", "fp8_history")))
    return nn.meta.unbox(module.get_variable("params", name + fp8.HISTORY))


def matmul(name: str, layout: Layout):
    """(x, w, history=None) -> x times the weight `name` as dense() multiplies it: einsum
    DENSE[name] with w cast to x's dtype, or with model.fp8 an FP8 GEMM of the layer
    linears (products.fp8_product), and an FSDP shard (layout.fsdp) gathered for it
    (products.fsdp_matmul).
    history: the linear's amax history under model.fp8=delayed."""
    dim, axes = layout.fsdp_dim(name), layout.fp8_axes(name)
    margin = layout.fp8_margin if layout.fp8 == "delayed" else None
    if dim is not None and margin is not None:  # delayed: the shard gathered in FP8
        return fp8.delayed_einsum(DENSE[name], axes, margin, (layout.fsdp_axis, dim,
                                                              jnp.dtype(layout.fsdp_dtype)))
    if dim is not None:
        return products.fsdp_matmul(DENSE[name], dim, layout.fsdp_axis, layout.fsdp_dtype,
                                    axes)
    if axes is not None:
        return products.fp8_product(DENSE[name], axes, margin)  # w quantized as it comes
    if layout.apart:
        return products.apart_einsum(DENSE[name])
    return lambda x, w, history=None: jnp.einsum(DENSE[name], x, w.astype(x.dtype))


def enter_tensor(x, layout: "Layout"):
    """f: the activation entering a column-parallel linear: identity, or with sequence
    parallelism the all-gather of the token blocks [b, s/t, h] -> [b, s, h] (see the
    module docstring)."""
    if not layout.split_sequence:
        return x
    return _tokens(lax.all_gather(_flat(x), layout.tensor_axis, axis=0, tiled=True), x, 1)


def exit_tensor(x, layout: "Layout"):
    """g: a row-parallel linear's partial sums [b, s, h] -> their sum over tensor ranks
    [b, s, h], or with sequence parallelism its reduce-scatter into token blocks
    [b, s/t, h]."""
    if not layout.split_sequence:
        return psum(x, layout.tensor_axis)
    part = lax.psum_scatter(_flat(x), layout.tensor_axis, scatter_dimension=0, tiled=True)
    return _tokens(part, x, layout.tensor)


def token_block(x, layout: "Layout"):
    """This tensor rank's token block [b, s/t, ...] of a value [b, s, ...] that is the
    same on every rank (all of it without sequence parallelism)."""
    if not layout.split_sequence:
        return x
    part = x.shape[0] * x.shape[1] // layout.tensor
    block = lax.dynamic_slice_in_dim(_flat(x), lax.axis_index(layout.tensor_axis) * part,
                                     part, 0)
    return _tokens(block, x, layout.tensor)


def token_positions(batch: int, seq: int, layout: "Layout"):
    """The position in its row of every token this rank holds: [b, s/t] int32 (without
    sequence parallelism [b, s], each row 0..s-1)."""
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return token_block(positions, layout)


def _flat(x):
    """[b, n, ...] -> [b n, ...]: tokens in row order."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _tokens(flat, like, split: int):
    """[b n / split * ..., ...] back to [b, n / split * ..., ...] of `like`'s rows."""
    return flat.reshape(like.shape[0], like.shape[1] * flat.shape[0] // (
        like.shape[0] * like.shape[1]), *flat.shape[1:])
