#!/usr/bin/env bash
# 52nd session (README.md, "A 4-GPU copy's load on 2 GPUs"): Llama-3.1-8B on 2 H200s at a 4-GPU run's
# load a GPU (32,768 tokens) with the optimizer share each device would keep at 4 GPUs (0.5 of the
# update on the devices: a quarter of it on each, as the whole on each of 4), so a copy's plan is the
# 4-GPU plan's: M=2 three jobs (fused layers 17-31, job 0 recomputed) as 4 GPUs at M=4, M=8 one fused
# job of 4 microbatches of 2 rows as 4 GPUs at M=16. The host steps the other half of the update,
# so it may set the step's pace: read the GPUs' compute and their trace.
#   OUT=$OUT bash benchmarks/runs/microbatches/share_proxy.sh tree:2 tree:8     (call 1 ran the script's first form, alike)
#   OUT=$OUT bash benchmarks/runs/microbatches/share_proxy.sh main:2 tree:2 main:2 tree:2   (call 2, carry .ab:
#   a side NAME:M runs .ab/NAME, or the working tree for "tree", at M microbatches: exactly M, as
#   rpcompile_split_microbatches=0 keeps the default from splitting finer (55th session: without it
#   "tree:2" ran M=8, README.md); so a side's revision needs Config.split_microbatches (1b2c678 on)
set -euo pipefail
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
n=0
for side in "$@"; do
  n=$((n + 1)); tree=${side%%:*}; m=${side#*:}; name=$n-$tree-m$m
  dir=$PWD; [ "$tree" = tree ] || dir=$PWD/.ab/$tree
  side_reset "$name"
  (cd "$dir" && PYTHONPATH=$PWD python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 \
    --tokens-per-step 32768 --steps 8 --systems rpcompile-delayed --microbatches "$m" \
    --option rpcompile_optimizer_on_devices=0.5 --option rpcompile_split_microbatches=0 \
    --option "rpcompile_trace_dir=/tmp/trace-$name" \
    --record "$OUT/runs" --timeout 285 --budget 290 --out '' --json "/tmp/$name.json" --log-dir /tmp/hw-logs 2>&1 \
    | grep '\[harness\]' | sed "s/^/$name: /") || true
  f=$(ls /tmp/trace-$name/*.json 2>/dev/null | grep chrome | grep -v recent | head -1) && [ -n "$f" ] && cp "$f" "$OUT/trace-$name.json" || true
  # the last three steps with the optimizer's work on the devices (Note [optimizer spans])
  f=$(ls /tmp/trace-$name/*recent.chrome.json 2>/dev/null | head -1) && [ -n "$f" ] && cp "$f" "$OUT/recent-$name.json" || true
done
