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

import ctypes
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


class _InPlace:
    """A tensor's own memory page-locked where it lies (pinned_in_place); unpinned when the last
    holder of this object lets it go. It keeps the tensor (its memory) alive until then."""

    def __init__(self, t: torch.Tensor, address: int, nbytes: int):
        self.tensor, self.address, self.nbytes = t, address, nbytes
        weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, address)


_in_place: "weakref.WeakValueDictionary[int, _InPlace]" = weakref.WeakValueDictionary()


def pinned_in_place(t: torch.Tensor, kind: str = ""):
    """Page-lock the memory of host tensor `t` (contiguous) where it lies, with no copy: a handle
    that keeps it pinned while held (one per address, shared), or None where cudaHostRegister
    refuses it (pages another registration covers, memory it cannot lock), counted in
    `register_failures` as page_locked counts its own (Note [frozen weights in place] in
    runtime/weights.py)."""
    address, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if nbytes == 0:
        return None
    with _lock:
        held = _in_place.get(address)
        if held is not None and held.nbytes == nbytes:
            return held
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))   # (portable: as page_locked)
        if err != 0:
            failed = register_failures.setdefault(kind, [0, err])
            failed[0], failed[1] = failed[0] + 1, err
            return None
        held = _in_place[address] = _InPlace(t.detach(), address, nbytes)
        return held


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


class Reused:
    """Note [reused host buffers]: host tensors of exactly their size, lent out of regions that
    are kept and lent again once the tensor is gone. A lent tensor is `torch.frombuffer` over a
    ctypes array on its region; its storage holds that array until the storage dies (the tensor,
    every view of it and a caller's `untyped_storage()` too), and the array's finalizer hands
    the region back. A region serves a request of at most its size and at least half of it, in
    the same placement (`pin`: pinned or not, or the SharedMemory of worker processes); the free
    regions beyond twice the largest lease (the longest free first) go at the next lend, so a
    caller that held many tensors at once and let them go does not leave them all kept. A lease
    that was not settled when it died (a failed call: writes may still be in flight) is not lent
    again: it goes to `drop` (shared files: every process forgets them), as do the free regions
    at `release`, both from the thread that lends or releases next (a finalizer may run in any
    thread, holding any lock). For a call's outputs (runtime/outputs.py) and a differentiable
    call's gradient set (runtime/grads.py)."""

    def __init__(self, kind: str, drop=None):
        self.kind = kind
        self.drop = drop                 # regions -> None, for those let go (None: they just die)
        self.free: list = []             # (pin, region) back from their lease, settled
        self.dropped: list = []          # regions back unsettled
        self.largest = 0                 # bytes of the largest lease
        self._take = threading.Lock()    # (a finalizer never takes it)

    def lend(self, shape, dtype: torch.dtype, pin):
        """(a host tensor of `shape` and `dtype` placed as host_empty places it, a one-item list to
        set True while nothing writes the tensor)."""
        nbytes = math.prod(shape) * dtype.itemsize
        settled = [False]
        self.largest = max(self.largest, nbytes)
        self._let_go(self._beyond(2 * self.largest))
        with self._take:
            fits = [i for i, r in enumerate(self.free) if r[0] is pin and nbytes <= r[1].numel() <= 2 * nbytes]
            # (by position: a finalizer only appends, and tensors do not compare as booleans)
            found = self.free.pop(min(fits, key=lambda i: self.free[i][1].numel())) if fits else None
        region = found[1] if found is not None else host_empty((max(nbytes, 1),), torch.uint8, pin, self.kind,
                                                               exact=True)
        array = (ctypes.c_uint8 * max(nbytes, 1)).from_address(region.data_ptr())
        weakref.finalize(array, self._back, pin, region, settled)
        # (a tensor of its own on that storage, not a view: the output of an autograd Function
        # may then be written in place, as a concatenation's could)
        storage = torch.frombuffer(array, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape)), settled

    def _back(self, pin, region, settled):
        # (list appends only: a finalizer takes no lock)
        (self.free.append((pin, region)) if settled[0] else self.dropped.append(region))

    def release(self) -> int:
        """Let the free regions go (unpinned, or forgotten by every process); their bytes."""
        regions = self._beyond(0)
        nbytes = sum(r.numel() for r in regions)
        self._let_go(regions)
        return nbytes

    def _beyond(self, keep: int) -> list:
        """Take the free regions past `keep` bytes out of the free list, the newest kept."""
        out, kept, total = [], [], 0     # (kept: newest first)
        with self._take:
            while self.free:        # (pop, not a swap: a finalizer may append meanwhile)
                kept.append(self.free.pop())
            for i, r in enumerate(kept):
                total += r[1].numel()
                if total > keep:
                    out = [r[1] for r in kept[i:]]
                    del kept[i:]
                    break
            self.free.extend(reversed(kept))
        return out

    def _let_go(self, regions):
        while self.dropped:
            regions.append(self.dropped.pop())
        if self.drop is not None and regions:
            self.drop(regions)
