"""A later call at a longer length on a host with no room for its activations (Note [host room]
in rpcompile/passes/host_memory.py): Llama-3.1-8B on one GPU, delayed mode, AdamW, the first
train steps at 32 rows of 2048 tokens (the plan fits the host's default budget), then 32 rows of
4096 tokens (expected: HostMemoryError before it runs), then 16 rows of 4096 tokens and 8 rows
of 8192 (the same tokens as the first), then 32 rows of 2048 again. From the repository root, on the GPU machine:
`python benchmarks/runs/host_later/check.py OUT.json`. With `qwen3-1.7b` after OUT.json: Qwen3-1.7B,
whose host has room, at 32 rows of 2048 tokens, then 32 rows of 4096 (a plan of its own, within the
device budget the first plan measured: Note [device budget measured once]), then 2048 again."""
import json
import resource
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402

name = sys.argv[2] if len(sys.argv) > 2 else "llama3.1-8b"
spec = get_model(name)
t0 = time.perf_counter()
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=8192)
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               optimizer_mode="delayed"))
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
out = {"built_s": time.perf_counter() - t0, "calls": []}


def call(rows, seq, step):
    ids = batch_ids(spec.vocab, rows, seq, step=step)
    t = time.perf_counter()
    rec = {"rows": rows, "seq": seq}
    try:
        rec["loss"] = float(cm.train_step(input_ids=ids, labels=ids))
        cm.synchronize()
        rec["plan_host"] = cm.plan.host_memory.summary()
        rec["jobs"] = len(cm.plan.stages)
    except rpcompile.PlanningError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["seconds"] = time.perf_counter() - t
    rec["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["calls"].append(rec)
    print(json.dumps(rec), flush=True)


if name != "llama3.1-8b":
    for step, (rows, seq) in enumerate([(32, 2048), (32, 2048), (32, 4096), (32, 4096), (32, 2048)]):
        call(rows, seq, step)
    out["plans"] = [{"at": p.bindings, "jobs": len(p.stages), "memory_budget": p.memory_budget,
                     "device_budget": getattr(p, "device_budget", None)} for p in cm._plans.plans()]
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    sys.exit(0)
for step in range(3):
    call(32, 2048, step)
before = [p.detach()[:2].clone() for p in list(model.parameters())[:4]]
call(32, 4096, 3)
cm.synchronize()
out["unchanged_by_the_failed_call"] = all(torch.equal(p.detach()[:2], b) for p, b in zip(list(model.parameters())[:4], before))
call(16, 4096, 4)
call(8, 8192, 5)
call(32, 2048, 6)
out["plans"] = [{"at": p.bindings, "jobs": len(p.stages), "memory_budget": p.memory_budget,
                 "device_budget": getattr(p, "device_budget", None)} for p in cm._plans.plans()]
json.dump(out, open(sys.argv[1], "w"), indent=1)
