"""Does the caching allocator retry (free its cached blocks and synchronize) in the steps of a plan
whose jobs fill the device? Llama-3.1-8B on one GPU, delayed mode, AdamW, 32 rows of 2048 tokens,
M=4, with `host_memory_budget` (GiB) from the command line (107: one fused job of 32 one-row
microbatches beside a share of 0.47, whose second microbatch was issued 0.42 s after the first
ended, 62nd session). Per step: seconds, the allocator's retries and device allocations, and the
host's wait between microbatch 0's issue and microbatch 1's. From the repository root:
`python benchmarks/runs/alloc_retries/check.py OUT.json 107`."""
import json
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402

spec = get_model("llama3.1-8b")
model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
budget = sys.argv[2] if len(sys.argv) > 2 else None
cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                               optimizer_mode="delayed",
                                               host_memory_budget=f"{budget}GiB" if budget else None))
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
out = {"steps": []}
for step in range(5):
    ids = batch_ids(spec.vocab, 32, 2048, step=step)
    before = torch.cuda.memory_stats(0)
    t = time.perf_counter()
    cm.train_step(input_ids=ids, labels=ids)
    torch.cuda.synchronize(0)
    after = torch.cuda.memory_stats(0)
    spans = [e for e in (cm.last_trace or []) if e.get("stream") == "compute"]
    mbs = sorted((e for e in spans if e.get("microbatch") is not None), key=lambda e: e["start_s"])
    rec = {"seconds": time.perf_counter() - t,
           "alloc_retries": after["num_alloc_retries"] - before["num_alloc_retries"],
           "device_allocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
           "device_frees": after.get("num_device_free", 0) - before.get("num_device_free", 0),
           "reserved_gib": torch.cuda.memory_reserved(0) / 2**30,
           "first_spans": [(e["name"], e.get("job"), e.get("microbatch"), round(e["start_s"], 3), round(e["end_s"], 3),
                            round(e.get("issued_s", -1), 3)) for e in mbs[:4]]}
    out["steps"].append(rec)
    print(json.dumps(rec), flush=True)
out["plan"] = str(cm.plan)[:3000]
json.dump(out, open(sys.argv[1], "w"), indent=1)
