#!/usr/bin/env bash
# 39th session: A/B of the loss before the tail (fused jobs' outputs before their end), then RoundPipe beside the tree.
bash .ab/s39a.sh 2>&1 | grep -v Traceback | grep -v "line 7" | grep -v AttributeError
python .ab/show.py $OUT/ab/base.json $OUT/ab/tree.json
rm -f $OUT/ab/base.log $OUT/ab/tree.log
export PYTHONPATH=$PWD
timeout 290 python -m benchmarks.harness --out '' --json $OUT/rp.json --log-dir /tmp/rp-logs --gpus 2 --systems rpcompile-delayed,roundpipe \
    --steps 8 --timeout 140 --budget 270 > /tmp/rp.log 2>&1
grep "\[harness\]" /tmp/rp.log | tail -4
