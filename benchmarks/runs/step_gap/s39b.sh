#!/usr/bin/env bash
# 39th session: layers traced once (df36c73) on torch 2.11: capture seconds, then the first steps A/B (2 GPUs, Qwen3-1.7B).
export PYTHONPATH=$PWD
python .ab/captime.py qwen3-1.7b llama3.1-8b 2>&1 | grep -v Warning | tail -12
bash benchmarks/ab.sh run base --gpus 2 --systems rpcompile-delayed --steps 8 --timeout 240 --budget 245
rm -f $OUT/ab/setup.log
python - <<'PY'
import json, os
for side in ("base", "tree"):
    p = os.path.join(os.environ["OUT"], "ab", side + ".json")
    if not os.path.exists(p):
        print(side, "no json"); continue
    for run in json.load(open(p)):
        for r in run["results"]:
            tl = {e["what"]: (e["t"], e["seconds"]) for e in r["info"].get("setup_timeline", [])}
            print(side, r["system"], round(r.get("tokens_per_s") or 0), "build", round(r.get("build_s") or 0, 1), "warmup", round(r.get("warmup_s") or 0, 1),
                  "setup", round(r.get("setup_s") or 0, 1), "captured", tl.get("captured"), "planned", tl.get("planned"),
                  "ready", tl.get("ready for the first step"), "first step", round((r.get("step_s") or [0])[0], 1))
PY
