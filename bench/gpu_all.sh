#!/usr/bin/env bash
# Every GPU measurement of jaxptd in one command, runnable part by part.
#
#   bench/gpu_all.sh [--toy] OUT_DIR [PART ...]
#
# Parts (default: all, in this order), each meant to fit in one 10-minute device
# command: the train parts start no run after GPU_ALL_BUDGET_S seconds (default 500) and
# record the rest as skipped, and any part is ended after GPU_ALL_PART_TIMEOUT_S (580).
#   env         versions, devices, nvidia-smi
#   kernels     bench/kernels.py: the Pallas kernels and attention paths vs XLA
#   sizes       bench/gpu_train.py: GPT 1.3B, 350M, 125M as configured, each with
#               the PyTorch baseline (bench/torch_gpt.py) when torch is importable
#   fp8         GPT-1.3B with model.fp8=tensorwise beside its bf16 base row in the same
#               command (issue 49's speed-up; --toy: the toy GPT)
#   llama       the Llama-style sizes (skipped, with a note, until model.arch=llama exists)
#   long        Llama-1.3B at an 8k sequence: one stream, packed rows (cuDNN's masked
#               kernel), and with 2 GPUs or more context parallelism 2 (ring, all-gather)
#   moe         with 2 GPUs or more bench/moe_check.py first (expert parallelism's ragged
#               all-to-all against one device, float32: its first run anywhere), then
#               Llama-350M dense against its mixture of experts of equal active FLOPs (8
#               experts of half the width, top 2): dropless (Mosaic grouped GEMMs) and
#               with a capacity of 1.25 (bench/kernels.py's grouped-GEMM row: the kernels)
#   variants    GPT-1.3B: attention xla/cudnn x kernels xla/pallas x remat
#               none/minimal/selective/full, scanned layers (the GPU default unrolls them),
#               one change at a time from the config
#   microbatch  GPT-1.3B at b = 1, 2, 8; GPT-350M and 125M at b = 4, 16
#   profile     bench/profile_step.py: the top XLA ops of one GPT-1.3B step
#   pipeline    bench/pipeline_rounds.py --json OUT_DIR/pipeline_rounds.json
#               --command-buffers (--toy under --toy), when that script exists
#   schedules   with 2 GPUs or more, GPT-1.3B pipelined over p of them (8, 4 or 2; 32
#               layers at 8, as issue 48's depth), 4p microbatches of 2: 1f1b with and
#               without minimal recomputation, zb-h1, interleaved, zb-interleaved and
#               zb-v (--toy: 1f1b and zb-v over 4 simulated CPU devices)
#
# Everything goes under OUT_DIR, in at most 8 files (what a device command hands back):
# gpu_all.log (all output), env.txt, kernels_<device>.json, gpu_train_<device>.json,
# gpu_train_runs.log (every run's own output), profile_gpt-1.3B_<device>.json,
# pipeline_rounds.json, moe_check.json (2+ GPUs). gpu_train_<device>.json starts from bench/results/ of the copy it
# runs in when OUT_DIR has none, so parts run in separate commands add up once each
# command's file is copied back there. A failing part is reported and the next one runs;
# a failing run inside a part is an `error` in its row. Exit status: the number of failed
# parts (2 for bad arguments).
#
# --toy runs the same parts at toy sizes on any machine (CPU: interpret-mode kernels,
# 2-layer models, eager PyTorch): what CI runs (tests/test_bench_gpu.py).
set -u -o pipefail

ALL_PARTS=(env kernels sizes fp8 llama long moe variants microbatch profile pipeline
           schedules)
usage="usage: bench/gpu_all.sh [--toy] OUT_DIR [PART ...]; parts: ${ALL_PARTS[*]}"
TOY=""
if [ "${1:-}" = "--toy" ]; then TOY=1; shift; fi
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then echo "error: $usage" >&2; exit 2; fi
if ! mkdir -p "$1" 2>/dev/null || [ ! -w "$1" ]; then
  echo "error: OUT_DIR $1: cannot create or write it" >&2; exit 2
fi
OUT=$(cd "$1" && pwd)
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${ALL_PARTS[@]}")
for part in "${PARTS[@]}"; do
  if [[ ! " ${ALL_PARTS[*]} " == *" $part "* ]]; then
    echo "error: part $part: unknown; $usage" >&2; exit 2
  fi
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
# Compiled programs are reused by a later command on the same machine (a rerun of a part).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxptd-jax-cache}
PY=${PYTHON:-python3}  # (the GPU image's python3 holds torch; it may have no `python`)
BUDGET=${GPU_ALL_BUDGET_S:-500}
PART_TIMEOUT=${GPU_ALL_PART_TIMEOUT_S:-580}

if [ -n "$TOY" ]; then
  BIG=gpt-toy; MID=gpt-toy; SMALL=gpt-toy; LLAMA=llama-toy; LONG=llama-toy; SEQ=64
  MOE=llama-toy; EXPERT_FFN=128
  TRAIN=(--steps 2 --warmup 1 --budget-s "$BUDGET" --out-dir "$OUT")
  KERNELS=(--toy --reps 2)
else
  BIG=gpt-1.3B; MID=gpt-350M; SMALL=gpt-125M; LLAMA=llama-125M,llama-350M,llama-1.3B
  LONG=llama-1.3B; SEQ=8192; MOE=llama-350M; EXPERT_FFN=2048
  TRAIN=(--budget-s "$BUDGET" --out-dir "$OUT" --previous bench/results)
  KERNELS=()
fi

part_env() {
  $PY -c "import jax; jax.print_environment_info(); print(jax.devices())"
  $PY -c "
import importlib.metadata as m
for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'torch', 'triton'):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'not installed')"
}

part_kernels() { $PY -m bench.kernels "${KERNELS[@]}" --out-dir "$OUT"; }
part_sizes() { $PY -m bench.gpu_train --models "$BIG,$MID,$SMALL" "${TRAIN[@]}"; }
part_fp8() { $PY -m bench.gpu_train --models "$BIG" --variants base fp8=tensorwise "${TRAIN[@]}"; }
part_llama() { $PY -m bench.gpu_train --models "$LLAMA" "${TRAIN[@]}"; }
part_long() {
  local variants=("seq=$SEQ,b=1,pack=0")  # (--toy: the llama part ran the stream)
  [ -z "$TOY" ] && variants=("seq=$SEQ,b=1" "${variants[@]}")
  if [ "$($PY -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
    variants+=("seq=$SEQ,b=1,context=2" "seq=$SEQ,b=1,context=2,kernels=pallas")
  else
    echo "one device: no context parallelism rows"
  fi
  $PY -m bench.gpu_train --models "$LONG" --variants "${variants[@]}" "${TRAIN[@]}"
}
part_moe() {  # (--toy: the dropless row alone, the dense one is the llama part's)
  local moe="experts=8,topk=2,expert_ffn=$EXPERT_FFN" status=0
  local variants=(base "$moe" "$moe,capacity=1.25")
  [ -n "$TOY" ] && variants=("$moe")
  $PY -m bench.moe_check --json "$OUT/moe_check.json" || status=$?  # (2+ devices)
  $PY -m bench.gpu_train --models "$MOE" --variants "${variants[@]}" "${TRAIN[@]}" || status=$?
  return $status
}
part_variants() {  # (--toy: two of them, the driver's plumbing, not the variants)
  local variants=(attention=xla,b=2 attention=xla,kernels=pallas,b=2
                  attention=xla,remat=selective kernels=pallas remat=minimal remat=full
                  scan=true)
  [ -n "$TOY" ] && variants=(kernels=pallas remat=full)
  $PY -m bench.gpu_train --models "$BIG" "${TRAIN[@]}" --variants "${variants[@]}"
}
part_microbatch() {  # two commands sharing one budget (--toy: one size in each)
  local start=$SECONDS status big=(b=1 b=2 b=8) small=(b=4 b=16)
  [ -n "$TOY" ] && big=(b=1) && small=(b=4)
  $PY -m bench.gpu_train --models "$BIG" --variants "${big[@]}" "${TRAIN[@]}" \
    --budget-s $((BUDGET * 3 / 5))
  status=$?
  $PY -m bench.gpu_train --models "$MID,$SMALL" --variants "${small[@]}" "${TRAIN[@]}" \
    --budget-s $((BUDGET - (SECONDS - start) > 1 ? BUDGET - (SECONDS - start) : 1)) || status=$?
  return $status
}
part_profile() {
  $PY -m bench.profile_step --model "$BIG" ${TOY:+--warmup 1} --out-dir "$OUT"
}
part_pipeline() {
  if [ ! -f bench/pipeline_rounds.py ]; then
    echo "bench/pipeline_rounds.py does not exist yet: nothing to run"; return 0
  fi
  # (on a GPU also in a child process recording conditionals into CUDA graphs: what the
  # cond round form's conditionals cost there, bench/cond_rounds.py)
  local graphs=--command-buffers
  [ -n "$TOY" ] && graphs=--toy
  $PY -m bench.pipeline_rounds --json "$OUT/pipeline_rounds.json" $graphs
}
part_schedules() {  # the pipeline at depth, every schedule in one run (issue 48)
  local n p layers=24
  if [ -n "$TOY" ]; then  # (simulated CPU devices: the plumbing, not the schedules)
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"
    layers=8
  fi
  n=$($PY -c 'import jax; print(jax.device_count())')
  if [ "$n" -lt 2 ]; then
    echo "one device: no pipelined rows (the pipeline part times one rank's rounds)"; return 0
  fi
  p=$((n >= 8 ? 8 : n >= 4 ? 4 : 2))
  [ "$p" -eq 8 ] && layers=32
  local at="pipe=$p,layers=$layers,b=2" variants
  variants=("$at,schedule=1f1b" "$at,schedule=1f1b,remat=minimal" "$at,schedule=zb-h1"
            "$at,schedule=interleaved,chunks=2" "$at,schedule=zb-interleaved,chunks=2"
            "$at,schedule=zb-v,chunks=2")
  [ -n "$TOY" ] && variants=("$at,schedule=1f1b" "$at,schedule=zb-v,chunks=2")
  $PY -m bench.gpu_train --models "$BIG" --variants "${variants[@]}" "${TRAIN[@]}" \
    --global-batch $((8 * p))
}

if [ -n "${GPU_ALL_PART:-}" ]; then  # one part, in the process the loop below starts
  "part_$GPU_ALL_PART"
  exit $?
fi

failed=0
summary=()
for part in "${PARTS[@]}"; do
  start=$SECONDS
  echo "==== part $part ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu_all.log"
  # Each part in its own process group, ended after PART_TIMEOUT seconds whatever it does.
  GPU_ALL_PART=$part timeout -k 10 "$PART_TIMEOUT" bash "$0" ${TOY:+--toy} "$OUT" 2>&1 |
    if [ "$part" = env ]; then tee "$OUT/env.txt"; else cat; fi | tee -a "$OUT/gpu_all.log"
  status=$?
  [ $status -ne 0 ] && failed=$((failed + 1))
  case $status in
    0) result=ok ;;
    124|137) result="FAILED: timed out after $PART_TIMEOUT s" ;;
    *) result="FAILED, exit $status" ;;
  esac
  summary+=("$(printf '%-11s %s (%d s)' "$part" "$result" $((SECONDS - start)))")
done
{
  echo "==== summary"
  for results in "$OUT"/gpu_train_*.json; do
    [ -f "$results" ] && $PY -m bench.gpu_results "$results"
  done
  printf '%s\n' "${summary[@]}"
  echo "results in $OUT"
  echo "reproduce: bench/gpu_all.sh ${TOY:+--toy }OUT_DIR ${PARTS[*]}"
} | tee -a "$OUT/gpu_all.log"
exit $failed
