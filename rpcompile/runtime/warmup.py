"""Guards compiled stage graphs against TorchDynamo's process-wide tracing state.

Dynamo and Inductor are not thread-safe while they compile: a compiled function entered from
another thread during a compilation fails ("Detected that you are using FX to symbolically
trace a dynamo-optimized function"). Worker threads therefore call a compiled graph for an
input signature it has not seen yet (which may compile) alone, under the write side of one
process-wide readers-writer lock; calls with known signatures only share the read side, so
in the steady state the devices launch their work concurrently.
"""
from __future__ import annotations

import threading
import time

import torch

# (device, seconds) of every call that ran alone (first calls: they compile): what a model's
# first steps spend compiling, per device (benchmarks/diagnose.py prints it).
first_calls: list = []


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


def _signature(args) -> tuple:
    sig = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
        else:
            sig.append(a if isinstance(a, (int, float, bool, type(None))) else type(a))
    return tuple(sig)


class WarmupGuard(torch.nn.Module):
    """Calls `inner`; a call with an input signature not seen before runs alone."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self._seen: set = set()

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
            out = self.inner(*args)
            self._seen.add(sig)
            release_autotune_copies(device, pinned)
            return out
        finally:
            first_calls.append((str(device), time.perf_counter() - t0))
            _LOCK.release_write()


def pinned_bytes(device) -> int:
    """Bytes torch's caching host allocator holds (pin_memory=True blocks, free ones included);
    0 off CUDA."""
    if device is None or device.type != "cuda":
        return 0
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def release_autotune_copies(device, before: int) -> bool:
    """Note [autotune's pinned copies]: when Inductor autotunes a Triton kernel at its first call
    and the device has less memory spare (its peak less what is allocated) than an argument the
    kernel writes, it keeps that argument's value in a pinned host copy while it tries configs
    (CachingAutotuner.copy_args_to_cpu_if_needed). The copies are freed after the call, but their
    blocks stay cached by torch's caching host allocator, rounded up to powers of two, for the rest
    of the run: on Qwen3-1.7B's one-job plan 10 GiB (the device-side gradient buffers), only when
    the Inductor cache is cold (a warm cache skips the autotuning). So a first call that grew the
    cache (`before` -> now) gives the free blocks back once its copies are done. True if it did."""
    if pinned_bytes(device) <= before:
        return False
    torch.cuda.synchronize(device)
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or torch._C._host_emptyCache
    empty()
    return True
