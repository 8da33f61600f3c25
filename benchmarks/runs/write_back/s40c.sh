#!/usr/bin/env bash
# 40th session: A/B of "only mutated buffers written back" + "outputs" message (tree) against 0d8c563 (base), 2 GPUs, Qwen3-1.7B:
# the 4-GPU load per device (32,768 tokens, M=2), then the 2-GPU bar workload (65,536, M=4).
O=$OUT
OUT=$O/p bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 16 --timeout 130 --budget 135 --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/p/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/p/ab/tree.recent.json 2>/dev/null
rm -rf trace .ab/base/trace
OUT=$O/s bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --steps 12 --timeout 130 --budget 135 \
    --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/s/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/s/ab/tree.recent.json 2>/dev/null
rm -f $O/*/ab/*.log
for d in p s; do python .ab/show.py $O/$d/ab/base.json $O/$d/ab/tree.json; python .ab/gaps.py $O/$d/ab/base.recent.json $O/$d/ab/tree.recent.json | head -24; done
