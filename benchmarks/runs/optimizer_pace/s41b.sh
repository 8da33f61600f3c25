#!/usr/bin/env bash
# 41st session: Note [first gradients copied] + Note [one microbatch a copy] (tree) against 4c94abe (base):
# a GPU numerics check, then A/B on 2 GPUs, Qwen3-1.7B: the 4-GPU load per GPU (32,768 tokens, M=2: one microbatch
# a copy, bf16 accumulators) and the 2-GPU bar workload (65,536, M=4: two a copy, fp32, first copied).
O=$OUT
export PYTHONPATH=$PWD
timeout 150 python .ab/narrow_check.py 2>&1 | grep -E "narrow|Error|error" | head -5
OUT=$O/p bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 40 --timeout 150 --budget 155 --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/p/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/p/ab/tree.recent.json 2>/dev/null
rm -rf trace .ab/base/trace
OUT=$O/s bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --steps 16 --timeout 140 --budget 145 \
    --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/s/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/s/ab/tree.recent.json 2>/dev/null
rm -f $O/*/ab/*.log $O/*/ab/setup.log
for d in p s; do python .ab/gcmarks.py $O/$d/ab/base.json $O/$d/ab/tree.json; python .ab/spans.py $O/$d/ab/base.recent.json $O/$d/ab/tree.recent.json; done
