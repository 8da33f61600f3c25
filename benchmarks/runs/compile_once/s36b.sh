#!/usr/bin/env bash
# s36 call 2: tree alone, cold caches, 2 GPUs; the compile-lock marks per worker
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > /dev/null 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind36b TRITON_CACHE_DIR=/tmp/tri36b; rm -rf /tmp/ind36b /tmp/tri36b
timeout ${HT:-200} python -m benchmarks.harness --out '' --json $OUT/run.json --log-dir /tmp/logs36 --gpus 2 --systems ${SYS:-rpcompile-delayed} --steps 8 --timeout 170 --budget ${BUDGET:-175} > $OUT/h.log 2>&1
grep '\[harness\]' $OUT/h.log
python - <<'P'
import json, os
for run in json.load(open(os.environ["OUT"] + "/run.json")):
    for r in run["results"]:
        print(r["system"], r.get("tokens_per_s"), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1), "setup", r.get("setup_s"))
        for m in r.get("info", {}).get("setup_timeline") or []:
            if "piece" in m["what"] or "alone" in m["what"] or "dry run" in m["what"]:
                print(" ", m["t"], m["where"], m["what"], m.get("seconds"))
P
