"""Python imports `sitecustomize` at every interpreter's start where this folder is on
PYTHONPATH (a test puts it there): in rpcompile's worker processes, torch.compile then uses
aot_eager instead of Inductor, for tests of what worker processes do with compiled pieces
(Note [dry runs]) without Inductor's C++ compiles (3 minutes on 2 cores). A worker imports none
of the model's modules (Note [early workers]), so this is where such a test reaches it."""
import os
import sys

if os.environ.get("RPCOMPILE_WORKER_INDEX") is not None:     # in a worker process only
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/, for parity
    import torch

    from parity import aot_eager_compile

    torch.compile = aot_eager_compile(torch.compile)
