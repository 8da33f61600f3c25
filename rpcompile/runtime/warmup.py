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
        _LOCK.acquire_write()
        t0 = time.perf_counter()
        try:
            out = self.inner(*args)
            self._seen.add(sig)
            return out
        finally:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            first_calls.append((str(device), time.perf_counter() - t0))
            _LOCK.release_write()
