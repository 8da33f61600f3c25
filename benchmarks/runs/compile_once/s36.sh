#!/usr/bin/env bash
# s36 call 1: A/B cold compile, base vs tree, 2 GPUs, default; then replicas-processes parity
export PYTHONPATH=$PWD
t0=$(date +%s)
timeout ${ABT:-400} bash benchmarks/ab.sh run b9d7c1a --gpus 2 --systems ${SYS:-rpcompile-delayed} --steps 8 --timeout 170 --budget 175
echo "ab done $(( $(date +%s) - t0 )) s"
python - <<'P'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/ab/*.json")):
    for run in json.load(open(f)):
        for r in run["results"]:
            tl = r.get("info", {}).get("setup_timeline") or []
            alone = {}
            for m in tl:
                if m["what"].startswith("call alone"):
                    alone.setdefault(m["where"], []).append(m.get("s") or m.get("seconds") or 0)
            print(os.path.basename(f), r["system"], r.get("tokens_per_s"), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1),
                  "setup", r.get("setup_s"), "s/step", r.get("s_per_step"), "busy", r.get("compute_busy_frac"), {w: (len(v), round(sum(v), 1)) for w, v in alone.items()})
            for m in tl:
                if "first called" in m["what"]:
                    print("  ", m["t"], m["where"], m["what"], m.get("seconds"))
P
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind36 TRITON_CACHE_DIR=/tmp/tri36
left=$(( 585 - ($(date +%s) - t0) ))
[ "${PAR:-1}" = 1 ] && [ $left -gt 60 ] && timeout $left python -m benchmarks.gpu_check parity --data-parallel --workers processes --modes ${MODES:-exact,delayed} --out $OUT/parity.json > $OUT/parity.log 2>&1
echo "parity rc=$? $(( $(date +%s) - t0 )) s"
[ -f $OUT/parity.json ] && python - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/parity.json"))
for k, v in d.items():
    print(k, {a: (round(b, 7) if isinstance(b, float) else b) for a, b in v.items() if a not in ("losses", "eager_losses")})
P
tail -3 $OUT/parity.log
