"""A batched input written in place (tests/test_parity.py WritesItsInput) on CUDA devices against
eager on the host: train_both's loss, gradient and parameter checks, with and without a read of
the input after the write (Note [inputs written in place], 79th session)."""
import torch

import rpcompile
from parity import TIGHT, scalar_loss_step, train_both, xy_batches
from test_parity import WritesItsInput

for late_read in (False, True):
    batches = xy_batches(6, 32)
    given = [b["x"].clone() for b in batches]
    cfg = rpcompile.Config(devices=["cuda:0", "cuda:0"], num_microbatches=2, memory_budget=TIGHT,
                           dtype=torch.float32)    # (bf16 is the GPU default)
    cm = train_both(WritesItsInput(late_read), batches, cfg, eager_step=scalar_loss_step)
    assert all(torch.equal(b["x"], 2 * x) for b, x in zip(batches, given))
    print(f"late_read={late_read}: as eager, {len(cm.plan.stages)} stage jobs")
