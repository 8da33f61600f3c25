# Second call (75th session, one H200): exit_check.py again after the launcher's directory fix,
# then gpu_check users for the new peft cases (DoRA, LoRA with gradient checkpointing) and lora.
export PYTHONPATH=$PWD:$PWD/tests
timeout 200 python benchmarks/runs/changes_gpu/exit_check.py 2>&1 | tee $OUT/exit.txt | cut -c1-400
timeout 330 python -m benchmarks.gpu_check users --cases dora,lora_checkpointing,lora --out $OUT/users.json 2>&1 \
  | grep -E "^(dora|lora)" | tee $OUT/users.txt
