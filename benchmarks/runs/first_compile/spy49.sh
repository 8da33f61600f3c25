#!/usr/bin/env bash
# 49th session, call 2 (2 H200s, carry [".carry"]): where a worker process's first compile goes. One harness run of the
# tree (Qwen3-1.7B, 65,536 tokens, M=4, from empty compile caches and a dropped page cache, as s45c.sh); as soon as the
# worker processes exist, py-spy samples each (with its subprocesses: Inductor's compile pool) for 50 s.
set -euo pipefail
pip install -q --no-deps .carry/wheels/py_spy*.whl 2>&1 | tail -1
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
side_reset 1-tree
PYTHONPATH=$PWD python -m benchmarks.harness --model qwen3-1.7b --gpus 2 --seq-len 2048 --tokens-per-step 65536 \
    --microbatches 4 --steps 8 --systems rpcompile-delayed --record "$OUT/runs" --timeout 125 --budget 130 --out '' \
    --log-dir /tmp/hw-logs --json "$OUT/1-tree.json" > /tmp/h.log 2>&1 &
H=$!
pids=""
for _ in $(seq 1 1500); do
  pids=$(pgrep -f "rpcompile.runtime.worker import main" || true)
  [ "$(echo $pids | wc -w)" -ge 2 ] && break
  sleep 0.1
done
echo "workers: $pids at $(date +%T.%N)"
for p in $pids; do
  py-spy record --pid $p --duration 50 --rate 100 --threads --idle --subprocesses --nonblocking --format raw \
      -o $OUT/spy_$p.txt > /tmp/spy_$p.log 2>&1 &
done
wait $H || true
grep '\[harness\]' /tmp/h.log | tail -2
wait
ls -la $OUT
