"""The one way the runtime allocates host memory for transfers, counted by kind.

Note [planned host memory]: the host buffers a step needs are planned at compile time
(passes/host_memory.py) and allocated once, then reused every step. Every allocation goes
through `host_empty`, which counts the bytes it hands out per kind, so a test can check that
a warm step allocates nothing and that the bytes allocated agree with `cm.plan`.

Note [exact pinned buffers]: torch's caching host allocator (`pin_memory=True`) rounds every
block up to a power of two, so that a freed block serves the next request of its size class.
That suits buffers freed and asked for again every step (activation slots), and wastes up to
half of a buffer allocated once: on Qwen3-1.7B a 24 MiB bf16 working copy of an MLP weight took
32 MiB, the 622 MB embedding 1 GiB, and the 8.1 GB flat gradient buffer 8.6 GB (1.9 B/param
over both working copies and both gradient sets). Buffers allocated once (working copies,
gradient sets) are therefore `exact`: pageable memory of the size asked for, page-locked with
cudaHostRegister and unregistered before it is freed.
"""
from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections import Counter

import torch

_lock = threading.Lock()
allocated_bytes: Counter = Counter()     # kind -> bytes handed out since the process started
allocations: Counter = Counter()         # kind -> number of buffers handed out
_PAGE = 4096
_registered: dict = {}                   # address -> the pageable tensor registered there (kept alive)
register_failures: dict = {}             # kind -> [failed cudaHostRegister calls, last error code]


def _unregister(address: int) -> None:
    """Unpin an exact buffer, then let its memory go (in that order: Note [exact pinned buffers])."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    finally:
        _registered.pop(address, None)


def page_locked(shape, dtype: torch.dtype, kind: str = "") -> torch.Tensor:
    """A page-locked host tensor of exactly its size (Note [exact pinned buffers]); the caching
    allocator's (rounded) where registering fails, counted in `register_failures` and warned of
    once per kind (a 6.4 GiB buffer then takes 8 GiB)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    base = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    start = (-base.data_ptr()) % _PAGE          # page-aligned: no page is shared with another buffer
    buf = base[start:start + nbytes]
    address = buf.data_ptr()
    # Note [touch before pinning]: the pages are faulted in first (a fill on the intra-op
    # threads); cudaHostRegister then only pins them. 4 GiB on an H200 host: 2.72 s to register
    # untouched memory, 0.79 s to touch it and 0.48 s to register it then (twenty-fourth session).
    buf.zero_()
    # cudaHostRegisterPortable: pinned for every device's context (worker threads drive several GPUs)
    err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))
    if err != 0:
        with _lock:
            failed = register_failures.setdefault(kind, [0, err])
            failed[0], failed[1] = failed[0] + 1, err
        if failed[0] == 1:
            warnings.warn(f"rpcompile: cudaHostRegister failed (CUDA error {err}) for {nbytes / 2**30:.2f} GiB of "
                          f"{kind or 'host buffers'}; torch's caching host allocator pins it instead, rounded up "
                          "to a power of two", stacklevel=3)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    _registered[address] = base
    t = buf.view(dtype).view(shape)
    # unpinned when the tensor object dies; until then `_registered` keeps the memory alive
    weakref.finalize(t, _unregister, address)
    return t


def host_empty(shape, dtype: torch.dtype, pin, kind: str, exact: bool = False) -> torch.Tensor:
    """An uninitialised host tensor for the runtime's `kind` of buffer: pinned when `pin` is
    True, in shared files when it is a SharedMemory (runtime/shared.py: worker processes).
    exact: a pinned buffer allocated once, of exactly its size rather than the caching host
    allocator's power of two (Note [exact pinned buffers])."""
    if isinstance(pin, bool):
        t = page_locked(shape, dtype, kind) if (pin and exact) else torch.empty(shape, dtype=dtype, pin_memory=pin)
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
