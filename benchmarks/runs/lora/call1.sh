#!/usr/bin/env bash
# 73rd session, call 1 (one H200, carry [".carry", ".ab"]; .ab/nofix = 87265d5 with rpcompile/passes/cost.py
# of 795226d~1, before Note [linear on rows]): Qwen3-1.7B with LoRA r=32 on every linear layer
# (--option lora=32), rpcompile-delayed without and with the cost fix (ab.sh: nofix first), then RoundPipe.
set -uo pipefail
export PYTHONPATH=$PWD
args=(--model qwen3-1.7b --gpus 1 --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8
      --option lora=32 --record "$OUT/runs")
bash benchmarks/ab.sh run nofix "${args[@]}" --systems rpcompile-delayed --timeout 170 --budget 175
python -m benchmarks.harness "${args[@]}" --systems roundpipe --out '' --json "$OUT/ab/roundpipe.json" \
    --log-dir /tmp/ab-logs --timeout 200 --budget 205 > "$OUT/ab/roundpipe.log" 2>&1 || true
grep '\[harness\]' "$OUT/ab/roundpipe.log" | sed 's/^/roundpipe: /'
for f in /tmp/ab-logs/*; do echo "== $f"; tail -c 1500 "$f"; done > "$OUT/ab/logs_tail.txt" 2>&1
