"""57th session: Note [weights as they arrive] (runtime/job.py) on a GPU. tests/test_overlapped.py's
late_weights_run on cuda:0 (fp32, one fused job; the optimizer slowed to 0.1 s a chunk so the next
step's weights are still being stepped when it starts), eager and Inductor stage compute: losses and
parameters after 3 SGD-with-momentum steps against eager PyTorch on the CPU, and the weights that
went up late. From the repository root: `python benchmarks/runs/weights_arrive/check.py`."""
import sys

import pytest
import torch

sys.path[:0] = ["tests", "."]
from test_overlapped import late_weights_run       # noqa: E402

for compiled in (False, True):
    with pytest.MonkeyPatch.context() as mp:
        cm, late = late_weights_run(mp, ["cuda:0"], tol=(1e-4, 1e-6), dtype=torch.float32, compile_stages=compiled)
    print(f"compile_stages={compiled}: parity ok; {len(cm.plan.stages)} job(s); {len(late)} weights went up late "
          f"({len(set(late))} distinct)", flush=True)
