#!/usr/bin/env bash
# 41st session: the same A/B (tree: first gradients copied + one microbatch a copy in bf16; base 4c94abe) where the
# GPUs set the pace: 2 GPUs, 65,536 tokens, M=2 (one microbatch of 32,768 tokens a copy).
O=$OUT
OUT=$O/q bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --tokens-per-step 65536 --microbatches 2 \
    --steps 24 --timeout 170 --budget 175 --option rpcompile_trace_dir=trace
cp .ab/base/trace/*2g.recent.json $O/q/ab/base.recent.json 2>/dev/null; cp trace/*2g.recent.json $O/q/ab/tree.recent.json 2>/dev/null
rm -rf trace .ab/base/trace; rm -f $O/*/ab/*.log $O/*/ab/setup.log
python .ab/gcmarks.py $O/q/ab/base.json $O/q/ab/tree.json; python .ab/spans.py $O/q/ab/base.recent.json $O/q/ab/tree.recent.json
python .ab/show.py $O/q/ab/base.json $O/q/ab/tree.json | grep -v "^\s*steady" | cut -c1-250
python - $O/q/ab/tree.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]["results"][0]
print(r["info"]["plan"].splitlines()[0])
PY
