#!/usr/bin/env bash
# The 46th session's call 1 (ran 2026-11-30 15:41 UTC: RESULTS.md), 2 H200s (nvidia-h200-x2), from the repository root, carry [".carry"]; ~500 s.
# 1. benchmarks/widen_probe.py on the host alone (~60 s, CPU only): the host AdamW over 2.1B Llama-shaped elements
#    with bf16 gradients at each widening slice, 2^26 (rpcompile's) down to 2^21, in turn (on the 2-core sandbox
#    2^22 stepped 15% faster than 2^26: 0.372 against 0.436 s for 1.31B elements; that host's figures are not a
#    GPU host's). A smaller slice means more calls, each of which may wait for the interpreter lock (Note [few
#    calls per step]): if one is faster here, A/B it at 1 GPU too (worker threads), not only at 2 (processes).
# 2. The 2-GPU bar's workload from the tree twice (s45c.sh), now recording the optimizer's cpu_s / switched and
#    the host's CPU seconds over the timed steps: whether a side whose update steps 2.5-2.6 s (not 2.0-2.1 s)
#    lost cores or ran them slower.
#   OUT=$OUT bash benchmarks/runs/harness_walk/next_host.sh
# Then: cat $OUT/widen.txt; python benchmarks/runs/whole_share/show_share.py $OUT/*-tree.json;
#       python benchmarks/runs/harness_walk/marks.py $OUT/*-tree.json
set -euo pipefail
export PYTHONPATH=$PWD
python -m benchmarks.widen_probe --params 2e9 --reps 5 > "$OUT/widen.txt" 2>&1 || true
tail -8 "$OUT/widen.txt"
bash benchmarks/runs/harness_walk/s45c.sh llama3.1-8b tree tree
