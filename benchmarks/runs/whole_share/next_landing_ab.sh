#!/usr/bin/env bash
# For the 44th session (not run yet): Note [spans of a landing] (ceee8d0) A/B against 1493ffe on 2 H200s,
# Llama-3.1-8B. Here first: bash benchmarks/ab.sh prepare 1493ffe; carry [".carry", ".ab"]. Two calls:
#   call A: bash benchmarks/runs/whole_share/next_landing_ab.sh mixed   (~320 s: a share of 0.73 set at 32,768/M=2,
#           where the host's part of every chunk waited for late landings; 14,811 tokens/s on 2026-11-30)
#   call B: bash benchmarks/runs/whole_share/next_landing_ab.sh bar     (~360 s: the 2-GPU bar's workload, share 0,
#           the host's update beside the jobs; 20,338 tokens/s on 2026-11-30)
# Then python benchmarks/runs/whole_share/show_share.py $OUT/ab/*.json for each side.
# 44th session: the first call (timeouts 150/153 s) timed out on both sides: from ab.sh's empty caches
# the first step compiled for 66-76 s and the second took 15.6 s (setup 43 s); timeouts raised to 235 s.
set -euo pipefail
case "${1:?mixed or bar}" in
  mixed) bash benchmarks/ab.sh run 1493ffe --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 32768 \
           --microbatches 2 --steps 8 --systems rpcompile-delayed --option rpcompile_optimizer_on_devices=0.734375 \
           --record $OUT/runs --timeout 235 --budget 240 ;;
  bar)   bash benchmarks/ab.sh run 1493ffe --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 65536 \
           --microbatches 4 --steps 8 --systems rpcompile-delayed --record $OUT/runs --timeout 235 --budget 240 ;;
esac
