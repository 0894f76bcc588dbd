"""Benchmark the pallas_kernels against XLA's compilation of their plain-JAX references.

Shapes are GPT 1.3B training shapes at seq 2048: attention scores [b, 16, 2048, 2048] bf16
with the causal mask, MLP activations [b * 2048, 8192] bf16 with bias, the norms over
[b * 2048, 2048] bf16 rows (LayerNorm and RMSNorm, the backward's one-pass kernel against
XLA's fusions), attention q/k/v [b, 2048, 16, 128] bf16 three ways (XLA softmax attention,
the same with the Pallas softmax, cuDNN flash attention), and the context ring's flash
block (pallas_kernels.flash: forward with its log-sum-exp, backward from them) against a
dense XLA attention. One more softmax case has rows of 32768 keys, longer than one kernel
block, so it times the multi-block path: scores [1, 16, 256, 32768].
On a Hopper GPU only, the mixture of experts' grouped GEMM (pallas_kernels.grouped, JAX's
Mosaic-GPU kernels) of the b x 2048 tokens [b * 2048, 2048] over 8 experts' [2048, 8192]
weights (uneven groups, one empty) against `lax.ragged_dot` (XLA's dense all-experts
lowering, 8x the FLOPs) and against one dense GEMM of the same FLOPs as the grouped one
([b * 2048, 2048] x [2048, 8192]: what the kernels should approach; its output is not
compared); elsewhere the table says the row was skipped. The pipeline's stash traffic:
a loop of GEMMs each writing its [b * 2048, 8192] output into one of 4 stash slots and
reading another slot into the next GEMM, with pallas_kernels.slot_matmul's kernels (the
slot read and written in place) against XLA's dynamic slice and update around its GEMMs
(the executor's form today; `slot_gemm_cases`).

Reports median times, achieved GB/s counting each tensor read or written once, and that
as a percent of the HBM bandwidth measured in the same run by a large device-to-device
copy. Goal: >= 85% of copy bandwidth, no slower than XLA. Backward rows time forward +
backward (what training runs; y is returned so the forward cannot be dropped); "bwd" is
their difference. Before timing, every implementation's outputs are compared with XLA's
(`err`: max |difference| / max |XLA output|); the run fails if one is off by more than
bf16 rounding, so a wrong kernel is never reported as fast.

    python -m bench.kernels [--batch 4] [--reps 50] [--out-dir bench/results]

Needs a CUDA GPU; elsewhere it exits with a message, except with --toy (tiny shapes, any
device, interpret mode on CPU: what CI runs). Writes <out-dir>/kernels_<device>.json.
"""
import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from jaxptd.config import ModelConfig
from jaxptd.model import fused
from jaxptd.model.layers import attention_core
from jaxptd.model.tensor import Layout
from jaxptd.units import GB
from pallas_kernels import bias_gelu, fused_softmax, reference_bias_gelu, reference_fused_softmax
from bench.report import cell, result_path

MAX_ERR = 0.02  # relative to the largest XLA output: a few bf16 ulps


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Benchmark shapes; the defaults are GPT 1.3B's at seq 2048."""
    batch: int = 4
    heads: int = 16
    seq: int = 2048
    head_dim: int = 128
    ffn: int = 8192
    long_queries: int = 256
    long_keys: int = 32768
    copy_elems: int = 1 << 30  # bf16 elements of the bandwidth copy (2 GiB)
    experts: int = 8


TOY = Shapes(batch=1, heads=2, seq=16, head_dim=8, ffn=48, long_queries=3, long_keys=40,
             copy_elems=4096)


def median_seconds(fn, args, reps, warmup=5):
    """Median wall time of fn(*args) over `reps` calls, each waited on."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(elems, reps):
    """Memory bandwidth in GB/s of an elementwise device-to-device copy (read + write)."""
    src = jnp.ones((elems,), jnp.bfloat16)
    seconds = median_seconds(jax.jit(jnp.negative), (src,), reps)
    return 2 * src.nbytes / seconds / GB


def _vjp_both(fn):
    """x, dy -> (fn(x), dx): forward plus backward, as a training step runs them."""
    def run(x, dy):
        y, vjp = jax.vjp(fn, x)
        return y, vjp(dy)[0]
    return jax.jit(run)


def _softmax_cases(op, shape, scale):
    scores = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    size = scores.nbytes
    for impl, softmax in (("pallas", fused_softmax), ("xla", reference_fused_softmax)):
        fn = lambda x, softmax=softmax: softmax(x, scale=scale, causal=True)
        yield op, impl, "fwd", jax.jit(fn), (scores,), 2 * size
        yield op, impl, "fwd+bwd", _vjp_both(fn), (scores, scores), 5 * size


def softmax_cases(shapes):
    scale = shapes.head_dim ** -0.5
    yield from _softmax_cases(
        "softmax", (shapes.batch, shapes.heads, shapes.seq, shapes.seq), scale)
    yield from _softmax_cases(
        "softmax_long", (1, shapes.heads, shapes.long_queries, shapes.long_keys), scale)


def bias_gelu_cases(shapes):
    act = jax.random.normal(jax.random.key(1), (shapes.batch * shapes.seq, shapes.ffn),
                            jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(2), (shapes.ffn,), jnp.bfloat16)
    size = act.nbytes
    for impl, op in (("pallas", bias_gelu), ("xla", reference_bias_gelu)):
        fn = lambda x, op=op: op(x, bias)
        yield "bias_gelu", impl, "fwd", jax.jit(fn), (act,), 2 * size
        yield "bias_gelu", impl, "fwd+bwd", _vjp_both(fn), (act, act), 5 * size


def norm_cases(shapes):
    """LayerNorm and RMSNorm over the layer's [b * seq, h] bf16 rows with float32 scale
    (and bias): XLA's forward either way; the backward as the one-pass kernel
    (pallas_kernels.norm_backward; interpret mode off a GPU) or XLA's fusions. fwd+bwd
    returns y and every gradient (dx, dscale, dbias), so the sums are compared too."""
    hidden = shapes.heads * shapes.head_dim
    x, dy = (jax.random.normal(jax.random.key(i), (shapes.batch * shapes.seq, hidden),
                               jnp.bfloat16) for i in (13, 14))
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(15), (hidden,), jnp.float32)
    bias = 0.1 * jax.random.normal(jax.random.key(16), (hidden,), jnp.float32)
    norms = (("layer_norm", lambda x, s, b, form: fused.layer_norm(
        x, s, b, 1e-5, jnp.bfloat16, form), (scale, bias)),
             ("rms_norm", lambda x, s, form: fused.rms_norm(x, s, 1e-5, jnp.bfloat16, form),
              (scale,)))
    kernel = "kernel" if jax.default_backend() == "gpu" else "interpret"
    for op, norm, params in norms:
        for impl, form in (("pallas", kernel), ("xla", "xla")):
            def both(x, dy, norm=norm, form=form, params=params):
                y, vjp = jax.vjp(lambda x, *p: norm(x, *p, form), x, *params)
                return (y, *vjp(dy))
            fwd = jax.jit(lambda x, norm=norm, form=form, params=params:
                          norm(x, *params, form))
            yield op, impl, "fwd", fwd, (x,), 2 * x.nbytes
            yield op, impl, "fwd+bwd", jax.jit(both), (x, dy), 5 * x.nbytes


def attention_cases(shapes, cudnn=True):
    """The model's own attention core (jaxptd.model.layers) with each softmax, and cuDNN."""
    shape = (shapes.batch, shapes.seq, shapes.heads, shapes.head_dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(3, 6))
    scale = shapes.head_dim ** -0.5
    impls = [(kernels, functools.partial(
        attention_core, key=None, scale=scale, layout=Layout(128, platform=jax.devices()[0].platform),
        cfg=ModelConfig(dtype="bfloat16", kernels=kernels))) for kernels in ("xla", "pallas")]
    if cudnn:
        impls.append(("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn")))
    for impl, fn in impls:
        yield "attention", impl, "fwd", jax.jit(fn), (q, k, v), None
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(
            jnp.float32).sum(), argnums=(0, 1, 2)))
        yield "attention", impl, "fwd+bwd", grad, (q, k, v), None


def flash_block_cases(shapes):
    """The context ring's flash block (pallas_kernels.flash, JAX's Pallas kernels) against a
    dense causal attention in XLA: the forward's output and log-sum-exp, and the forward
    with the backward from them (what one ring block part runs)."""
    from pallas_kernels.flash import flash_block, flash_block_grads
    shape = (shapes.batch, shapes.seq, shapes.heads, shapes.head_dim)
    q, k, v, d_out = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
                      for i in range(6, 10))
    scale = shapes.head_dim ** -0.5

    def dense(q, k, v):  # (out float32, log-sum-exp [b, s, heads])
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
        scores = jnp.where(causal, scores * scale, -jnp.inf)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1).astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        return out, jnp.swapaxes(jax.nn.logsumexp(scores, -1), 1, 2)

    def dense_both(q, k, v, d_out):
        (out, _), vjp = jax.vjp(dense, q, k, v)
        return (out, *vjp((d_out.astype(jnp.float32), jnp.zeros(out.shape[:3]))))

    def flash(q, k, v):
        return flash_block(q, k, v, scale=scale, causal=True)

    def flash_both(q, k, v, d_out):
        out, lse = flash(q, k, v)
        return (out, *flash_block_grads(q, k, v, out, lse, d_out, scale=scale, causal=True))
    for impl, fwd, both in (("pallas", flash, flash_both), ("xla", dense, dense_both)):
        yield "flash_block", impl, "fwd", jax.jit(fwd), (q, k, v), None
        yield "flash_block", impl, "fwd+bwd", jax.jit(both), (q, k, v, d_out), None


def grouped_cases(shapes):
    """The grouped GEMM: tokens [b * seq, h] sorted by expert (uneven groups, expert 3
    empty), each expert's [h, ffn]; forward, and forward with both gradients."""
    from pallas_kernels.grouped import grouped_matmul
    m, k, n, g = shapes.batch * shapes.seq, shapes.heads * shapes.head_dim, shapes.ffn, \
        shapes.experts
    x, dy = (jax.random.normal(jax.random.key(i), (m, s), jnp.bfloat16)
             for i, s in ((10, k), (11, n)))
    w = jax.random.normal(jax.random.key(12), (g, k, n), jnp.bfloat16) * k ** -0.5
    share = jnp.array([3, 1, 2, 0, 1, 4, 2, 3][:g], jnp.float32)
    sizes = jnp.floor(m * share / share.sum()).astype(jnp.int32)  # sum <= m
    w_dense = w[0]

    def both(fn, *args):  # (y, dx, dw): what training runs
        y, vjp = jax.vjp(fn, *args[:2])
        return (y, *vjp(dy))
    impls = (("mosaic", lambda x, w: grouped_matmul(x, w, sizes, gpu=True), (x, w)),
             ("xla", lambda x, w: grouped_matmul(x, w, sizes, gpu=False), (x, w)),
             ("dense", jnp.dot, (x, w_dense)))
    for impl, fn, args in impls:
        yield "grouped_gemm", impl, "fwd", jax.jit(fn), args, None
        yield "grouped_gemm", impl, "fwd+bwd", jax.jit(functools.partial(both, fn)), args, \
            None


def slot_gemm_cases(shapes, slots: int = 4, rounds: int = 4):
    """The pipeline's stash traffic (pallas_kernels.slot_matmul): a loop of `rounds`, each
    writing a GEMM's output (x [b * seq, h] @ w1 [h, ffn]) into a stash slot and reading
    the slot written `slots - 1` rounds before into the next GEMM (@ w2 [ffn, h]), its
    output the next round's x: with the kernels, each slot read and written in place, and
    with XLA's dynamic slice and update around its own GEMMs (the executor's form today).
    Shapes rounded up to the kernels' tiles (--toy). Each call copies the stash into the
    loop once, either way (it is not donated)."""
    from pallas_kernels import slot_matmul as sm
    m, h, f = (-(-v // t) * t for v, t in ((shapes.batch * shapes.seq, sm.BLOCK_M),
                                           (shapes.heads * shapes.head_dim, sm.BLOCK_N),
                                           (shapes.ffn, sm.BLOCK_N)))
    x = jax.random.normal(jax.random.key(17), (m, h), jnp.bfloat16)
    w1, w2 = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) * shape[0] ** -0.5
              for i, shape in ((18, (h, f)), (19, (f, h))))
    stash = jax.random.normal(jax.random.key(20), (slots, m, f), jnp.bfloat16)  # (zeros:
    # every round after the first would read and make zeros, the comparison then vacuous)
    interpret = jax.default_backend() != "gpu"

    def loop(kernels, stash, x, w1, w2):
        def body(carry, r):
            x, stash = carry
            at, back = r[None] % slots, (r[None] + 1) % slots
            if kernels:
                stash = sm.matmul_into_slot(stash, at, x, w1, interpret=interpret)
                return (sm.slot_matmul(stash, back, w2, interpret=interpret), stash), None
            stash = sm.reference_matmul_into_slot(stash, at, x, w1)
            return (sm.reference_slot_matmul(stash, back, w2), stash), None
        return lax.scan(body, (x, stash), jnp.arange(rounds))[0]
    for impl, kernels in (("pallas", True), ("xla", False)):
        yield "slot_gemm", impl, "loop", jax.jit(functools.partial(loop, kernels)), \
            (stash, x, w1, w2), None


UNCOMPARED = ("dense",)  # impls that time the same FLOPs on other operands


def relative_error(outputs, reference):
    """max |a - b| over all leaves / max |b|: 0 for identical outputs."""
    diffs = [jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
             for a, b in zip(jax.tree.leaves(outputs), jax.tree.leaves(reference))]
    scales = [jnp.max(jnp.abs(b.astype(jnp.float32))) for b in jax.tree.leaves(reference)]
    return float(max(diffs) / max(max(scales), 1e-30))


def measure(shapes, reps, cudnn=True, hopper=False):
    """(copy GB/s, rows): every case timed, GB/s and % of copy bandwidth where counted,
    and every non-XLA implementation's error against XLA's output; the grouped GEMM on a
    Hopper GPU only."""
    bandwidth = copy_bandwidth(shapes.copy_elems, reps)
    print(f"measured copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    rows, outputs = [], {}
    for cases in (softmax_cases(shapes), bias_gelu_cases(shapes), norm_cases(shapes),
                  attention_cases(shapes, cudnn), flash_block_cases(shapes),
                  slot_gemm_cases(shapes),
                  grouped_cases(shapes) if hopper else ()):
        for op, impl, pass_, fn, args, nbytes in cases:
            outputs[op, impl, pass_] = fn(*args)
            seconds = median_seconds(fn, args, reps)
            gbps = None if nbytes is None else nbytes / seconds / GB
            rows.append(dict(op=op, impl=impl, pass_=pass_, ms=seconds * 1e3, gbps=gbps,
                             pct_hbm=None if gbps is None else 100 * gbps / bandwidth))
            # (as it goes: a device command cut off at its time limit keeps these lines)
            print(f"measured {op} {impl} {pass_}: {seconds * 1e3:.3f} ms", flush=True)
    for row in rows:
        key = (row["op"], row["impl"], row["pass_"])
        if row["impl"] not in ("xla", *UNCOMPARED):
            row["err"] = relative_error(outputs[key], outputs[row["op"], "xla", row["pass_"]])
        if row["pass_"] == "fwd+bwd":  # backward alone = (fwd+bwd) - fwd
            fwd = next(r for r in rows if (r["op"], r["impl"], r["pass_"]) == key[:2] + ("fwd",))
            row["bwd_ms"] = row["ms"] - fwd["ms"]
    return bandwidth, rows


def print_table(device, bandwidth, rows, command):
    print(f"device: {device}; copy bandwidth {bandwidth:.0f} GB/s; jax {jax.__version__}")
    print(f"{'op':<13} {'impl':<7} {'pass':<8} {'ms':>9} {'bwd ms':>9} {'GB/s':>8} "
          f"{'%HBM':>6} {'err':>8}")
    for r in rows:
        print(f"{r['op']:<13} {r['impl']:<7} {r['pass_']:<8} {r['ms']:9.3f} "
              f"{cell(r.get('bwd_ms'), '.3f', 9)} {cell(r['gbps'], '.0f', 8)} "
              f"{cell(r['pct_hbm'], '.1f', 6)} {cell(r.get('err'), '.1e', 8)}")
    print(f"reproduce: {command}")


def wrong_rows(rows):
    """The rows whose outputs differ from XLA's by more than MAX_ERR."""
    return [r for r in rows if r.get("err", 0.0) > MAX_ERR]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per case")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--toy", action="store_true",
                        help="tiny shapes on any device (a test of this script, not a benchmark)")
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.toy:
        sys.exit(f"bench/kernels.py needs a CUDA GPU; JAX's default backend here is "
                 f"{jax.default_backend()!r}. Nothing was measured.")
    device = jax.devices()[0].device_kind
    command = (f"python -m bench.kernels "
               f"{'--toy' if args.toy else f'--batch {args.batch}'} --reps {args.reps}")
    shapes = TOY if args.toy else Shapes(batch=args.batch)
    # Mosaic-GPU's grouped GEMM kernels are Hopper's (wgmma): compute capability 9.x.
    hopper = gpu and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
    bandwidth, rows = measure(shapes, args.reps, cudnn=gpu, hopper=hopper)
    print_table(device, bandwidth, rows, command)
    if not hopper:
        print("grouped_gemm: skipped (its Mosaic-GPU kernels need a Hopper GPU)")
    path = result_path(args.out_dir, "kernels", device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(device=device, jax=jax.__version__, batch=args.batch,
                                    reps=args.reps, copy_gbps=bandwidth, command=command,
                                    rows=rows), indent=2))
    print(f"wrote {path}")
    if wrong_rows(rows):
        sys.exit("outputs differ from XLA's by more than bf16 rounding: " + ", ".join(
            f"{r['op']} {r['impl']} {r['pass_']} err {r['err']:.1e}" for r in wrong_rows(rows)))


if __name__ == "__main__":
    main()
