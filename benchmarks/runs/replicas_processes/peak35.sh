#!/usr/bin/env bash
# host memory over time of one 2-GPU harness run (rpcompile-delayed), with its setup marks
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > /dev/null 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/indp TRITON_CACHE_DIR=/tmp/trip
( t0=$(date +%s.%N); while sleep 0.5; do
    t=$(date +%s.%N)
    used=$(free -m | awk '/Mem:/ {print $3+$5}')
    main=$(ps -eo rss=,args= | awk '/benchmarks.child/ && !/awk/ {s+=$1} END {print int(s/1024)}')
    work=$(ps -eo rss=,args= | awk '/runtime.worker/ && !/awk/ {s+=$1} END {print int(s/1024)}')
    comp=$(ps -eo rss=,args= | awk '/compile_worker|subproc_pool/ && !/awk/ {s+=$1} END {print int(s/1024)}')
    echo "$(echo "$t - $t0" | bc) $used $main $work $comp"; done ) > $OUT/mem.txt &
mon=$!
timeout 230 python -m benchmarks.harness --out '' --json $OUT/run.json --log-dir /tmp/logsp --gpus 2 --systems rpcompile-delayed --steps 8 --timeout 200 --budget 210 > $OUT/h.log 2>&1
kill $mon
grep '\[harness\]' $OUT/h.log
python - <<'P'
import json, os
out = os.environ["OUT"]
rows = [l.split() for l in open(out + "/mem.txt") if len(l.split()) == 5]
rows = [(float(a), int(b), int(c or 0), int(d or 0), int(e or 0)) for a, b, c, d, e in rows]
pk = max(rows, key=lambda r: r[1])
print("peak used MiB (t, used, main rss, workers rss, compile rss):", pk, "start used", rows[0])
print("every 5 s:", [r for r in rows[::10]])
r = json.load(open(out + "/run.json"))[-1]["results"][0]
print(r["tokens_per_s"], r["host_used_peak_bytes"] / 2**30, [(m["where"], m["what"][:40], round(m["t"], 1)) for m in r["info"]["setup_timeline"]][:80])
P
