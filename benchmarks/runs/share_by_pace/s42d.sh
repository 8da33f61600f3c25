#!/usr/bin/env bash
# 42nd session: the default plan with Note [optimizer share by pace] on the 4-GPU Llama proxy of call 4 (2 GPUs,
# Llama-3.1-8B, 32,768 tokens, M=2): which share does the plan take, and its tokens/s (call 4: share 0 10,828,
# share 0.5 set 16,284).
O=$OUT
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 32768 --microbatches 2 \
    --steps 8 --out '' --systems rpcompile-delayed --json $O/pace.json --record $O/runs \
    --log-dir /tmp/logs-pace --timeout 175 --budget 178 2>&1 | grep "\[harness\]"
python benchmarks/runs/whole_share/show_share.py $O/pace.json   # (the printer of s42c.sh)
