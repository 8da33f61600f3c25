#!/usr/bin/env bash
# 44th session, call 4 (ceee8d0 + nothing else in rpcompile; 2 H200s): the 2-GPU bar's workload from the working
# tree alone, on a fresh machine, with `top -H` sampled six times during the timed steps (top.txt): the harness's
# smaps_rollup walks (then every 5 s) took its polling thread ~2 CPU-s of each 5 (Note [host memory without a walk]
# in benchmarks/harness.py, which stops them).
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" >/dev/null 2>&1
(sleep 160; for i in 1 2 3 4 5 6; do top -b -n 2 -d 2 -H -w 220 | awk '/^top -/{n++} n==2' | head -32; sleep 3; done > $OUT/top.txt 2>&1) &
python -m benchmarks.harness --out '' --json $OUT/tree.json --log-dir /tmp/ab-logs --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8 --systems rpcompile-delayed --record $OUT/runs --timeout 235 --budget 240 2>&1 | grep harness
wait
