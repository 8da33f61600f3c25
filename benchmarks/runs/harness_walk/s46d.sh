#!/usr/bin/env bash
# 46th session, call 4 (2 H200s, host only, ~150 s): the host AdamW's widen probe (WIDEN 2^26, rpcompile's) at
# 32, 24, 16 and 8 intra-op threads, twice round, with the host's CPU seconds (/proc/stat) over each: whether the
# update needs every core (the workers need some at 4 GPUs), and whether the steal that slowed call 3's second
# side (105.7 CPU-s over its timed steps, against 0.7-2.4 in the other runs) comes with a full host.
set -uo pipefail
export PYTHONPATH=$PWD
stat() { awk '/^cpu /{print $2+$3, $4, $5, $9}' /proc/stat; }     # user+nice system idle steal (ticks)
for round in 1 2; do
  for t in 32 24 16 8; do
    before=$(stat)
    r=$(OMP_NUM_THREADS=$t python -m benchmarks.widen_probe --params 2e9 --widen 26 --reps 4 2>&1 | grep '^WIDEN')
    after=$(stat)
    echo "round $round threads $t: $r | cpu s user/sys/idle/steal: $(paste <(echo $before | tr ' ' '\n') <(echo $after | tr ' ' '\n') | awk '{printf "%.1f ", ($2-$1)/100}')"
  done
done
