#!/usr/bin/env bash
# 56th session (README.md): does the update's share on a device slow the jobs when the main process
# steps it in a second CUDA context (worker processes) and not when it shares the workers' context
# (worker threads)? Qwen3-1.7B on one GPU, 65,536 tokens, the whole update on the device (share 1.0:
# 1.7B elements a device, as each of 4 GPUs steps a quarter of Llama-3.1-8B's), traced.
#   OUT=$OUT bash benchmarks/runs/optimizer_context/probe.sh threads:1.0 processes:1.0 processes:0
# A side WORKERS:SHARE; each from empty compile caches; the last three steps' spans (the
# optimizer's included, Note [optimizer spans]) kept as $OUT/recent-N-WORKERS-SHARE.json.
set -euo pipefail
source benchmarks/side_reset.sh
MODEL=${MODEL:-qwen3-1.7b}; GPUS=${GPUS:-1}; TOKENS=${TOKENS:-65536}
n=0
for side in "$@"; do
  n=$((n + 1)); workers=${side%%:*}; share=${side#*:}; name=$n-$workers-$share
  side_reset "$name"
  PYTHONPATH=$PWD python -m benchmarks.harness --model "$MODEL" --gpus "$GPUS" --seq-len 2048 \
    --tokens-per-step "$TOKENS" --steps 8 --systems rpcompile-delayed \
    --option "rpcompile_$workers=1" --option "rpcompile_optimizer_on_devices=$share" \
    --option "rpcompile_trace_dir=/tmp/trace-$name" \
    --record "$OUT/runs" --timeout 200 --budget 200 --out '' --json "/tmp/$name.json" --log-dir /tmp/hw-logs 2>&1 \
    | grep '\[harness\]' | sed "s/^/$name: /" || true
  f=$(ls /tmp/trace-$name/*recent.json 2>/dev/null | head -1) && [ -n "$f" ] && cp "$f" "$OUT/recent-$name.json" || true
  python benchmarks/runs/optimizer_context/spans.py "/tmp/trace-$name"/*recent.json 2>&1 | sed "s/^/$name: /" || true
done
