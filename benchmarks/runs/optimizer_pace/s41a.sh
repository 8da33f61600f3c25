#!/usr/bin/env bash
# 41st session: A/B of gc.collect()+gc.freeze() after a compiling job (tree) against 4263008 (base),
# 2 GPUs, Qwen3-1.7B, the 4-GPU load per GPU (32,768 tokens, M=2), 150 timed steps each side.
O=$OUT
OUT=$O/p bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 32768 --microbatches 2 \
    --steps 150 --timeout 215 --budget 220
rm -f $O/*/ab/*.log
python .ab/gcmarks.py $O/p/ab/base.json $O/p/ab/tree.json
python .ab/show.py $O/p/ab/base.json $O/p/ab/tree.json | grep -v "^\s*\[" | cut -c1-300
