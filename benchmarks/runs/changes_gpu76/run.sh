#!/bin/bash
# 76th session's GPU checks on one H200: gpu_check changes (threads, processes) with the buffer
# updated then read, and gpu_check trainer (RPTrainer on CUDA devices against eager Trainer).
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
timeout 240 python benchmarks/gpu_check.py changes --workers threads --out $OUT/changes_threads.json 2>&1 | grep -v Warning | tail -12
timeout 200 python benchmarks/gpu_check.py changes --workers processes --out $OUT/changes_processes.json 2>&1 | grep -v Warning | tail -12
timeout 120 python benchmarks/gpu_check.py trainer --out $OUT/trainer.json 2>&1 | grep -v Warning | tail -12
