#!/usr/bin/env bash
# Written for the 45th session, which ran it as its call 1 (RESULTS.md), 2 H200s (nvidia-h200-x2), from the repository root, carry [".ab"]:
# the 2-GPU bar's workload (Llama-3.1-8B, 65,536 tokens, M=4) from one tree twice, the harness reading the run's
# proportional set size every 5 s (its old default: smaps_rollup walks the page tables of the child and its
# workers) and then from the kernel's counters only (Note [host memory without a walk], benchmarks/harness.py).
# Each run from a host with its page cache dropped and memory compacted, as ab.sh now does. ~470 s.
#   OUT=$OUT bash benchmarks/runs/harness_walk/next_walk.sh [walk-first|counters-first]
# Then python benchmarks/runs/whole_share/show_share.py $OUT/walk.json $OUT/counters.json
set -euo pipefail
export PYTHONPATH=$PWD
fresh() {
  rm -rf /tmp/hw-inductor /tmp/hw-triton; export TORCHINDUCTOR_CACHE_DIR=/tmp/hw-inductor TRITON_CACHE_DIR=/tmp/hw-triton
  sync; { echo 3 > /proc/sys/vm/drop_caches && echo 1 > /proc/sys/vm/compact_memory && echo "$1: caches dropped"; } 2>/dev/null || echo "$1: caches kept"
  python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
}
args=(--model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 65536 --microbatches 4 --steps 8
      --systems rpcompile-delayed --record "$OUT/runs" --timeout 225 --budget 230 --out '' --log-dir /tmp/hw-logs)
side() {   # walk: the old default (a PSS reading every 5 s); counters: no walk
  fresh "$1"
  local extra=(); [ "$1" = walk ] && extra=(--pss-interval 5)
  python -m benchmarks.harness "${args[@]}" "${extra[@]}" --json "$OUT/$1.json" 2>&1 | grep '\[harness\]' | sed "s/^/$1: /"
}
# the order (an A/B's second side ran 16% slower on 2026-11-30): walk first unless told otherwise;
# a second call with `counters-first` tells order from walks
if [ "${1:-walk-first}" = counters-first ]; then side counters; side walk; else side walk; side counters; fi
