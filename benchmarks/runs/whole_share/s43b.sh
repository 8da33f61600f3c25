#!/usr/bin/env bash
# 43rd session, call 2: the default plan (share 0.73) and a share of 1.0 on call 1's workload, traced: the last three
# steps' spans (rpcompile_trace_dir) and the optimizer thread's chunk waits and steps (.ab/instr/sitecustomize.py).
O=$OUT
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
for share in default 1.0; do
  opt=(); [ "$share" = default ] || opt=(--option rpcompile_optimizer_on_devices=$share)
  rm -rf trace; mkdir -p $O/$share
  RP_CHUNKS=$O/$share/chunks PYTHONPATH=$PWD/.ab/instr:$PWD python -m benchmarks.harness --model llama3.1-8b --gpus 2 \
      --seq-len 2048 --tokens-per-step 32768 --microbatches 2 --steps 8 --out '' --systems rpcompile-delayed "${opt[@]}" \
      --option rpcompile_trace_dir=trace --json $O/$share/r.json --log-dir /tmp/logs-t$share --timeout 170 --budget 173 2>&1 | grep "\[harness\]"
  cp trace/*2g.recent.json $O/$share/recent.json
  python .ab/show_share.py $O/$share/r.json | head -3
  ls $O/$share
done
