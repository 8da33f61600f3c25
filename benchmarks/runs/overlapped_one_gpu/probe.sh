#!/usr/bin/env bash
# 56th session (README.md): on one GPU overlapped mode (exact results) ran 5-7% slower than exact mode
# (Qwen3-1.7B and Llama-3.1-8B, RESULTS.md). Is it the optimizer thread and the worker thread sharing
# one interpreter (the worker launches the kernels)? Sides SYSTEM:WORKERS, one GPU, Qwen3-1.7B:
#   OUT=$OUT bash benchmarks/runs/overlapped_one_gpu/probe.sh rpcompile:threads rpcompile-overlapped:threads \
#       rpcompile-overlapped:processes
# each from empty compile caches, traced (the last three steps: $OUT/recent-N-SYSTEM-WORKERS.json).
set -euo pipefail
source benchmarks/side_reset.sh
MODEL=${MODEL:-qwen3-1.7b}; GPUS=${GPUS:-1}; TOKENS=${TOKENS:-65536}
n=0
for side in "$@"; do
  n=$((n + 1)); system=${side%%:*}; workers=${side#*:}; name=$n-$system-$workers
  side_reset "$name"
  PYTHONPATH=$PWD python -m benchmarks.harness --model "$MODEL" --gpus "$GPUS" --seq-len 2048 \
    --tokens-per-step "$TOKENS" --steps 8 --systems "$system" --option "rpcompile_$workers=1" \
    --option "rpcompile_trace_dir=/tmp/trace-$name" \
    --record "$OUT/runs" --timeout 200 --budget 200 --out '' --json "/tmp/$name.json" --log-dir /tmp/hw-logs 2>&1 \
    | grep '\[harness\]' | sed "s/^/$name: /" || true
  f=$(ls /tmp/trace-$name/*recent.json 2>/dev/null | head -1) && [ -n "$f" ] && cp "$f" "$OUT/recent-$name.json" || true
done
