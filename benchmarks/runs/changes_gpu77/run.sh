#!/bin/bash
# 77th session's GPU checks on one H200 (torch 2.11 there): the training-loop fixes with CUDA
# devices (gpu_check loop: learning rates set right after train_step, momentum turned on mid-run,
# with the optimizer's share on the GPU or not), RPTrainer with a compute_loss of its own against
# eager Trainer, a model on the GPU refused, and the plan-key tests on torch 2.11 (CPU devices).
# `run.sh first`: the first three; `run.sh second`: the rest (one call each).
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
[ "$1" = "second" ] || {
timeout 230 python benchmarks/gpu_check.py loop --cases "learning_rates or momentum_turned or param_groups or data" \
  --out $OUT/loop.json 2>&1 | grep -E "passed|failed|^E |Error" | head -20
echo "loop: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python benchmarks/gpu_check.py loop --on-devices 0.5 --cases "learning_rates or momentum_turned" \
  --out $OUT/loop_on_devices.json 2>&1 | grep -E "passed|failed|^E |Error" | head -20
echo "loop on devices: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python benchmarks/gpu_check.py trainer --out $OUT/trainer.json 2>&1 | grep -v Warning | tail -12
echo "trainer: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
}
[ "$1" = "first" ] && exit 0
# (the momentum checks again: state on the device compared on the host, as the test now does)
timeout 150 python benchmarks/gpu_check.py loop --on-devices 0.5 --cases "momentum_turned or param_groups" \
  --out $OUT/loop_on_devices2.json 2>&1 | grep -E "passed|failed|^E |Error" | head -20
echo "loop on devices again: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python - <<'PY' 2>&1 | tail -2
import torch, rpcompile
from models import qwen3, lm_batch
model = qwen3(layers=1).cuda()
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=2))
try:
    cm.train_step(**lm_batch(batch=4))
    print("a model on the GPU: not refused")
except rpcompile.InputError as e:
    print("a model on the GPU:", e)
PY
timeout 200 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_plan_key.py 2>&1 | tail -3
echo "plan key: $(( $(date +%s) - t0 )) s"
