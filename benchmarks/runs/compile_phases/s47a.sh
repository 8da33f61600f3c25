#!/usr/bin/env bash
# 47th session (2 H200s, carry [".carry"]): Qwen3-1.7B harness sides of the working tree, in the order given, each
# from empty compile caches and a host with its page cache dropped (benchmarks/side_reset.sh). A side is NAME or
# NAME=JSON: JSON is the Inductor options the side's Config gets (harness --option rpcompile_inductor=JSON).
#   OUT=$OUT bash benchmarks/runs/compile_phases/s47a.sh default 'autotune0={"triton.autotune_pointwise": false}'
set -euo pipefail
model=${MODEL:-qwen3-1.7b}; gpus=${GPUS:-2}
limit=125; [ "$model" = llama3.1-8b ] && limit=225; [ "$gpus" = 2 ] || limit=$((limit + 60))
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
args=(--model "$model" --gpus $gpus --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8
      --systems rpcompile-delayed --record "$OUT/runs" --timeout $limit --budget $((limit + 5)) --out '' --log-dir /tmp/hw-logs)
n=0
for side in "$@"; do
  n=$((n + 1)); name=${side%%=*}; opts=()
  [ "$name" = "$side" ] || opts=(--option "rpcompile_inductor=${side#*=}")
  side_reset "$n-$name"
  PYTHONPATH=$PWD python -m benchmarks.harness "${args[@]}" "${opts[@]}" --json "$OUT/$n-$name.json" 2>&1 \
    | grep '\[harness\]' | sed "s/^/$n $name: /"
done
