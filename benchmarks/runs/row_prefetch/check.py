"""52nd session: Note [row weights prefetched] (runtime/job.py) on a GPU. A tiny untied Qwen3 on
cuda:0 (fp32, several jobs, the LM head in 2 shards), exact mode and SGD-momentum against eager
PyTorch on the CPU (tests/parity.train_both), and the last step's weight uploads: with the rows
prefetched, no job reads an LM head shard's rows with its compute waiting ("upload_weight").
From the repository root: `python benchmarks/runs/row_prefetch/check.py`."""
import collections
import sys

import torch

sys.path[:0] = ["tests", "."]
import rpcompile                                   # noqa: E402
from models import lm_batch, qwen3                 # noqa: E402
from parity import train_both                      # noqa: E402

kind = "cpu" if "--cpu" in sys.argv else "cuda"     # (--cpu: the same on CPU devices, which upload nothing)
for workers, devices in (("threads", [f"{kind}:0"]), ("processes", [f"{kind}:0", f"{kind}:1"])):
    if kind == "cuda" and len(devices) > torch.cuda.device_count():
        continue
    devices = [kind] * len(devices) if kind == "cpu" else devices
    cfg = rpcompile.Config(devices=devices, num_microbatches=2 * len(devices), dtype=torch.float32,
                           memory_budget="300KiB", lm_head_shards=2, workers=workers, compile_stages=False)
    cm = train_both(qwen3(tied=False, layers=4), [lm_batch(batch=4, seed=s) for s in range(3)], cfg,
                    check_every_step=True)
    spans = collections.Counter(s["name"] + (" lm_head" if s.get("param") == "lm_head.weight" else "")
                                for s in cm.last_trace if s["name"] in ("upload_weight", "prefetch_weights"))
    print(workers, "jobs", len(cm.plan.stages), "replicas", cm.plan.replicas, "parity ok;", dict(spans), flush=True)
