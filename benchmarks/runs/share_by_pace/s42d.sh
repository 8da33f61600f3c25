#!/usr/bin/env bash
# 42nd session: the default plan with Note [optimizer share by pace] on the 4-GPU Llama proxy of call 4 (2 GPUs,
# Llama-3.1-8B, 32,768 tokens, M=2): which share does the plan take, and its tokens/s (call 4: share 0 10,828,
# share 0.5 set 16,284).
O=$OUT
export PYTHONPATH=$PWD
python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
python -m benchmarks.harness --model llama3.1-8b --gpus 2 --seq-len 2048 --tokens-per-step 32768 --microbatches 2 \
    --steps 8 --out '' --systems rpcompile-delayed --json $O/pace.json --record $O/runs \
    --log-dir /tmp/logs-pace --timeout 175 --budget 178 2>&1 | grep "\[harness\]"
python - $O/pace.json <<'PY'
import json, sys
for run in json.load(open(sys.argv[1])):
    for r in run["results"]:
        i = r.get("info") or {}
        print(r["system"], r["status"], round(r.get("tokens_per_s") or 0), [round(s, 3) for s in r.get("timed_step_s") or []],
              "setup", round(r.get("setup_s") or 0, 1), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1))
        print("  share", i.get("optimizer_share"), "opt", {k: round(v, 3) for k, v in (i.get("optimizer_s") or {}).items()})
        print("  busy", r.get("compute_busy_frac"), "| reason", (r.get("reason") or "")[:300])
        print("  " + "\n  ".join((i.get("plan") or "").splitlines()[:9]))
PY
