#!/usr/bin/env bash
# 56th session (README.md): how fast a GPU runs a 4-GPU Llama-3.1-8B plan's microbatches (2 rows of
# 2048: M=16 at 65,536 tokens over 4 copies) against the cost model, on one H200, whose 128 GiB host
# cannot hold Llama-3.1-8B but holds its first 16 layers (llama3.1-8b-16l, 4.5B parameters). Sides M,
# each 16,384 tokens a step (a 4-GPU run's share of one GPU), the whole update on the GPU, traced:
#   OUT=$OUT bash benchmarks/runs/two_row_microbatches/probe.sh 4 2     (2 rows a microbatch; 4 rows)
set -euo pipefail
source benchmarks/side_reset.sh
MODEL=${MODEL:-llama3.1-8b-16l}; TOKENS=${TOKENS:-16384}
for m in "$@"; do
  name=m$m
  side_reset "$name"
  PYTHONPATH=$PWD python -m benchmarks.harness --model "$MODEL" --gpus 1 --seq-len 2048 \
    --tokens-per-step "$TOKENS" --microbatches "$m" --steps 8 --systems rpcompile-delayed \
    --option rpcompile_split_microbatches=0 --option rpcompile_optimizer_on_devices=1.0 \
    --option "rpcompile_trace_dir=/tmp/trace-$name" \
    --record "$OUT/runs" --timeout 280 --budget 280 --out '' --json "/tmp/$name.json" --log-dir /tmp/hw-logs 2>&1 \
    | grep '\[harness\]' | sed "s/^/$name: /" || true
  f=$(ls /tmp/trace-$name/*recent.json 2>/dev/null | head -1) && [ -n "$f" ] && cp "$f" "$OUT/recent-$name.json" || true
done
