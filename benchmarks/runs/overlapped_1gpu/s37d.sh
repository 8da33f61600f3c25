#!/usr/bin/env bash
# s37 call 6: overlapped mode on one GPU with the optimizer thread's intra-op threads limited
export PYTHONPATH=$PWD
mkdir -p $OUT/ov
timeout 280 python -m benchmarks.diagnose --model qwen3-1.7b --gpus 1 --mode overlapped --variants base,opt_threads_2,opt_threads_4,opt_threads_8 --steps 6 --out $OUT/ov > $OUT/ov/log.txt 2>&1
echo "rc=$?"; grep -E "^== |warm-up" $OUT/ov/log.txt; rm -f $OUT/ov/base_trace.json
