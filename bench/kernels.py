"""Benchmark the pallas_kernels against XLA's compilation of their plain-JAX references.

Shapes are GPT 1.3B training shapes at seq 2048: attention scores [b, 16, 2048, 2048] bf16
with the causal mask, MLP activations [b * 2048, 8192] bf16 with bias, and attention
q/k/v [b, 2048, 16, 128] bf16 three ways (XLA softmax attention, the same with the Pallas
softmax, cuDNN flash attention). Reports median times, achieved GB/s counting each
tensor read or written once, and that as a percent of the HBM bandwidth measured in the
same run by a large device-to-device copy. Goal: >= 85% of copy bandwidth, no slower
than XLA. Backward rows time forward + backward (what training runs; y is returned so
the forward cannot be dropped); "bwd" is their difference.

    PYTHONPATH=. python bench/kernels.py [--batch 4] [--reps 50]

Needs a CUDA GPU; elsewhere it exits with a message. Writes
bench/results/kernels_<device>.json.
"""
import argparse
import json
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import bias_gelu, fused_softmax, reference_bias_gelu, reference_fused_softmax

HEADS, SEQ, HEAD_DIM, FFN = 16, 2048, 128, 8192
RESULTS = pathlib.Path(__file__).parent / "results"


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


def copy_bandwidth(reps):
    """HBM bandwidth in GB/s of a 2 GiB device-to-device elementwise copy (read + write)."""
    src = jnp.ones((1 << 30,), jnp.bfloat16)
    seconds = median_seconds(jax.jit(jnp.negative), (src,), reps)
    return 2 * src.nbytes / seconds / 1e9


def _vjp_both(fn):
    """x, dy -> (fn(x), dx): forward plus backward, as a training step runs them."""
    def run(x, dy):
        y, vjp = jax.vjp(fn, x)
        return y, vjp(dy)[0]
    return jax.jit(run)


def softmax_cases(batch):
    scores = jax.random.normal(jax.random.key(0), (batch, HEADS, SEQ, SEQ), jnp.bfloat16)
    size = scores.nbytes
    pallas = lambda x: fused_softmax(x, scale=HEAD_DIM ** -0.5, causal=True)
    xla = lambda x: reference_fused_softmax(x, scale=HEAD_DIM ** -0.5, causal=True)
    for impl, fn in (("pallas", pallas), ("xla", xla)):
        yield "softmax", impl, "fwd", jax.jit(fn), (scores,), 2 * size
        yield "softmax", impl, "fwd+bwd", _vjp_both(fn), (scores, scores), 5 * size


def bias_gelu_cases(batch):
    act = jax.random.normal(jax.random.key(1), (batch * SEQ, FFN), jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(2), (FFN,), jnp.bfloat16)
    size = act.nbytes
    for impl, op in (("pallas", bias_gelu), ("xla", reference_bias_gelu)):
        fn = lambda x, op=op: op(x, bias)
        yield "bias_gelu", impl, "fwd", jax.jit(fn), (act,), 2 * size
        yield "bias_gelu", impl, "fwd+bwd", _vjp_both(fn), (act, act), 5 * size


def _softmax_attention(softmax):
    def attend(q, k, v):  # [b, s, h, d] each
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)                  # [b, h, s, s]
        probs = softmax(scores, scale=HEAD_DIM ** -0.5, causal=True)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return attend


def attention_cases(batch):
    q, k, v = (jax.random.normal(jax.random.key(i), (batch, SEQ, HEADS, HEAD_DIM), jnp.bfloat16)
               for i in range(3, 6))
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="cudnn")
    for impl, fn in (("xla", _softmax_attention(reference_fused_softmax)),
                     ("pallas", _softmax_attention(fused_softmax)), ("cudnn", cudnn)):
        yield "attention", impl, "fwd", jax.jit(fn), (q, k, v), None
        grad = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(
            jnp.float32).sum(), argnums=(0, 1, 2)))
        yield "attention", impl, "fwd+bwd", grad, (q, k, v), None


def measure(batch, reps):
    """Rows of results: every case timed, GB/s and % of copy bandwidth where counted."""
    bandwidth = copy_bandwidth(reps)
    rows = []
    for cases in (softmax_cases, bias_gelu_cases, attention_cases):
        for op, impl, pass_, fn, args, nbytes in cases(batch):
            seconds = median_seconds(fn, args, reps)
            gbps = None if nbytes is None else nbytes / seconds / 1e9
            rows.append(dict(op=op, impl=impl, pass_=pass_, ms=seconds * 1e3, gbps=gbps,
                             pct_hbm=None if gbps is None else 100 * gbps / bandwidth))
    for row in rows:  # backward alone = (fwd+bwd) - fwd of the same op and impl
        if row["pass_"] == "fwd+bwd":
            fwd = next(r for r in rows if r["op"] == row["op"] and r["impl"] == row["impl"]
                       and r["pass_"] == "fwd")
            row["bwd_ms"] = row["ms"] - fwd["ms"]
    return bandwidth, rows


def print_table(device, bandwidth, rows, command):
    print(f"device: {device}; copy bandwidth {bandwidth:.0f} GB/s; jax {jax.__version__}")
    print(f"{'op':<10} {'impl':<7} {'pass':<8} {'ms':>9} {'bwd ms':>9} {'GB/s':>8} {'%HBM':>6}")
    for r in rows:
        bwd = f"{r['bwd_ms']:9.3f}" if "bwd_ms" in r else " " * 9
        gbps = f"{r['gbps']:8.0f}" if r["gbps"] is not None else " " * 8
        pct = f"{r['pct_hbm']:6.1f}" if r["pct_hbm"] is not None else " " * 6
        print(f"{r['op']:<10} {r['impl']:<7} {r['pass_']:<8} {r['ms']:9.3f} {bwd} {gbps} {pct}")
    print(f"reproduce: {command}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per case")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit(f"bench/kernels.py needs a CUDA GPU; JAX's default backend here is "
                 f"{jax.default_backend()!r}. Nothing was measured.")
    device = jax.devices()[0].device_kind
    command = f"PYTHONPATH=. python bench/kernels.py --batch {args.batch} --reps {args.reps}"
    bandwidth, rows = measure(args.batch, args.reps)
    print_table(device, bandwidth, rows, command)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"kernels_{re.sub(r'[^A-Za-z0-9]+', '_', device).strip('_')}.json"
    path.write_text(json.dumps(dict(device=device, jax=jax.__version__, batch=args.batch,
                                    reps=args.reps, copy_gbps=bandwidth, command=command,
                                    rows=rows), indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
