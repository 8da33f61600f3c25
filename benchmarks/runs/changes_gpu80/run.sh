#!/bin/bash
# 80th session's GPU check on one H200 (torch 2.11 and transformers 5.17 there): a sum over rows
# divided by an int argument through the torch.compile backend, on CUDA devices in fp32, and the
# session's CPU test on that torch.
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
timeout 200 python benchmarks/runs/changes_gpu80/intarg.py 2>&1 | grep -E "intarg|Error" | cut -c1-400
echo "intarg: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 240 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_loss_terms.py tests/test_loss.py tests/test_parity.py \
  -k "int_argument or sums_over or outputs_that_sum or neither_a_sum or num_items" 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
echo "cpu tests: $(( $(date +%s) - t0 )) s"
