#!/usr/bin/env bash
# s37 call 3: the tree alone, cold caches, 2 GPUs, Qwen3-1.7B default: c89c0fb (pieces compute
# their signature only inside the program's first call) keeps worker 1's program from the caches
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > /dev/null 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind37b TRITON_CACHE_DIR=/tmp/tri37b; rm -rf /tmp/ind37b /tmp/tri37b
timeout ${HT:-200} python -m benchmarks.harness --out '' --json $OUT/run.json --log-dir /tmp/logs37 --gpus 2 --systems ${SYS:-rpcompile-delayed} --steps 8 --timeout 170 --budget ${BUDGET:-175} > $OUT/h.log 2>&1
grep '\[harness\]' $OUT/h.log
python - <<'P'
import json, os
for run in json.load(open(os.environ["OUT"] + "/run.json")):
    for r in run["results"]:
        print(r["system"], r.get("tokens_per_s"), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1), "setup", r.get("setup_s"), [round(x, 3) for x in r.get("step_s") or []])
        for m in r.get("info", {}).get("setup_timeline") or []:
            if "first called" in m["what"] or "alone" in m["what"]:
                print(" ", m["t"], m["where"], m["what"], m.get("seconds"))
P
