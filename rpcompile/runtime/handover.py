"""Hand-over flags: how one worker process tells another, on the GPU, that a download landed.

Note [hand-over flags]: with worker threads, a job's kernels are issued as soon as the job
before it has issued its own: the consumer's stream waits on the producer's CUDA event, on the
GPU. Worker processes cannot share events (each sees only its GPU), and a first version sent a
hand-over message only once the producer's downloads had landed, so the consumer issued only
then: each hand-over added the consumer's issue time to the critical path (2x H100: waits of
0.51-0.65 s per step against 0.12 s for threads).

So every worker owns one 32-bit counter in a small shared host file, mapped and page-locked
in every worker. A producer's download stream writes the next number of its counter after a
microbatch's copies (cuStreamWriteValue32, which fences the writes before it); the hand-over
message goes out at once and carries (producer, number). The consumer's upload stream waits
on the GPU until the counter has reached the number (cuStreamWaitValue32), so the consumer
issues its kernels at once, ahead of the data, as a thread does. Counters only grow, and
numbers are compared modulo 2**32 (the GEQ wait is cyclic), so one counter serves every step.
On a CPU "device" the producer writes the counter from the host after its (synchronous)
copies and a reader checks it on the host: the same messages, numbers and checks as on a GPU.
"""
from __future__ import annotations

import ctypes
import time

import torch

from .device import Pending

_WAIT_GEQ = 0          # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_WRITE_DEFAULT = 0     # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


class _StreamMemOps:
    """cuStreamWriteValue32 / cuStreamWaitValue32 on a page-locked host table (libcuda)."""

    def __init__(self, table: torch.Tensor):
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = _function(lib, "cuStreamWriteValue32")
        self._wait = _function(lib, "cuStreamWaitValue32")
        get_pointer = _function(lib, "cuMemHostGetDevicePointer")
        get_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        ptr = ctypes.c_uint64()
        _check(get_pointer(ctypes.byref(ptr), ctypes.c_void_p(table.data_ptr()), 0), "cuMemHostGetDevicePointer")
        self.base = ptr.value

    def write(self, stream, slot: int, value: int) -> None:
        _check(self._write(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self.base + 4 * slot),
                           ctypes.c_uint32(value), ctypes.c_uint(_WRITE_DEFAULT)), "cuStreamWriteValue32")

    def wait(self, stream, slot: int, value: int) -> None:
        _check(self._wait(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self.base + 4 * slot),
                          ctypes.c_uint32(value), ctypes.c_uint(_WAIT_GEQ)), "cuStreamWaitValue32")


def _function(lib, name):
    for n in (name + "_v2", name):       # the _v2 entry points need no device attribute
        if hasattr(lib, n):
            fn = getattr(lib, n)
            fn.restype = ctypes.c_int
            return fn
    raise OSError(f"libcuda has no {name}")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed (CUresult {result})")


def reached(counter: int, number: int) -> bool:
    """Whether a counter has reached `number`, modulo 2**32 (as the GPU's GEQ wait compares)."""
    return (counter - number) % (1 << 32) < (1 << 31)


class HandoverFlags:
    """The counters of every worker (`table`, int32, shared), as worker `index` uses them."""

    def __init__(self, table: torch.Tensor, index: int, device: torch.device):
        self.table, self.index = table, index
        self.number = int(table[index]) & 0xFFFFFFFF
        # raises where the driver cannot: the worker then hands over only landed data
        self._gpu = _StreamMemOps(table) if device.type == "cuda" else None

    def signal(self, stream) -> int:
        """Mark that what this worker's `stream` (its download stream; None on a CPU device)
        has copied so far has landed, once it has; returns the number a consumer waits for."""
        self.number = (self.number + 1) & 0xFFFFFFFF
        if self._gpu is None:
            self.table[self.index] = _signed(self.number)
        else:
            self._gpu.write(stream, self.index, self.number)
        return self.number

    def landed(self, producer: int, number: int) -> bool:
        return reached(int(self.table[producer]) & 0xFFFFFFFF, number)

    def wait_on(self, stream, producer: int, number: int) -> None:
        """Make `stream` (of this worker's GPU) wait until the producer's counter reached number."""
        self._gpu.wait(stream, producer, number)

    def wait_host(self, producer: int, number: int) -> None:
        pause = 20e-6
        while not self.landed(producer, number):
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def _signed(n: int) -> int:
    return n - (1 << 32) if n >= (1 << 31) else n


class Flagged(Pending):
    """A host tensor another worker is downloading into: complete once that worker's counter
    reached `number` (Note [hand-over flags])."""

    __slots__ = ("flags", "producer", "number")

    def __init__(self, tensor, flags: HandoverFlags, producer: int, number: int):
        super().__init__(tensor, None)
        self.flags, self.producer, self.number = flags, producer, number

    def wait_on(self, stream):
        self.flags.wait_on(stream, self.producer, self.number)

    def landed(self):
        self.flags.wait_host(self.producer, self.number)
        return self.tensor
