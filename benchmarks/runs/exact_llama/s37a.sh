#!/usr/bin/env bash
# s37 calls 1-2: Llama-3.1-8B on one GPU (of an x2 host: 251 GiB), SYS (rpcompile | rpcompile-overlapped)
# at ad79f4b then at the tree, each side with cold caches; merged into one run file
export PYTHONPATH=$PWD
t0=$(date +%s)
timeout ${ABT:-585} bash benchmarks/ab.sh run ad79f4b --model llama3.1-8b --gpus 1 --systems ${SYS:-rpcompile} --steps 8 --timeout ${ST:-285} --budget ${ST:-285}
echo "ab done $(( $(date +%s) - t0 )) s"
python - <<'P'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/ab/*.json")):
    for run in json.load(open(f)):
        for r in run["results"]:
            print(os.path.basename(f), r["system"], r.get("status"), r.get("reason", "")[:200], r.get("tokens_per_s"), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1),
                  "setup", r.get("setup_s"), "wall", r.get("wall_s"), [round(x, 2) for x in r.get("step_s") or []])
P
tail -5 $OUT/ab/*.log
