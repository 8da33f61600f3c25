"""One compilation of each piece across worker processes.

Note [compile each piece once]: worker processes (Config(workers="processes")) compile the
pieces they run themselves, at their first calls. Replicas run the same pieces on every GPU,
and pipeline stage jobs share their decoder layers, so without coordination every process
compiles, and with a cold cache autotunes, the same piece at the same moment: the cores and the
host memory of the first steps split over identical work. Autotuning is the expensive part for
memory: a kernel that writes a large argument keeps a pinned host copy of it while it tries
configs (Note [autotune's pinned copies], warmup.py), so two replicas of Qwen3-1.7B on 2 H200s
peaked at 32.4 GiB of host memory during the cold compile against 21.1 GiB with a warm cache.

So a piece's first call with a new input signature takes a file lock named by the piece's code
and that signature (in the workers' shared directory). One process compiles; one that asks for
the same piece meanwhile waits, and then compiles from what the first left in Inductor's caches
(its FX graph, AOTAutograd and autotuning caches are on disk and shared by the processes of a
host), which skips the kernel compilation and the autotuning. Different pieces still compile in
parallel. A file lock is released by the kernel when its holder dies, so a crashed worker leaves
no one waiting; worker threads share one process and need no lock (warmup.py serialises their
first calls, and the second device reads the same caches).
"""
from __future__ import annotations

import hashlib
import os
import time

from filelock import FileLock     # a dependency of torch (Inductor locks its caches with it)

from . import timeline

_CACHES = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
           ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


class CompileLocks:
    """File locks, one per (code, input signature), in `directory`."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, code: str, signature: tuple) -> FileLock:
        return FileLock(self._path(code, signature))

    def _path(self, code: str, signature: tuple) -> str:
        digest = hashlib.sha256(f"{code}\n{signature!r}".encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"compile-{digest}.lock")

    def first_call(self, what: str, code: str, signature: tuple, call):
        """call(), the first in this process with this signature: alone among the processes
        until one of them has made such a call (then from the caches it filled); the wait and
        what Inductor's caches served go into the setup timeline, named `what`."""
        path = self._path(code, signature)
        done = path + ".done"
        t0 = time.perf_counter()
        before = _cache_counts()
        if os.path.exists(done):
            out = call()
        else:
            with FileLock(path):
                first = not os.path.exists(done)
                if first:
                    out = call()
                    open(done, "w").close()
            if not first:      # made by another process while this one waited
                out = call()
        counts = [b - a for a, b in zip(before, _cache_counts())]
        waited = time.perf_counter() - t0
        if any(counts) or waited > 0.1:
            timeline.mark(f"{what} {os.path.basename(path)[8:16]} first called: FX graph cache {counts[0]} hit(s) "
                          f"{counts[1]} miss(es), AOTAutograd cache {counts[2]} hit(s) {counts[3]} miss(es)", waited)
        return out


def _cache_counts() -> list:
    from torch._dynamo.utils import counters
    return [counters[group][name] for group, name in _CACHES]
