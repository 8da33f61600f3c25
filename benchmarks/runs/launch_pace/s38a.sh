#!/usr/bin/env bash
# 38th session: where a worker's issue time goes (py-spy on worker 0 during the timed steps),
# then Inductor's CUDA graph trees inside the worker processes (one run each, Qwen3-1.7B, 2 GPUs).
export PYTHONPATH=$PWD
pip install -q --no-index --find-links .carry/wheels py-spy > /dev/null 2>&1
python -m benchmarks.harness --out '' --json $OUT/spy.json --log-dir /tmp/logs --gpus 2 --systems rpcompile-delayed \
    --steps 40 --timeout 200 --budget 205 > $OUT/spy.log 2>&1 &
H=$!
for i in $(seq 1 150); do
  sleep 1
  if grep -q "train_step returned" /tmp/logs/*.err 2>/dev/null; then :; fi
  W=$(pgrep -f "rpcompile.runtime.worker import main" | head -1)
  # timed steps begin once the first call's compile is over: wait for 2 steps' worth of marks
  if [ -n "$W" ] && [ $i -ge 70 ]; then break; fi
done
W=$(pgrep -f "rpcompile.runtime.worker import main" | head -1)
echo "worker pid $W at $i s"
py-spy record --pid $W --duration 6 --threads --format raw -o $OUT/spy_threads.txt > /dev/null 2>&1
py-spy record --pid $W --duration 6 --threads --gil --format raw -o $OUT/spy_gil.txt > /dev/null 2>&1
wait $H
grep "tokens/s" $OUT/spy.log | head -3
python -m benchmarks.harness --out '' --json $OUT/cg.json --log-dir /tmp/logs2 --gpus 2 --systems rpcompile-delayed \
    --steps 8 --timeout 150 --budget 155 --option 'rpcompile_inductor={"triton.cudagraphs": true}' > $OUT/cg.log 2>&1
tail -4 $OUT/cg.log | cut -c1-600
ls /tmp/logs2; tail -30 /tmp/logs2/*.err | cut -c1-300
