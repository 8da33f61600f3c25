#!/usr/bin/env bash
# 43rd session, call 1: Llama-3.1-8B at 32,768 tokens, M=2 on 2 GPUs (a 4-GPU run's load per GPU): the default
# plan (Note [optimizer share by pace] chooses the share) against shares of 1.0 and 0.5 set, one run each.
O=$OUT
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
for share in default 1.0 0.5; do
  opt=(); [ "$share" = default ] || opt=(--option rpcompile_optimizer_on_devices=$share)
  t=165; [ "$share" = default ] && t=190
  python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 32768 --microbatches 2 \
      --steps 8 --out '' --systems rpcompile-delayed "${opt[@]}" --json $O/share_$share.json --record $O/runs \
      --log-dir /tmp/logs-$share --timeout $t --budget $((t+3)) 2>&1 | grep "\[harness\]"
  python .ab/show_share.py $O/share_$share.json
done
