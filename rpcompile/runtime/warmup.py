"""Guards compiled stage graphs against TorchDynamo's process-wide tracing state.

Dynamo and Inductor are not thread-safe while they compile: a compiled function entered from
another thread during a compilation fails ("Detected that you are using FX to symbolically
trace a dynamo-optimized function"). Worker threads therefore call a compiled graph for an
input signature it has not seen yet (which may compile) alone, under the write side of one
process-wide readers-writer lock; calls with known signatures only share the read side, so
in the steady state the devices launch their work concurrently.
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from . import compile_once, timeline

# (device, seconds) of every call that ran alone (first calls: they compile): what a model's
# first steps spend compiling, per device (benchmarks/diagnose.py prints it).
first_calls: list = []
_last_alone = [time.monotonic()]     # when the last call that ran alone ended

# Note [idle compile pools]: Inductor compiles a worker process's kernels in a pool of its own
# (a sidecar process and cores / workers compiling processes: TORCHINDUCTOR_COMPILE_THREADS,
# runtime/processes.py), which works in bursts: the first steps, and a new length. Kept alive
# between bursts, the pools of four workers held 2.3-2.6 GiB of host memory (Qwen3-1.7B and
# Llama-3.1-8B on 4 H200s: 68 and 36 processes beside 35.5 and 116.4 GiB in all; the sidecars
# alone 0.4 GiB each, which Inductor's own quiesce keeps). So a worker shuts its pools once no
# call has compiled for COMPILE_POOL_IDLE_S: taken from Inductor under the write side of the
# lock every compiling call holds, shut outside it; the next compilation starts a pool again
# (Inductor wakes it as a compile begins, beside the tracing).
COMPILE_POOL_IDLE_S = 5.0


def close_idle_compile_pools(idle_s: float = COMPILE_POOL_IDLE_S, poll_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that shuts this process's Inductor compile pools once no call has
    run alone (compiled) for idle_s (Note [idle compile pools])."""
    def loop():
        while True:
            time.sleep(poll_s)
            close_compile_pools_if_idle(idle_s)
    t = threading.Thread(target=loop, name="rpcompile-compile-pools", daemon=True)
    t.start()
    return t


def close_compile_pools_if_idle(idle_s: float) -> bool:
    """Shut Inductor's compile pools if there are any and nothing compiled for idle_s; True if it
    did. The pools are taken out of Inductor's hands under the write side of the lock (no call
    compiles meanwhile, and the next one makes a new pool), but shut after it is released: a
    pool waits for its sidecar to end, and calls holding the read side waited with it (a 2.3 s
    step on 2 H200s while the lock was held throughout)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")   # not imported: no pool
    live = getattr(async_compile, "_pool_set", None)
    if not live or time.monotonic() - _last_alone[0] < idle_s:
        return False
    _LOCK.acquire_write()
    try:
        if not live or time.monotonic() - _last_alone[0] < idle_s:
            return False
        pools = list(live)
        live.clear()                    # Inductor forgets them: the set, its cached pool, the ready future
        async_compile.AsyncCompile.process_pool.cache_clear()
        async_compile.AsyncCompile._ready_future = None
    finally:
        _LOCK.release_write()
    for pool in pools:
        pool.shutdown()
    return True


class _ReadersWriter:
    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    def acquire_read(self):
        with self._cond:
            while self._writing:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            while self._writing or self._readers:
                self._cond.wait()
            self._writing = True

    def release_write(self):
        with self._cond:
            self._writing = False
            self._cond.notify_all()


_LOCK = _ReadersWriter()


def calling_alone() -> bool:
    """Whether a call with a new input signature is running (it holds the write side): only then
    can a piece inside it meet a new signature of its own (compile_once.py)."""
    return _LOCK._writing


def _signature(args) -> tuple:
    sig = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
        else:
            sig.append(a if isinstance(a, (int, float, bool, type(None))) else type(a))
    return tuple(sig)


class WarmupGuard(torch.nn.Module):
    """Calls `inner`; a call with an input signature not seen before runs alone (and, given
    worker processes' CompileLocks, alone among them until one has made it: Note [compile each
    piece once], compile_once.py)."""

    def __init__(self, inner, locks=None):
        super().__init__()
        self.inner = inner
        self.locks = locks
        self._seen: set = set()
        self._shared: set = set()      # signatures a sharing pass made, leaving pieces to others

    def forward(self, *args):
        sig = _signature(args)
        if sig in self._seen:
            _LOCK.acquire_read()
            try:
                return self.inner(*args)
            finally:
                _LOCK.release_read()
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        _LOCK.acquire_write()
        t0 = time.perf_counter()
        try:
            pinned = pinned_bytes(device)
            skipped = compile_once.skipped()
            # Note [pieces compiled side by side]: neither a sharing pass nor the call after one
            # that left pieces to others (they wait for their compilers) takes the program's lock
            if self.locks is None or sig in self._shared or compile_once.in_sharing_pass():
                out = self.inner(*args)
            else:
                out = self.locks.first_call("program", program_key(self.inner), sig, lambda: self.inner(*args))
            if compile_once.skipped() == skipped:
                self._seen.add(sig)
            else:                          # made in part: the next call is alone again
                self._shared.add(sig)
            release_autotune_copies(device, pinned)
            return out
        finally:
            first_calls.append((str(device), time.perf_counter() - t0))
            timeline.mark(f"call alone on {device}", first_calls[-1][1])
            _last_alone[0] = time.monotonic()
            _LOCK.release_write()


def program_key(program) -> str:
    """The code a program's lock is keyed by (Note [compile each piece once], compile_once.py).
    Marked as a program's: a program of one piece (programs.Arriving) has its piece's code, and
    the piece takes its own lock inside the program's first call, which waited on itself under
    one key."""
    return "program\n" + program.code


def compiled_graphs() -> int:
    """Graphs TorchDynamo has compiled in this process so far (its counters' unique graphs)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def pinned_bytes(device) -> int:
    """Bytes torch's caching host allocator holds (pin_memory=True blocks, free ones included);
    0 off CUDA."""
    if device is None or device.type != "cuda":
        return 0
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def device_peaks(device) -> tuple:
    """(bytes allocated, bytes reserved) at most by torch's caching allocator on `device` in this
    process so far; (0, 0) off CUDA."""
    if device is None or device.type != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def release_autotune_copies(device, before: int) -> bool:
    """Note [autotune's pinned copies]: when Inductor autotunes a Triton kernel at its first call
    and the device has less memory spare (its peak less what is allocated) than an argument the
    kernel writes, it keeps that argument's value in a pinned host copy while it tries configs
    (CachingAutotuner.copy_args_to_cpu_if_needed). The copies are freed after the call, but their
    blocks stay cached by torch's caching host allocator, rounded up to powers of two, for the rest
    of the run: on Qwen3-1.7B's one-job plan 10 GiB (the device-side gradient buffers), only when
    the Inductor cache is cold (a warm cache skips the autotuning). So a first call that grew the
    cache (`before` -> now) gives the free blocks back once its copies are done. True if it did.
    (Where the device has room the copies are clones on it: Note [autotune's clones on the
    device], autotune.py; this is for the devices without.)"""
    if pinned_bytes(device) <= before:
        return False
    torch.cuda.synchronize(device)
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or torch._C._host_emptyCache
    empty()
    return True
