#!/usr/bin/env bash
# 34th session: cuda_first, then the 2-proc proxy ABBA f90e1d8 / tree (prepare)
SPECS=("$@")
export OUT=${OUT:-/tmp/out}
PYTHONPATH=$PWD timeout 120 python .ab/cuda_first.py cuda:0 2>&1 | grep -v Warn | tail -30
[ ${#SPECS[@]} -eq 0 ] 2>/dev/null && SPECS=("a f90e1d8" "a tree" "b tree" "b f90e1d8")
for spec in "${SPECS[@]}"; do
  set -- $spec
  TAG=$1 OPT_ON_DEV=1.0 TMO=200 bash .ab/fs.sh 2 50 5 $2 > /dev/null 2>&1
  f=$OUT/fs_$2_2$1.log
  echo "=== $2 $1"; grep -h '"steps_s"' $f | python -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['steps_s'], d['first4_s'], d['host_used_peak_gib'])"
  grep -h "^opt timings" $f; grep -h "optimizer step done\|ready for the first\|train_step returned" $f | head -8
done
