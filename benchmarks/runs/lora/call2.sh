#!/usr/bin/env bash
# 73rd session, call 2 (one H200, carry [".carry"]): LoRA on the GPU with Note [linear on rows]:
# gpu_check's LoRA parity case (torch 2.11: any "could not measure" warning counted), then
# Llama-3.1-8B with LoRA r=32 on every linear layer, rpcompile-delayed beside RoundPipe.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/tests
mkdir -p "$OUT/l"
python -m benchmarks.gpu_check users --cases lora --out "$OUT/l/users_lora.json" > /tmp/users.log 2>&1
echo "users rc=$? could-not-measure=$(grep -c 'could not measure' /tmp/users.log)"; tail -c 600 /tmp/users.log
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
args=(--model llama3.1-8b --gpus 1 --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8
      --option lora=32 --out '' --log-dir /tmp/l-logs)
for s in rpcompile-delayed:250 roundpipe:230; do
  side_reset "${s%%:*}"
  python -m benchmarks.harness "${args[@]}" --systems "${s%%:*}" --json "$OUT/l/${s%%:*}.json" \
      --timeout "${s##*:}" --budget $(( ${s##*:} + 5 )) > "$OUT/l/${s%%:*}.log" 2>&1
  grep '\[harness\]' "$OUT/l/${s%%:*}.log"
done
grep -h "could not measure" /tmp/l-logs/*.err | head -3 | cut -c1-300
