#!/bin/bash
# 82nd session's GPU check on one H200: a model of one-piece programs (no repeated blocks) in two
# worker processes (cuda:0 twice, compiled stages), through the backend with an int argument,
# 6 runs with their full output kept: each equals eager, and none prints "Both events must be
# completed" (the clock event read before it was done: seen once in three runs before the fix).
# First queues.py: which of a worker's streams wait behind another's work (hardware queues).
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python benchmarks/runs/changes_gpu82/queues.py 2>&1 | tail -2
CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/runs/changes_gpu82/queues.py 2>&1 | tail -2
for i in 1 2 3 4 5 6; do
  t0=$(date +%s)
  timeout 120 python benchmarks/runs/changes_gpu80/intarg.py > ${OUT:-/tmp}/intarg$i.log 2>&1
  echo "run $i rc $? in $(( $(date +%s) - t0 )) s: $(grep -h '^intarg' ${OUT:-/tmp}/intarg$i.log)," \
       "'Both events' lines $(grep -c 'Both events' ${OUT:-/tmp}/intarg$i.log)"
done
timeout 200 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_trace.py tests/test_compile_once.py 2>&1 | tail -1
