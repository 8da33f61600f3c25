#!/usr/bin/env bash
# 39th session: long garbage collections (Note [long collections]) during Qwen3-1.7B 2-GPU steps.
export PYTHONPATH=$PWD
python -m benchmarks.harness --out '' --json $OUT/gc.json --log-dir /tmp/gc-logs --gpus 2 --systems rpcompile-delayed \
    --steps 40 --timeout 250 --budget 255 > /tmp/gc.log 2>&1
grep "\[harness\]" /tmp/gc.log | tail -2
python - <<'PY'
import json, os
r = json.load(open(os.path.join(os.environ["OUT"], "gc.json")))[0]["results"][0]
print("steps", [round(x, 3) for x in r["step_s"]])
tl = r["info"]["setup_timeline"]
rets = [e["t"] for e in tl if e["what"] == "train_step returned"]
print("returns", [round(t, 2) for t in rets][:12])
for e in tl:
    if e["what"].startswith("garbage"):
        print("  ", e["t"], e["where"], e["what"], e["seconds"])
PY
