#!/usr/bin/env bash
# 42nd session: Llama-3.1-8B at a 4-GPU run's load per GPU on 2 GPUs (32,768 tokens, M=2: one microbatch a copy),
# the default plan (the optimizer's device share chosen by room) against a share of 0.5 set (the plan re-cut
# around it): does the host optimizer set the pace there, and does a device share take it off?
O=$OUT
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
for share in default 0.5; do
  opt=(); [ "$share" = default ] || opt=(--option rpcompile_optimizer_on_devices=$share)
  python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 32768 --microbatches 2 \
      --steps 10 --out '' --systems rpcompile-delayed "${opt[@]}" --json $O/share_$share.json --record $O/runs \
      --log-dir /tmp/logs-$share --timeout 250 --budget 255 2>&1 | grep "\[harness\]"
  python benchmarks/runs/whole_share/show_share.py $O/share_$share.json   # (its printer, written here first)
done
