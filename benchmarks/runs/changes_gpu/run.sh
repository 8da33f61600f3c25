# The 75th session's GPU check (one H200): gpu_check changes with worker threads and processes,
# then exit_check.py. Output under $OUT.
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/card.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a $OUT/card.txt
for w in threads processes; do
  timeout 240 python -m benchmarks.gpu_check changes --workers $w --out $OUT/changes_$w.json 2>&1 | grep -E "^(held|requires)" | tee -a $OUT/log.txt
done
timeout 300 python benchmarks/runs/changes_gpu/exit_check.py 2>&1 | tee -a $OUT/log.txt
