# One H100: Note [grouped-query attention FLOPs] on the device's torch (tree, then torch's own
# formulas), and gpu_check users' tiny_qwen3 (step, call, backend; 1 and 2 devices) in worker
# threads and worker processes against fp32 eager.
export PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python benchmarks/runs/gqa_flops/check.py cuda:0 2>&1 | tail -1 | tee $OUT/gqa_tree.txt
OLD=1 python benchmarks/runs/gqa_flops/check.py cuda:0 2>&1 | tail -1 | tee $OUT/gqa_old.txt
python benchmarks/gpu_check.py users --cases tiny_qwen3 --out $OUT/users_threads.json > $OUT/users_threads.log 2>&1; echo "threads rc=$?"
python benchmarks/gpu_check.py users --cases tiny_qwen3 --workers processes --out $OUT/users_processes.json > $OUT/users_processes.log 2>&1; echo "processes rc=$?"
python - <<'PY'
import json, os
for w in ("threads", "processes"):
    r = json.load(open(os.path.join(os.environ["OUT"], f"users_{w}.json")))
    for k, v in r.items():
        if isinstance(v, dict) and "grad_err_rel_largest" in v:
            print(w, k, "loss", f"{v['loss_abs_err']:.2g}", "grads", f"{v['grad_err_rel_largest']:.2g}", "params", f"{v['param_err_rel_largest']:.2g}")
PY
