"""A model whose module, imported by a worker process (Note [early workers]), makes that
process's torch.compile use aot_eager instead of Inductor: tests of what worker processes do
with compiled pieces (Note [dry runs]) without Inductor's C++ compiles (3 minutes on 2 cores)."""
import os

import torch

from parity import aot_eager_compile

if os.environ.get("RPCOMPILE_WORKER_INDEX") is not None:     # in a worker process only
    torch.compile = aot_eager_compile(torch.compile)


class InWorkers(torch.nn.Module):
    """`inner`, called as it is: its worker processes compile with aot_eager (PYTHONPATH must
    name this folder, so that they import this module before anything compiles)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        return self.inner(**kw)
