#!/usr/bin/env bash
# first steps: bash .ab/fs.sh NPROCS BUDGET STEPS NAME... (names under .ab or "tree"), each with its own empty caches
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
n=$1; b=$2; s=$3; shift 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
for name in "$@"; do
  t=$(date +%s); dir=$PWD; [ "$name" != tree ] && dir=$PWD/.ab/$name
  (cd $dir && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_${name}_$n${TAG:-} TRITON_CACHE_DIR=/tmp/tri_${name}_$n${TAG:-} PYTHONPATH=$dir timeout ${TMO:-500} \
     python $OLDPWD/.ab/first_steps.py $n $b $s $OUT/fs_${name}_$n${TAG:-}.json > $OUT/fs_${name}_$n${TAG:-}.log 2>&1)
  echo "== $name n=$n rc=$? $(( $(date +%s) - t )) s"
  head -c 3000 $OUT/fs_${name}_$n${TAG:-}.log | grep -v Warning
  grep -h "Error\|Traceback" $OUT/fs_${name}_$n${TAG:-}.log | head -3
done
