#!/bin/bash
# 79th session's GPU checks on one H200 (torch 2.11 and transformers 5.17 there): Phi-3's longrope,
# GPT-2 and Qwen3-MoE on CUDA against eager through train_step, the differentiable call and the
# torch.compile backend (Note [float sizes], a batch never a dim of module state); this session's
# CPU tests on that torch and transformers (call_leaf_name, the fixed-batch warning, Note
# [constant arguments]).
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
timeout 300 python benchmarks/gpu_check.py zoo --cases phi3_longrope,gpt2,qwen3_moe --out $OUT/zoo.json \
  2>&1 | grep -E "^(phi3_longrope|gpt2|qwen3_moe) |Error" | cut -c1-400
echo "zoo: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 240 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_parity.py tests/test_batching.py \
  tests/test_capture_lifetime.py tests/test_plan_text.py -k "backend or lifetime or static_batch or argument" \
  2>&1 | grep -E "passed|failed|^FAILED|^E " | head -30
echo "cpu tests: $(( $(date +%s) - t0 )) s"
# (a second call, at 9288bb8) a batched input written in place, on CUDA devices in fp32
# timeout 200 python benchmarks/runs/changes_gpu79/inplace.py
