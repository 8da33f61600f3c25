#!/usr/bin/env bash
# Harness sides one after another on a lent machine, each from its own empty compile caches and a
# dropped page cache (side_reset.sh), traced: the harness's result lines, and the last three steps'
# spans (the optimizer's work on the devices included, Note [optimizer spans]) as
# $OUT/recent-N-SYSTEM.json, which `python -m benchmarks.beside_optimizer` reads.
#
#   MODEL=qwen3-1.7b GPUS=1 TOKENS=65536 OUT=$OUT bash benchmarks/sides.sh SIDE [SIDE ...]
#   (DEVICE=cpu SEQ=64 MODEL=tiny TOKENS=256 try it without a GPU)
#
# A side is SYSTEM[,KEY=VALUE...]: a harness system and its --option pairs, where M=N asks for N
# microbatches (default 4), e.g. rpcompile-delayed,rpcompile_processes=1,rpcompile_optimizer_on_devices=1.0
set -euo pipefail
source benchmarks/side_reset.sh
MODEL=${MODEL:-qwen3-1.7b}; GPUS=${GPUS:-1}; TOKENS=${TOKENS:-65536}; TIMEOUT=${TIMEOUT:-280}
DEVICE=${DEVICE:-cuda}; SEQ=${SEQ:-2048}
n=0
for side in "$@"; do
  n=$((n + 1)); IFS=, read -r -a parts <<< "$side"; system=${parts[0]}; m=4; options=()
  for kv in "${parts[@]:1}"; do
    case $kv in M=*) m=${kv#M=} ;; *) options+=(--option "$kv") ;; esac
  done
  name=$n-$system
  side_reset "$name"
  PYTHONPATH=$PWD python -m benchmarks.harness --model "$MODEL" --gpus "$GPUS" --device "$DEVICE" --seq-len "$SEQ" \
    --tokens-per-step "$TOKENS" --microbatches "$m" --steps 8 --systems "$system" "${options[@]}" \
    --option "rpcompile_trace_dir=/tmp/trace-$name" \
    --record "$OUT/runs" --timeout "$TIMEOUT" --budget "$TIMEOUT" --out '' --json "/tmp/$name.json" \
    --log-dir /tmp/hw-logs 2>&1 | grep '\[harness\]' | sed "s/^/$name: /" || true
  f=$(ls /tmp/trace-$name/*recent.json 2>/dev/null | head -1) && [ -n "$f" ] && cp "$f" "$OUT/recent-$name.json" || true
done
