#!/usr/bin/env bash
# 41st session: the whole change (first gradients copied, one microbatch a copy in bf16, masters down on their own
# stream) against 4c94abe; 2 GPUs, Qwen3-1.7B, 32,768 tokens, M=2.
O=$OUT
OUT=$O/e bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 30 --timeout 110 --budget 115
rm -f $O/*/ab/*.log $O/*/ab/setup.log
python .ab/gcmarks.py $O/e/ab/base.json $O/e/ab/tree.json
python .ab/show.py $O/e/ab/base.json $O/e/ab/tree.json | grep -v "^\s*steady" | cut -c1-250
