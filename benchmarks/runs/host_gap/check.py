"""Where a delayed-mode run's host memory goes beyond what its plan counts: Qwen3-1.7B (or
Llama-3.1-8B) on one GPU, 32 rows of 2048 tokens, M=4, fused AdamW, 3 train steps; after each,
the process's resident memory grouped by mapping (/proc/self/smaps: the GPU driver's mappings,
which hold pinned memory, anonymous memory, the heap, files), the runner's host buffers, torch's
caching host allocator, and the same after gc.collect() and malloc_trim(0). From the repository
root, on the GPU machine: `python benchmarks/runs/host_gap/check.py OUT.json [MODEL [call]]`
(`call`: first a call, `cm(...)` under no_grad on 8 rows of 2048 tokens, as an evaluation before training)."""
import ctypes
import gc
import json
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

import rpcompile  # noqa: E402
from benchmarks.common import batch_ids, build_model, get_model  # noqa: E402


def mappings() -> dict:
    """Resident GiB by kind of mapping."""
    out: dict = {}
    kind = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                path = head[5] if len(head) > 5 else ""
                kind = ("driver" if path.startswith("/dev/nvidia") else "heap" if path == "[heap]" else
                        "anonymous" if not path else "shm" if path.startswith("/dev/shm") else
                        "stack" if path.startswith("[stack") else "file")
            elif head and head[0] == "Rss:":
                out[kind] = out.get(kind, 0) + int(head[1]) / 2**20
    return {k: round(v, 3) for k, v in out.items()}


def host_allocator() -> dict:
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception as e:       # (older torch)
        return {"error": str(e)}
    return {k: v / 2**30 if "bytes" in k else v for k, v in stats.items()
            if k in ("allocated_bytes.current", "reserved_bytes.current", "allocations.current", "segment.current")}


def snapshot(cm) -> dict:
    out = {"mappings_gib": mappings(), "host_allocator": host_allocator(),
           "host_buffers_gib": {k: v / 2**30 for k, v in cm.runner.host_buffer_bytes().items()}}
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out["mappings_after_trim_gib"] = mappings()
    return out


def main():
    name = sys.argv[2] if len(sys.argv) > 2 else "qwen3-1.7b"
    spec = get_model(name)
    model = build_model(spec, device="cpu", init_device="cuda:0", max_positions=2048)
    res = {"model": spec.name, "start": {"mappings_gib": mappings()}, "steps": []}
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=4, dtype=torch.bfloat16,
                                                   optimizer_mode="delayed"))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
    if sys.argv[3:] == ["call"]:
        ids = batch_ids(spec.vocab, 8, 2048, step=99)
        with torch.no_grad():
            res["call_loss"] = float(cm(input_ids=ids, labels=ids).loss)
        cm.synchronize()
        res["after_call"] = snapshot(cm)
        print(json.dumps(res["after_call"]), flush=True)
    for step in range(3):
        ids = batch_ids(spec.vocab, 32, 2048, step=step)
        t = time.perf_counter()
        loss = float(cm.train_step(input_ids=ids, labels=ids))
        cm.synchronize()
        res["steps"].append({"seconds": time.perf_counter() - t, "loss": loss, **snapshot(cm)})
        print(json.dumps(res["steps"][-1]), flush=True)
        if step == 0:
            res["plan_host"] = cm.plan.host_memory.summary()
            res["plan_host_gib"] = cm.plan.host_memory.total / 2**30
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
