#!/usr/bin/env bash
# Harness sides of the working tree that differ only in --microbatches, in the order given, each from
# empty compile caches and a host with its page cache dropped (benchmarks/side_reset.sh), rpcompile-delayed
# alone. For the next device call (carry [".carry"]):
#   GPUS=4 OUT=$OUT bash benchmarks/runs/microbatches/sides.sh llama3.1-8b 4 16 4 16
#   GPUS=1 OUT=$OUT bash benchmarks/runs/microbatches/sides.sh llama3.1-8b 4 8
#   GPUS=2 TOKENS=32768 OUT=$OUT bash benchmarks/runs/microbatches/sides.sh llama3.1-8b 2 8 2 8   (a 4-GPU run's load per GPU)
# Each side writes $OUT/<n>-m<M>.json (a run file benchmarks.bar reads as it is) and, with TRACE=1, the
# last step's spans $OUT/tr-<n>/rpcompile-delayed_<G>g.json (benchmarks/trace_hops.py), nothing more:
# a call returns at most 8 files.
set -euo pipefail
model=${1:?model}; shift
gpus=${GPUS:-4}; tokens=${TOKENS:-65536}
limit=${LIMIT:-}; [ -n "$limit" ] || { limit=140; [ "$model" = llama3.1-8b ] && limit=$((gpus == 1 ? 250 : 160)); }
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
n=0
for m in "$@"; do
  n=$((n + 1)); opts=()
  [ "${TRACE:-0}" = 1 ] && opts=(--option "rpcompile_trace_dir=$OUT/tr-$n")
  side_reset "$n-m$m"
  PYTHONPATH=$PWD python -m benchmarks.harness --model "$model" --gpus "$gpus" --seq-len 2048 --tokens-per-step "$tokens" \
      --microbatches "$m" --steps 8 --systems rpcompile-delayed --timeout "$limit" --budget $((limit + 5)) --out '' \
      --log-dir /tmp/mb-logs "${opts[@]}" --json "$OUT/$n-m$m.json" 2>&1 | grep '\[harness\]\|^| rpc' | sed "s/^/$n M=$m: /"
  rm -f "$OUT/tr-$n"/*.chrome.json "$OUT/tr-$n"/*.recent.json 2>/dev/null || true
done
