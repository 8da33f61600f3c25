#!/usr/bin/env bash
# s35: replicas in worker processes on 2 GPUs: parity (tiny) then harness side by side
export PYTHONPATH=$PWD
bash benchmarks/setup_device.sh > $OUT/setup.log 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind35 TRITON_CACHE_DIR=/tmp/tri35
t0=$(date +%s)
[ "${PT:-200}" != 0 ] && NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM timeout ${PT:-200} python -m benchmarks.gpu_check parity --data-parallel --workers processes --modes ${MODES:-exact,delayed} --out $OUT/parity.json > $OUT/parity.log 2>&1
echo "parity rc=$? $(( $(date +%s) - t0 )) s"
grep -h "via P2P\|via SHM\|Channel 00\|NCCL version" $OUT/parity.log | sort | uniq -c | head -8
[ "${PT:-200}" != 0 ] && python - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/parity.json"))
for k, v in d.items():
    print(k, {a: (round(b, 7) if isinstance(b, float) else b) for a, b in v.items() if a not in ("losses", "eager_losses")})
P
[ -n "$SYS" ] && NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P timeout ${HT:-380} python -m benchmarks.harness --out '' --json $OUT/run.json --log-dir /tmp/logs35 --gpus 2 --systems $SYS --steps 8 --timeout 170 --budget ${BUDGET:-195} --option rpcompile_trace_dir=$OUT/tr > $OUT/h.log 2>&1
grep '\[harness\]' $OUT/h.log; grep -h "via P2P\|via SHM" /tmp/logs35/*.err 2>/dev/null | sed 's/.*NCCL INFO//' | sort | uniq -c | head -5
tail -5 /tmp/logs35/*dp-proc*.err 2>/dev/null
