"""The one way the runtime allocates host memory for transfers, counted by kind.

Note [planned host memory]: the host buffers a step needs are planned at compile time
(passes/host_memory.py) and allocated once, then reused every step. Every allocation goes
through `host_empty`, which counts the bytes it hands out per kind, so a test can check that
a warm step allocates nothing and that the bytes allocated agree with `cm.plan`.
"""
from __future__ import annotations

import threading
from collections import Counter

import torch

_lock = threading.Lock()
allocated_bytes: Counter = Counter()     # kind -> bytes handed out since the process started
allocations: Counter = Counter()         # kind -> number of buffers handed out


def host_empty(shape, dtype: torch.dtype, pin, kind: str) -> torch.Tensor:
    """An uninitialised host tensor for the runtime's `kind` of buffer: pinned when `pin` is
    True, in shared files when it is a SharedMemory (runtime/shared.py: worker processes)."""
    if isinstance(pin, bool):
        t = torch.empty(shape, dtype=dtype, pin_memory=pin)
    else:
        t = pin.empty(tuple(shape), dtype)
    with _lock:
        allocated_bytes[kind] += t.numel() * t.element_size()
        allocations[kind] += 1
    return t


def snapshot() -> tuple:
    """(bytes by kind, buffers by kind) so far, to compare with a later snapshot."""
    with _lock:
        return Counter(allocated_bytes), Counter(allocations)
