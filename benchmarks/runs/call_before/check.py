"""A call (an evaluation) before the first train step in delayed mode on a GPU: the working
copies it makes through the runner's HostWeights go when delayed mode's copies are made, and the
first train plan's default host budget counts them free (Note [calls read the newest copies] in
rpcompile/runtime/modes.py). From the repository root, on the GPU machine:
`python benchmarks/runs/call_before/check.py OUT.json MODEL ROWS WORKERS [keep]` (MODEL
qwen3-1.7b or llama3.1-8b, WORKERS threads or processes; `keep`: the path before, the copies
kept and the budget measured with them taken: at 4ec0f57 and 22192ba `releases_call_copies`
replaced by False, as the run files were made; now the two replaced on the runner)."""
import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def memory(cm) -> dict:
    """RSS and shared files, the runner's host buffers by kind, and this process's pinned and
    anonymous memory as the kernel counts it (GiB)."""
    with open("/proc/self/smaps_rollup") as f:
        kernel = {k: int(v.split()[0]) / 2**20 for k, v in (line.split(":", 1) for line in f if ":" in line)
                  if k in ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty", "Private_Dirty", "Locked")}
    return {"rss_gib": rss_gib(), "shm_gib": shm_gib(cm), "kernel_gib": kernel,
            "host_buffers_gib": {k: v / 2**30 for k, v in cm.runner.host_buffer_bytes().items()},
            "host_weights_copies": len(cm.runner.host_weights._copies)}


def shm_gib(cm) -> float:
    memory = getattr(cm.runner.executor, "memory", None)
    if memory is None:
        return 0.0
    return sum(os.path.getsize(os.path.join(memory.directory, f)) for f in os.listdir(memory.directory)) / 2**30


out_path, name, rows, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
keep = sys.argv[5:] == ["keep"]
spec = get_model(name)
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               optimizer_mode="delayed", workers=workers))
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
if keep:      # (the copies stay, and the first plan's budget does not count them)
    cm.runner.release_call_copies = lambda: None
    cm.runner.host_weights.nbytes = lambda: 0
out = {"model": spec.name, "rows": rows, "workers": workers, "keep": keep, "rss_start_gib": rss_gib()}


def dump():
    json.dump(out, open(out_path, "w"), indent=1)


ids = batch_ids(spec.vocab, 8, 2048, step=99)
t = time.perf_counter()
with torch.no_grad():
    out["call_loss"] = float(cm(input_ids=ids, labels=ids).loss)
cm.synchronize()
out["call"] = {"seconds": time.perf_counter() - t, **memory(cm)}
print("call", json.dumps(out["call"]), flush=True)
dump()
out["steps"] = []
for step in range(3):
    ids = batch_ids(spec.vocab, rows, 2048, step=step)
    t = time.perf_counter()
    try:
        loss = float(cm.train_step(input_ids=ids, labels=ids))
        cm.synchronize()
    except Exception as e:                   # (the path before: no plan fits the budget measured)
        out["error"] = f"{type(e).__name__}: {e}"
        print(out["error"], flush=True)
        break
    out["steps"].append({"seconds": time.perf_counter() - t, "loss": loss, **memory(cm)})
    print("step", json.dumps(out["steps"][-1]), flush=True)
    if step == 0:
        out["plan_host"] = cm.plan.host_memory.summary()
        out["plan_host_budget_gib"] = cm.plan.host_memory.budget / 2**30
        out["plan_jobs"] = len(cm.plan.stages)
        print(out["plan_host"], flush=True)
    dump()
ids = batch_ids(spec.vocab, 8, 2048, step=99)
if not out.get("error"):
    with torch.no_grad():
        out["call_after_loss"] = float(cm(input_ids=ids, labels=ids).loss)
    out["call_after_host_weights_copies"] = len(cm.runner.host_weights._copies)
out["peak_rss_gib"] = max([out["call"]["rss_gib"]] + [s["rss_gib"] for s in out["steps"]])
dump()
