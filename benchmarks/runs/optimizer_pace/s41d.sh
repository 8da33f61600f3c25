#!/usr/bin/env bash
# 41st session: the optimizer's fp32 masters come down on a stream of their own (tree) against the same tree without
# it (base: 4c94abe + first gradients copied + one microbatch a copy in bf16); 2 GPUs, Qwen3-1.7B, 32,768 tokens, M=2.
O=$OUT
export PYTHONPATH=$PWD
timeout 120 python .ab/narrow_check.py 2>&1 | grep -E "narrow|host vs|Error|error" | head -5
OUT=$O/d bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 40 --timeout 140 --budget 145 --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/d/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/d/ab/tree.recent.json 2>/dev/null
rm -rf trace .ab/base/trace; rm -f $O/*/ab/*.log $O/*/ab/setup.log
python .ab/gcmarks.py $O/d/ab/base.json $O/d/ab/tree.json; python .ab/spans.py $O/d/ab/base.recent.json $O/d/ab/tree.recent.json
python .ab/show.py $O/d/ab/base.json $O/d/ab/tree.json | grep -v "^\s*steady" | cut -c1-250
