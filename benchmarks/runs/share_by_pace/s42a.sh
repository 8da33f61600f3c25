#!/usr/bin/env bash
# 42nd session: Llama-3.1-8B, 2 GPUs, the bar's workload (65,536 tokens, M=4), HEAD (first gradients copied,
# one microbatch a copy, masters down on their own stream) against 4c94abe; 10 timed steps each side.
O=$OUT
OUT=$O/l bash benchmarks/ab.sh run base --model llama3.1-8b --gpus 2 --systems rpcompile-delayed \
    --tokens-per-step 65536 --microbatches 4 --steps 10 --timeout 275 --budget 280
rm -f $O/*/ab/*.log $O/*/ab/setup.log
python .ab/gcmarks.py $O/l/ab/base.json $O/l/ab/tree.json
python .ab/show.py $O/l/ab/base.json $O/l/ab/tree.json | cut -c1-400
