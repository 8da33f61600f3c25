#!/bin/bash
# The third call, on nvidia-h200-x2 (lent late in the session): the tiny-Qwen3 parity on two GPUs
# at the session's head. The first command ran past its 260 s bound (no JSON); the second wrote
# out/parity_dp_x2.json.
export PYTHONPATH=$PWD:$PWD/tests; nvidia-smi -L
timeout 260 python benchmarks/gpu_check.py parity --out $OUT/parity.json 2>&1 | grep -v Warning | tail -4
timeout 230 python benchmarks/gpu_check.py parity --workers processes --data-parallel --budget 4GiB \
  --out $OUT/parity_dp.json 2>&1 | grep -v Warning | tail -3
