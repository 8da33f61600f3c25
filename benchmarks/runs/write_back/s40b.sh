#!/usr/bin/env bash
# 40th session: where the host of each worker sits in the 4-GPU-load proxy (2 GPUs, 32,768 tokens, M=2):
# py-spy (--idle --native) of both worker processes during the timed steps; then, in worker threads,
# one step under torch.profiler: the kernels outside the jobs' compute.
pip install -q --no-deps .carry/wheels/py_spy*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD
python -m benchmarks.harness --out '' --json $OUT/spy.json --log-dir /tmp/logs --gpus 2 --systems rpcompile-delayed \
    --tokens-per-step 32768 --microbatches 2 --steps 120 --timeout 250 --budget 255 > /tmp/s.log 2>&1 &
H=$!
sleep 80
pids=$(pgrep -f "rpcompile.runtime.worker")
echo "workers: $pids"
for p in $pids; do
  py-spy record --pid $p --duration 6 --threads --idle --format raw --nonblocking --rate 200 -o $OUT/spy_$p.txt > /dev/null 2>&1 &
done
wait $H
grep "\[harness\]" /tmp/s.log | tail -2
python .ab/show.py $OUT/spy.json
python -m benchmarks.diagnose --gpus 2 --tokens-per-step 32768 --microbatches 2 --workers threads --variants base --steps 2 \
    --kernels --out /tmp/diag > /tmp/diag.log 2>&1
grep "^==" /tmp/diag.log
tail -30 /tmp/diag.log
python .ab/ktail.py /tmp/diag/kernels_trace.json 2>&1 | head -80
ls -la $OUT
for f in $OUT/spy_*.txt; do
  python .ab/spysum.py $f | head -60
done
