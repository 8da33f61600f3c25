"""`loss = cm(**batch).loss; loss.backward(); opt.step()` with worker processes on one GPU: the
shared memory (/dev/shm) the run holds after each step, and the step's seconds (the 65th
session's finding: each differentiable call left its fp32 gradient set in shared files, and each
call under no_grad made one too). Exact mode, Qwen3-1.7B (or MODEL), ROWS x 2048 tokens, M=4,
SGD with momentum on the host parameters; then CALLS calls under no_grad. From the repository
root, on the GPU machine: `python benchmarks/runs/call_grads/check.py OUT.json [MODEL [ROWS [STEPS [CALLS [WORKERS]]]]]`
(defaults qwen3-1.7b, 8, 4, 3, processes; with threads the resident memory is reported, as there
are no shared files)."""
import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402

args = sys.argv[2:] + [None] * 5
name, rows = args[0] or "qwen3-1.7b", int(args[1] or 8)
steps, calls, workers = int(args[2] or 4), int(args[3] or 3), args[4] or "processes"
spec = get_model(name)
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               workers=workers))
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def shm_gib() -> float:
    if workers == "threads":         # resident memory then
        return float(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    d = cm.runner.executor.memory.directory
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 2**30


res = {"model": spec.name, "workers": workers, "rows": rows, "steps": [], "calls": []}
for step in range(steps):
    ids = batch_ids(spec.vocab, rows, 2048, step=step)
    t = [time.perf_counter()]
    loss = cm(input_ids=ids, labels=ids).loss
    t.append(time.perf_counter())
    loss.backward()
    t.append(time.perf_counter())
    opt.step()
    opt.zero_grad()
    t.append(time.perf_counter())
    res["steps"].append({"seconds": t[-1] - t[0], "call": t[1] - t[0], "backward": t[2] - t[1],
                         "optimizer": t[3] - t[2], "loss": float(loss), "shm_gib": shm_gib()})
    print(json.dumps(res["steps"][-1]), flush=True)
for k in range(calls):
    ids = batch_ids(spec.vocab, rows, 2048, step=100 + k)
    t = time.perf_counter()
    with torch.no_grad():
        loss = float(cm(input_ids=ids, labels=ids).loss)
    res["calls"].append({"seconds": time.perf_counter() - t, "loss": loss, "shm_gib": shm_gib()})
    print(json.dumps(res["calls"][-1]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
