#!/usr/bin/env bash
# s36 call 5: Llama-3.1-8B on 2 GPUs: the default (planner weighs replicas) against the pipeline, one run
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > /dev/null 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind36c TRITON_CACHE_DIR=/tmp/tri36c; rm -rf /tmp/ind36c /tmp/tri36c
timeout ${HT:-560} python -m benchmarks.harness --out '' --json $OUT/run.json --log-dir /tmp/logs36c --model llama3.1-8b --gpus 2 --systems ${SYS:-rpcompile-delayed,rpcompile-delayed-pipe} --steps 8 --timeout 265 --budget ${BUDGET:-545} > $OUT/h.log 2>&1
grep '\[harness\]' $OUT/h.log
python - <<'P'
import json, os
for run in json.load(open(os.environ["OUT"] + "/run.json")):
    for r in run["results"]:
        i = r.get("info") or {}
        print(r["system"], r.get("status"), r.get("tokens_per_s"), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1),
              "setup", r.get("setup_s"), "s/step", r.get("s_per_step"), "busy", r.get("compute_busy_frac"), "jobs", i.get("stage_jobs"),
              "timed", r.get("timed_step_s"))
        print("  plan:", str(i.get("plan"))[:600])
        for m in i.get("setup_timeline") or []:
            if "first called" in m["what"] and "program" in m["what"]:
                print("  ", m["t"], m["where"], m["what"], m.get("seconds"))
P
