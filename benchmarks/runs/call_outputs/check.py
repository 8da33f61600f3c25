"""An evaluation loop on one GPU: what a call's outputs cost in host memory and seconds (the
64th session's finding: each microbatch's output comes down into a pinned block of torch's
caching host allocator, rounded to a power of two, then is concatenated for the caller;
benchmarks/runs/host_gap/README.md). Delayed mode, 2 train steps (32 x 2048 tokens, M=4, fused
AdamW), then CALLS calls under no_grad on ROWS x 2048 tokens, each keeping only the loss; after
each: its seconds, the resident memory by mapping and torch's caching host allocator. From the
repository root, on the GPU machine:
`python benchmarks/runs/call_outputs/check.py OUT.json [MODEL [ROWS [CALLS [WORKERS]]]]` (defaults
qwen3-1.7b, 8, 10, threads). Run it on main before and after a change to the outputs' path."""
import json
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402
from benchmarks.runs.host_gap.check import host_allocator, mappings  # noqa: E402

args = sys.argv[2:] + [None] * 4
name, rows, calls, workers = args[0] or "qwen3-1.7b", int(args[1] or 8), int(args[2] or 10), args[3] or "threads"
spec = get_model(name)
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               optimizer_mode="delayed", workers=workers))
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
res = {"model": spec.name, "workers": workers, "rows": rows, "steps": [], "calls": []}
for step in range(2):
    ids = batch_ids(spec.vocab, 32, 2048, step=step)
    t = time.perf_counter()
    loss = float(cm.train_step(input_ids=ids, labels=ids))
    cm.synchronize()
    res["steps"].append({"seconds": time.perf_counter() - t, "loss": loss, "mappings_gib": mappings()})
res["plan_host_gib"] = cm.plan.host_memory.total / 2**30
for k in range(calls):
    ids = batch_ids(spec.vocab, rows, 2048, step=100 + k)
    t = time.perf_counter()
    with torch.no_grad():
        loss = float(cm(input_ids=ids, labels=ids).loss)
    res["calls"].append({"seconds": time.perf_counter() - t, "loss": loss, "mappings_gib": mappings(),
                         "host_allocator": host_allocator()})
    print(json.dumps(res["calls"][-1]), flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
ids = batch_ids(spec.vocab, 32, 2048, step=2)     # a train step after the calls: what they left
t = time.perf_counter()
loss = float(cm.train_step(input_ids=ids, labels=ids))
cm.synchronize()
res["after"] = {"seconds": time.perf_counter() - t, "loss": loss, "mappings_gib": mappings(),
                "host_allocator": host_allocator()}
print(json.dumps(res["after"]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
