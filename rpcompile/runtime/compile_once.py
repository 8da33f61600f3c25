"""One compilation of each piece across worker processes.

Note [compile each piece once]: worker processes (Config(workers="processes")) compile the
pieces they run themselves, at their first calls. Replicas run the same pieces on every GPU,
and pipeline stage jobs share their decoder layers, so without coordination every process
compiles, and with a cold cache autotunes, the same piece at the same moment: the cores and the
host memory of the first steps split over identical work. Autotuning is the expensive part for
memory: a kernel that writes a large argument keeps a pinned host copy of it while it tries
configs (Note [autotune's pinned copies], warmup.py), so two replicas of Qwen3-1.7B on 2 H200s
peaked at 32.4 GiB of host memory during the cold compile against 21.1 GiB with a warm cache.

So the first call of a program (warmup.WarmupGuard) or of a piece (programs.LengthDynamic)
with a new input signature takes a file lock named by its code and that signature, in the
workers' shared directory, and holds it until the call returns; the first process to return
leaves a ".done" mark beside the lock. A process that waited, or finds the mark, makes the call
without the lock from what the first left in Inductor's caches (its FX graph, AOTAutograd and
autotuning caches are on disk and shared by the processes of a host): no kernel compiles and no
autotuning. The program's lock is the one that matters for replicas: a backward kernel
autotunes at its first launch, in autograd's backward outside any piece's call. The piece's lock
shares a decoder layer between different stage programs of a pipeline. Different pieces still
compile side by side; the program locks are taken before the piece locks and a piece's holder
waits for nothing, so no two processes wait for each other. A call that fails leaves no mark
(the next process compiles itself), and a file lock dies with its holder, so a crashed worker
leaves no one waiting. With Inductor's FX graph cache off there are no locks (the others would
compile again, after the first instead of beside it). Worker threads share one process and need
none of this: warmup.py runs their first calls one at a time, and the second device reads the
same caches.

Measured (2 H200s, Qwen3-1.7B, replicas in processes, cold caches, one run each side): host
memory peak 32.2 -> 25.8 GiB, setup 69 -> 64 s; worker 1 waited 27 s and then made its first
call in 3 s with every FX graph and AOTAutograd entry read from the cache. The pipeline's
setup 67 -> 61 s (one shared layer piece read back), host memory unchanged.
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
        until one of them has made such a call (then from the caches it filled). What
        Inductor's caches served, and the seconds of the wait and the call, go into the setup
        timeline, named `what`."""
        lock = self(code, signature)
        done = lock.lock_file + ".done"
        t0 = time.perf_counter()
        before = _cache_counts()
        if os.path.exists(done):
            out = call()
        else:
            with lock:
                first = not os.path.exists(done)
                if first:
                    out = call()
                    open(done, "w").close()
            if not first:      # made by another process while this one waited
                out = call()
        counts = [b - a for a, b in zip(before, _cache_counts())]
        took = time.perf_counter() - t0
        if any(counts) or took > 0.1:
            timeline.mark(f"{what} {os.path.basename(lock.lock_file)[8:16]} first called: FX graph cache {counts[0]} hit(s) "
                          f"{counts[1]} miss(es), AOTAutograd cache {counts[2]} hit(s) {counts[3]} miss(es)", took)
        return out


def compile_locks(directory: str):
    """CompileLocks in `directory`, or None where Inductor's FX graph cache is off: a process that
    waited would then compile everything again after the first, one after the other."""
    from torch._inductor import config
    return CompileLocks(directory) if config.fx_graph_cache else None


def _cache_counts() -> list:
    from torch._dynamo.utils import counters
    return [counters[group][name] for group, name in _CACHES]
