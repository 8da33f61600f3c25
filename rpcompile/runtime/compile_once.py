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
autotuning. The program's lock is the one that matters for replicas (where no dry run's sharing
pass takes its place, Note [pieces compiled side by side]): a backward kernel autotunes at its
first launch, in autograd's backward outside any piece's call. The piece's lock
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

Note [pieces compiled side by side]: with those locks alone, replicas still compiled their
program one process after the other: the first took every piece's lock in turn while the
others waited at the program's lock, then read the caches (2 H200s, Qwen3-1.7B: 37 s, then 3 s
in the second). A dry run (Note [dry runs], dry_run.py) only needs the shapes of what a piece
gives the next, not its values, so its first pass is a sharing pass: a piece whose lock another
process holds runs uncompiled (its graph module, eagerly) and is left to that process; a piece
that is free is this process's to compile, and it keeps the lock to the end of the pass, since
AOTAutograd writes a piece's cache entry only once its backward has compiled (lazily, at the
backward's first call, later in the pass). Then the pass marks its pieces done and releases
them, and, if it left pieces to others, the dry run runs again: those pieces wait for their
compilers and load what they left in the caches. The program takes no lock of its own after a
sharing pass (every piece's backward ran, and autotuned, under that piece's lock). So each
distinct piece compiles once, on whichever process reached it first, while the others compile
the next ones. A pass never waits for a lock, so no two processes wait for each other.

Measured (2 H200s, Qwen3-1.7B, replicas in processes, cold caches, two runs each side against
the program lock alone): from "ready for the first step" to the first job's end 42 and 40 s ->
25 and 27 s (the three pieces: one process compiled two, the other one; 3.5 s of it the
compile stack imported while the workers wait, Note [compile stack imported early]); setup
84.5 and 71.7 -> 57.6 and 68.4 s (the capture alone varied 10.5-15.4 s between runs); host
memory peak 25.5 -> 27.1 GiB (two processes autotune at once). The pipeline's (4 jobs) setup
63.7 -> 57.2 s.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time

from filelock import FileLock, Timeout     # a dependency of torch (Inductor locks its caches with it)

from . import timeline

_CACHES = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
           ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


class CompileLocks:
    """File locks, one per (code, input signature), in `directory`."""

    def __init__(self, directory: str):
        self.directory = directory
        self.claimed: list = []     # (lock, done mark) this process took in a sharing pass

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
        t0, before = time.perf_counter(), _cache_counts()
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
        _mark_first_call(what, lock, t0, before)
        return out

    def share(self, what: str, code: str, signature: tuple, call, skip):
        """In a sharing pass (Note [pieces compiled side by side]): call() where a process has
        made such a call (from the caches it filled) or where this process takes the lock
        (it compiles, and holds the lock until `settle`); else skip(), and the pass counts it:
        another process is compiling. Returns (result, whether call() made it)."""
        lock = self(code, signature)
        done = lock.lock_file + ".done"
        if not os.path.exists(done):
            try:
                lock.acquire(timeout=0)
            except Timeout:
                _pass.skipped += 1
                if lock.lock_file not in _pass.left:     # (a decoder layer's piece: once, not per layer)
                    _pass.left.add(lock.lock_file)
                    timeline.mark(f"{what} {_short(lock)} left to the process compiling it")
                return skip(), False
            if os.path.exists(done):   # marked between the look and the lock
                lock.release()
            else:
                self.claimed.append((lock, done))
        t0, before = time.perf_counter(), _cache_counts()
        out = call()
        _mark_first_call(what, lock, t0, before)
        return out, True

    def settle(self, ok: bool) -> None:
        """End a sharing pass: release the locks it took, each marked done if the pass ran
        through (the backward its compile needs has run: AOTAutograd writes a piece's cache
        entry once its backward compiled)."""
        claimed, self.claimed = self.claimed, []
        for lock, done in claimed:
            if ok:
                open(done, "w").close()
            lock.release()


_pass = threading.local()


@contextlib.contextmanager
def sharing_pass():
    """A sharing pass on this thread (Note [pieces compiled side by side]); yields its state,
    whose `skipped` counts the pieces it left to other processes."""
    _pass.active, _pass.skipped, _pass.left = True, 0, set()
    try:
        yield _pass
    finally:
        _pass.active = False


def in_sharing_pass() -> bool:
    return getattr(_pass, "active", False)


def skipped() -> int:
    """Pieces the current sharing pass has left to other processes so far."""
    return _pass.skipped if in_sharing_pass() else 0


def _short(lock) -> str:
    return os.path.basename(lock.lock_file)[8:16]


def _mark_first_call(what, lock, t0, before):
    counts = [b - a for a, b in zip(before, _cache_counts())]
    took = time.perf_counter() - t0
    if any(counts) or took > 0.1:
        timeline.mark(f"{what} {_short(lock)} first called: FX graph cache {counts[0]} hit(s) "
                      f"{counts[1]} miss(es), AOTAutograd cache {counts[2]} hit(s) {counts[3]} miss(es)", took)


def compile_locks(directory: str):
    """CompileLocks in `directory`, or None where Inductor's FX graph cache is off: a process that
    waited would then compile everything again after the first, one after the other."""
    from torch._inductor import config
    return CompileLocks(directory) if config.fx_graph_cache else None


def _cache_counts() -> list:
    from torch._dynamo.utils import counters
    return [counters[group][name] for group, name in _CACHES]
