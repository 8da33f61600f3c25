"""53rd session: Note [row weights prefetched] in delayed mode's early upload, worker threads and
one worker process on cuda:0. A tiny untied Qwen3 (4 layers) planned as one fused job (no budget)
with the LM head in 2 shards, so the job the next step starts with reads the head's rows; fp32,
SGD with momentum, 4 steps. The process's losses and parameters are compared with the threads'
(delayed mode is a step behind eager PyTorch), and each kind's last step is searched for a weight
read with the compute waiting ("upload_weight"). From the repository root:
`python benchmarks/runs/row_prefetch/check_delayed.py` (`--cpu`: the same on a CPU device)."""
import collections
import copy
import sys

import torch

sys.path[:0] = ["tests", "."]
import rpcompile                                   # noqa: E402
from models import lm_batch, qwen3                 # noqa: E402

kind = "cpu" if "--cpu" in sys.argv else "cuda:0"
base = qwen3(tied=False, layers=4)
results = {}
for workers in ("threads", "processes"):
    model = copy.deepcopy(base)
    cm = rpcompile.compile(model, rpcompile.Config(devices=[kind], num_microbatches=2, dtype=torch.float32,
                                                   lm_head_shards=2, workers=workers, optimizer_mode="delayed",
                                                   compile_stages=False))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    losses = [float(cm.train_step(**lm_batch(batch=4, seed=s))) for s in range(4)]
    cm.synchronize()
    spans = collections.Counter(s["name"] + (" lm_head" if s.get("param") == "lm_head.weight" else "")
                                for s in cm.last_trace if s["name"] in ("upload_weight", "prefetch_weights"))
    results[workers] = (losses, [p.detach().cpu().clone() for p in model.parameters()])
    print(workers, "jobs", len(cm.plan.stages), "losses", [f"{x:.6f}" for x in losses], dict(spans), flush=True)
(la, pa), (lb, pb) = results["threads"], results["processes"]
same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(pa, pb)) and all(
    abs(a - b) <= 1e-5 * abs(a) for a, b in zip(la, lb))
print("processes equal threads:", same, flush=True)
