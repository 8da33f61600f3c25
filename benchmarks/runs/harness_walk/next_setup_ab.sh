#!/usr/bin/env bash
# Written for the 45th session, which ran it as its call 2 (RESULTS.md), 2 H200s, from the repository root after `bash benchmarks/ab.sh prepare 6f8bec3`
# here; carry [".carry", ".ab"]. 6f8bec3 against the tree on the 2-GPU bar's workload: the tree's shared files are
# touched before the workers pin them (Note [shared files touched before pinning], runtime/shared.py; the workers'
# "gradients mapped" took 10.3 s and the main process's "working copies made" 8.6 s on 2026-11-30), each worker
# dry-runs its programs (replicas: the whole chain's) while the main process makes them (Note [first programs compiled beside the setup],
# runtime/dry_run.py: the first "dry run of" marks should come before "working copies made"), and its harness
# walks no page tables (the base side's walks every 5 s: next_walk.sh tells that part apart). Read the setup
# timelines' marks (info.setup_timeline, marks.py) of both sides. ~470 s.
#   OUT=$OUT bash benchmarks/runs/harness_walk/next_setup_ab.sh
set -euo pipefail
bash benchmarks/ab.sh run 6f8bec3 --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 65536 \
  --microbatches 4 --steps 8 --systems rpcompile-delayed --record "$OUT/runs" --timeout 225 --budget 230
