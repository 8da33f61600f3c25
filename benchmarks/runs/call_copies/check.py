"""A call (evaluation) between train steps in delayed mode on a GPU: what it adds to host memory,
and its loss read from the newest working copies (Note [calls read the newest copies] in
rpcompile/runtime/modes.py) against the same call through the runner's HostWeights (the path
before: a third pinned working copy). From the repository root, on the GPU machine:
`python benchmarks/runs/call_copies/check.py OUT.json MODEL ROWS` (MODEL qwen3-1.7b or llama3.1-8b)."""
import json
import resource
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


spec = get_model(sys.argv[2])
rows = int(sys.argv[3])
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               optimizer_mode="delayed"))
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
out = {"model": spec.name, "rows": rows, "steps": []}
for step in range(3):
    ids = batch_ids(spec.vocab, rows, 2048, step=step)
    t = time.perf_counter()
    cm.train_step(input_ids=ids, labels=ids)
    cm.synchronize()
    out["steps"].append({"seconds": time.perf_counter() - t, "rss_gib": rss_gib()})
out["plan_host"] = cm.plan.host_memory.summary()
ids = batch_ids(spec.vocab, 8, 2048, step=99)


def call(label):
    before = rss_gib()
    t = time.perf_counter()
    with torch.no_grad():
        loss = float(cm(input_ids=ids, labels=ids).loss)
    out[label] = {"loss": loss, "seconds": time.perf_counter() - t, "rss_before_gib": before, "rss_after_gib": rss_gib(),
                  "host_weights_copies": len(cm.runner.host_weights._copies),
                  "host_buffers": {k: v / 2**30 for k, v in cm.runner.host_buffer_bytes().items()}}
    print(label, json.dumps(out[label]), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)     # (each call: the last may not come back)


call("call")
call("call_again")
cm.runner.mode.call_weights = lambda runner, plan: None      # the path before: the runner's HostWeights
call("call_through_host_weights")
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
json.dump(out, open(sys.argv[1], "w"), indent=1)
