#!/usr/bin/env bash
# sides in the given order (dirs under .ab), each with empty caches, and the child's RSS every 0.5 s
out=${OUT:-/tmp}/ab; mkdir -p $out
bash benchmarks/setup_device.sh > $out/setup.log 2>&1 || true
for side in "$@"; do
  export TORCHINDUCTOR_CACHE_DIR=/tmp/rv-ind-$side TRITON_CACHE_DIR=/tmp/rv-tri-$side; rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
  ( t0=$(date +%s.%N); while sleep 0.5; do ps -eo rss=,args= | awk -v t=$(date +%s.%N) -v t0=$t0 '/benchmarks.child/ && !/awk/ {printf "%.1f %d\n", t-t0, $1/1024}'; done ) > $out/rss_$side.txt &
  mon=$!
  (cd .ab/$side && PYTHONPATH=$PWD python -m benchmarks.harness --out '' --json $out/$side.json --log-dir /tmp/rv-logs-$side \
     --gpus 1 --systems rpcompile-delayed --steps 8 --timeout 220 --budget 225 > $out/$side.log 2>&1)
  kill $mon
  grep '\[harness\]' $out/$side.log | sed "s/^/$side: /"
  python - $out/$side.json $out/rss_$side.txt <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = (d if isinstance(d, list) else [d])[0]["results"][0]
rows = [tuple(map(float, l.split())) for l in open(sys.argv[2]) if l.strip()]
pk = max(rows, key=lambda x: x[1]) if rows else None
tl = {m["what"]: m["t"] for m in r["info"]["setup_timeline"]}
print(r["tokens_per_s"], [round(x, 2) for x in r["step_s"]], "used", round(r["host_used_peak_bytes"] / 2**30, 2), "maxrss", round(r["child_maxrss_bytes"] / 2**30, 2),
      "rss peak (MiB, s since start)", pk, "captured at", tl.get("captured"), "first train_step returned", tl.get("train_step returned"))
print("rss every 5 s:", [(t, m) for t, m in rows[::10]])
PY
done
