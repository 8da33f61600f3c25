#!/usr/bin/env bash
# 40th session: the 4-GPU load per device on 2 GPUs (32,768 tokens/step, M=2: one microbatch of
# 16,384 tokens per replica, as 4 replicas of 65,536 tokens at M=4), then 1 GPU (65,536, M=4).
export PYTHONPATH=$PWD
nvidia-smi topo -m | head -4
timeout 250 python -m benchmarks.harness --out '' --json $OUT/proxy.json --log-dir /tmp/logs --gpus 2 --systems rpcompile-delayed \
    --tokens-per-step 32768 --microbatches 2 --steps 24 --timeout 230 --budget 235 --option rpcompile_trace_dir=/tmp/trp > /tmp/p.log 2>&1
grep "\[harness\]" /tmp/p.log | tail -3
cp /tmp/trp/*2g.recent.json $OUT/proxy.recent.json 2>/dev/null
python .ab/gaps.py $OUT/proxy.recent.json | head -20
timeout 250 python -m benchmarks.harness --out '' --json $OUT/one.json --log-dir /tmp/logs --gpus 1 --systems rpcompile-delayed \
    --steps 8 --timeout 230 --budget 235 > /tmp/o.log 2>&1
grep "\[harness\]" /tmp/o.log | tail -3
python .ab/show.py $OUT/proxy.json $OUT/one.json
