"""Python imports `sitecustomize` at every interpreter's start where this folder is on
PYTHONPATH (a test puts it there): in rpcompile's worker processes, torch.compile then uses
aot_eager instead of Inductor, for tests of what worker processes do with compiled pieces
(Note [dry runs]) without Inductor's C++ compiles (3 minutes on 2 cores). A worker imports none
of the model's modules (Note [early workers]), so this is where such a test reaches it.

With RPCOMPILE_TEST_TRACE_FAILS set, a worker cannot read its spans (Tracer.resolve raises).

With RPCOMPILE_TEST_MARKS set to a folder, a worker also writes there a file for each of its
timeline marks as it makes it (a worker sends its marks only with its landed jobs): a test's main
process can wait for a worker's mark made before any job, instead of holding a guessed time."""
import os
import sys

# in a worker process only, or the launcher that forks them (Note [worker launcher]), whose
# children keep what it set up here
if os.environ.get("RPCOMPILE_WORKER_INDEX") is not None or os.environ.get("RPCOMPILE_LAUNCHER_FDS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/, for parity
    import torch

    from parity import aot_eager_compile

    torch.compile = aot_eager_compile(torch.compile)

    if os.environ.get("RPCOMPILE_TEST_MARKS"):
        import itertools

        from rpcompile.runtime import timeline

        _folder, _count, _mark = os.environ["RPCOMPILE_TEST_MARKS"], itertools.count(), timeline.mark

        def _mark_and_write(what, seconds=None):
            _mark(what, seconds)
            name = os.path.join(_folder, f"{os.environ['RPCOMPILE_WORKER_INDEX']}.{next(_count)}")
            with open(name + ".part", "w") as f:
                f.write(what)
            os.replace(name + ".part", name)      # a reader sees whole marks only

        timeline.mark = _mark_and_write

    if os.environ.get("RPCOMPILE_TEST_TRACE_FAILS"):     # a worker's spans cannot be read
        from rpcompile.runtime.trace import Tracer

        def _resolve_fails(self, raw, shift=0.0):
            raise RuntimeError("Both events must be completed before calculating elapsed time. (a test's)")

        Tracer.resolve = _resolve_fails
