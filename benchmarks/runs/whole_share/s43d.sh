#!/usr/bin/env bash
# 43rd session, call 4: the default plan on call 1's workload (the whole update on the devices), traced, with
# .ab/instr2/sitecustomize.py: when each worker sends "ended" and "landed", when the main process receives
# "landed", and the optimizer thread's chunk waits, all on the host clock.
O=$OUT
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
rm -rf trace; mkdir -p $O/p
RP_PROBE=$O/p PYTHONPATH=$PWD/.ab/instr2:$PWD python -m benchmarks.harness --model llama3.1-8b --gpus 2 \
    --seq-len 2048 --tokens-per-step 32768 --microbatches 2 --steps 8 --out '' --systems rpcompile-delayed \
    --option rpcompile_trace_dir=trace --json $O/r.json --log-dir /tmp/logs-p --timeout 215 --budget 218 2>&1 | grep "\[harness\]"
cp trace/*2g.recent.json $O/recent.json
PYTHONPATH=$PWD python .ab/show_share.py $O/r.json | head -4
ls $O/p | wc -l
