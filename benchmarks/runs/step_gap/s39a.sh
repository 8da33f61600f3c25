#!/usr/bin/env bash
# 39th session: A/B of d70dc94 (next step's weights asked for at issue) on 2 GPUs, Qwen3-1.7B.
bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --steps 16 --timeout 260 --budget 265 \
    --option rpcompile_trace_dir=trace
rm -f $OUT/ab/setup.log
cp .ab/base/trace/*2g.recent.json $OUT/ab/base.recent.json 2>/dev/null
cp trace/*2g.recent.json $OUT/ab/tree.recent.json 2>/dev/null
python .ab/gaps.py $OUT/ab/base.recent.json $OUT/ab/tree.recent.json
python - <<'PY'
import json, os
for side in ("base", "tree"):
    p = os.path.join(os.environ["OUT"], "ab", side + ".json")
    if not os.path.exists(p):
        print(side, "no json"); continue
    d = json.load(open(p))
    for r in d.get("results", d if isinstance(d, list) else []):
        if not isinstance(r, dict): continue
        t = r.get("trace", {})
        print(side, r.get("system"), "tok/s", r.get("tokens_per_s"), "s/step", r.get("s_per_step"), "steps", [round(x,3) for x in r.get("timed_step_s") or []],
              "steady", t.get("steady"), {k: v.get("compute_lag_s") for k, v in t.get("devices", {}).items()},
              "opt", r.get("optimizer_s"))
PY
