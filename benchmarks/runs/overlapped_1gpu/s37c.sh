#!/usr/bin/env bash
# s37 call 5: why overlapped trails exact on one GPU: benchmarks.diagnose, Qwen3-1.7B, 1 GPU,
# every update on the host (diagnose's optimizer_on_devices=0), base and no_optimizer, both modes
export PYTHONPATH=$PWD
for mode in exact overlapped; do
  mkdir -p $OUT/$mode
  timeout 250 python -m benchmarks.diagnose --model qwen3-1.7b --gpus 1 --mode $mode --variants base,no_optimizer --steps 6 --out $OUT/$mode > $OUT/$mode/log.txt 2>&1
  echo "$mode rc=$?"; grep -E "^== |warm-up|estimated step" $OUT/$mode/log.txt
  rm -f $OUT/$mode/base_trace.json
done
