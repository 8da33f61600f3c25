#!/usr/bin/env bash
# 43rd session, call 3: the default plan after "the whole update first" (Note [optimizer share by pace]) on call 1's
# workload (Llama-3.1-8B, 32,768 tokens, M=2: share 1.0 expected); then the 2-GPU bar's workload (65,536, M=4),
# the default (share 0) against a share of 1.0 set.
O=$OUT
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
run() {   # name tokens M [share]
  opt=(); [ -n "$4" ] && opt=(--option rpcompile_optimizer_on_devices=$4)
  python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step $2 --microbatches $3 \
      --steps 8 --out '' --systems rpcompile-delayed "${opt[@]}" --json $O/$1.json --record $O/runs \
      --log-dir /tmp/logs-$1 --timeout 175 --budget 178 2>&1 | grep "\[harness\]"
  python .ab/show_share.py $O/$1.json | head -5
}
run proxy_default 32768 2
run bar_default 65536 4
run bar_share1 65536 4 1.0
