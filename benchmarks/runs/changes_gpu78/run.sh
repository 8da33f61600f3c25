#!/bin/bash
# 78th session's GPU checks on one H200 (torch 2.11 and transformers 5.17 there): zoo families on
# CUDA against eager through train_step, the differentiable call and the torch.compile backend
# (CTRL's no-op buffer assignment, Gemma 3 and PaliGemma with images, GPT-2 and Qwen3-MoE through
# the backend); RPTrainer with a training_step of its own; this session's CPU tests on that
# torch and transformers.
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
timeout 330 python benchmarks/gpu_check.py zoo --cases ctrl,gemma3_vlm,paligemma,gpt2,qwen3_moe --out $OUT/zoo.json \
  2>&1 | grep -E "^(ctrl|gemma3_vlm|paligemma|gpt2|qwen3_moe) " | cut -c1-400
echo "zoo: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python benchmarks/gpu_check.py trainer --out $OUT/trainer.json 2>&1 | grep -v Warning | tail -3 | cut -c1-1500
echo "trainer: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 330 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_vlm.py tests/test_capture_lifetime.py \
  tests/test_parity.py tests/test_capture.py tests/test_trainer.py tests/test_zoo.py \
  -k "test_vlm or lifetime or backend or sums_over_rows or assigned_anew or built_in_forward or bigbird or own_training_step or ctrl or gemma3 or paligemma" \
  2>&1 | grep -E "passed|failed|^FAILED|^E " | head -30
echo "cpu tests: $(( $(date +%s) - t0 )) s"
