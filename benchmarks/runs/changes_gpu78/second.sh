#!/bin/bash
# The second call: after the capture's lazy size formats were made to probe the torch they run
# on (torch 2.11 lets the deferred format's error out of the trace), the VLM families on CUDA and
# the session's CPU tests again on torch 2.11 / transformers 5.17.
export PYTHONPATH=$PWD:$PWD/tests
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
t0=$(date +%s)
timeout 200 python benchmarks/gpu_check.py zoo --cases gemma3_vlm,paligemma --out $OUT/zoo_vlm.json \
  2>&1 | grep -E "^(gemma3_vlm|paligemma) " | cut -c1-500
echo "zoo vlm: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python -m pytest -q -p no:cacheprovider -o addopts= tests/test_vlm.py tests/test_capture_lifetime.py \
  tests/test_parity.py tests/test_capture.py tests/test_trainer.py tests/test_zoo.py \
  -k "test_vlm or lifetime or backend or sums_over_rows or assigned_anew or built_in_forward or bigbird or own_training_step or ctrl or gemma3 or paligemma" \
  2>&1 | grep -E "passed|failed|^FAILED|^E  .*Error" | cut -c1-300 | head -30
echo "cpu tests: $(( $(date +%s) - t0 )) s"
