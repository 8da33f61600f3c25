#!/usr/bin/env bash
# 74th session, call 1 (one H200, carry [".carry"]): full fine-tuning of a mixture of experts beside
# RoundPipe (its Qwen3-MoE preset): Qwen3-30B-A3B's layers, 6 of 48 (model qwen3-30b-a3b-6l, 4.4B
# parameters, 0.96B active a token), seq 2048, 65,536 tokens a step, M=4, each side from empty caches.
set -uo pipefail
export PYTHONPATH=$PWD
mkdir -p "$OUT/m"
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
args=(--model qwen3-30b-a3b-6l --gpus 1 --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8
      --out '' --log-dir /tmp/m-logs)
for s in rpcompile-delayed:250 roundpipe:250; do
  side_reset "${s%%:*}"
  python -m benchmarks.harness "${args[@]}" --systems "${s%%:*}" --json "$OUT/m/${s%%:*}.json" \
      --timeout "${s##*:}" --budget $(( ${s##*:} + 5 )) > "$OUT/m/${s%%:*}.log" 2>&1
  grep '\[harness\]' "$OUT/m/${s%%:*}.log"
done
for f in /tmp/m-logs/*; do echo "== $f"; tail -c 2500 "$f"; done > "$OUT/m/logs_tail.txt" 2>&1
grep -h "could not measure\|Warning" /tmp/m-logs/*.err | sort | uniq -c | head -8 | cut -c1-300
