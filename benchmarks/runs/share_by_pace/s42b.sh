#!/usr/bin/env bash
# 42nd session: Note [narrow slices summed by their copy] (tree: the copies' bf16 slices exchanged by an all-to-all
# and summed in fp32 by their copy) against 9cb9b42 (a bf16 reduce-scatter); 2 GPUs: tiny Qwen3 bit-equality, then
# Qwen3-1.7B at 32,768 tokens, M=2 (one microbatch a copy: the narrow path).
O=$OUT
export PYTHONPATH=$PWD
timeout 150 python .ab/narrow_check.py 2>&1 | grep -E "narrow|host vs|Error|error" | head -5
OUT=$O/n bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 30 --timeout 140 --budget 145 --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/n/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/n/ab/tree.recent.json 2>/dev/null
rm -rf trace .ab/base/trace; rm -f $O/*/ab/*.log $O/*/ab/setup.log
python .ab/gcmarks.py $O/n/ab/base.json $O/n/ab/tree.json; python .ab/spans.py $O/n/ab/base.recent.json $O/n/ab/tree.recent.json
python .ab/show.py $O/n/ab/base.json $O/n/ab/tree.json | grep -v "^\s*steady" | cut -c1-250
