"""Host memory shared by the processes of a run: files in /dev/shm mapped into each.

Note [shared host memory]: with Config(workers="processes") every host buffer the devices
read or write (weight working copies, gradient buffers, activation slots, and frozen parameters
that are their own working copies: Note [frozen weights in place] in weights.py) lives in a file
under /dev/shm, mapped by the main process and by every worker process; a GPU worker
registers each mapping as page-locked (cudaHostRegister) so its copies are asynchronous.
Messages between processes then carry only a `Ref` (file, byte offset, shape, dtype): a few
dozen bytes, whatever the tensor's size. Files are removed when the main process closes the
memory (or exits); a process that mapped one keeps its mapping.

Note [stale shared files]: a main process killed (SIGKILL, or SIGTERM, whose default action
runs no exit handler: `timeout`, a batch system, the benchmark harness) leaves its directory
behind, and /dev/shm is memory: Qwen3-1.7B's 4-GPU layout keeps 16 GiB of files there (Shmem
in the thirty-second session's runs), which would stay until the next reboot. So
the directory's owner holds an exclusive lock (flock) on a file in it while it lives, and a
new run's SharedMemory removes every `rpcompile-*` directory whose lock it can take: the kernel
drops a lock with the last descriptor of the process that held it, however the process ended
(and whatever PID namespace it ran in, where a PID check could not tell). A directory is
locked before it gets its name, so none is ever seen unlocked while its owner lives.
"""
from __future__ import annotations

import fcntl
import itertools
import math
import os
import queue
import shutil
import tempfile
import threading
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

_ALIGN = 512


class SharedMemoryFull(MemoryError):
    """Host buffers for worker processes do not fit the shared-memory file system."""


@dataclass(frozen=True)
class Ref:
    """Where a contiguous host tensor lies in shared memory."""

    file: str
    offset: int            # bytes from the start of the file
    shape: tuple
    dtype: torch.dtype


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _remove(path, lock_fd=None):
    shutil.rmtree(path, ignore_errors=True)
    if lock_fd is not None:
        os.close(lock_fd)


_LOCK_FILE = "owner.lock"


def _locked_directory(root: str) -> tuple:
    """(path, descriptor) of a new run directory under root, its lock file held exclusively by
    this process before the directory takes its name (Note [stale shared files])."""
    tmp = tempfile.mkdtemp(prefix=".rpcompile-new-", dir=root)
    fd = os.open(os.path.join(tmp, _LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = os.path.join(root, f"rpcompile-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(tmp, path)
    return path, fd


def remove_stale_directories(root: str | None = None) -> list:
    """Remove the run directories under root (/dev/shm) whose owner process has ended: those whose
    lock file nobody holds (Note [stale shared files]); the paths removed."""
    root = root or _shm_root()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith("rpcompile-"):
            continue
        try:
            fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDWR)
        except OSError:            # not a directory of ours, or one from before the lock files
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:            # its owner lives
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed.append(path)
    return removed


def _unlock(locked: dict) -> None:
    """Unpin the files `SharedMemory.page_lock` pinned, before their mappings go (the pages
    would stay pinned otherwise)."""
    while locked:
        cuda_unregister(locked.popitem()[1])


class SharedMemory:
    """Shared files of one run: made here (`empty`), or opened by name (`tensor(ref)`).

    register(base uint8 tensor) is called once per file this process maps (a GPU worker
    pins it there)."""

    def __init__(self, directory: str | None = None, register=None, unregister=None):
        self.owner = directory is None
        if self.owner:
            remove_stale_directories()
            self.directory, lock_fd = _locked_directory(_shm_root())
            self._finalizer = weakref.finalize(self, _remove, self.directory, lock_fd)
        else:
            self.directory = directory
        self._register, self._unregister = register, unregister
        st = os.statvfs(self.directory)
        self.capacity = st.f_blocks * st.f_frsize               # the file system's size (a tmpfs: its limit)
        self.others = (st.f_blocks - st.f_bfree) * st.f_frsize  # what others used when we began
        self._files: dict = {}        # name -> base uint8 tensor
        self._by_ptr: dict = {}       # storage data_ptr -> name
        self._names = itertools.count()
        self._made: dict = {}         # name -> bytes, the files this process made
        self._locked: dict = {}       # name -> base: the files `page_lock` registered in this process
        self._lock_failed: set = set()   # names of the files it could not register
        weakref.finalize(self, _unlock, self._locked)
        self._lock = threading.Lock()
        self.created_bytes = 0

    def close(self):
        _unlock(self._locked)
        if self.owner:
            self._finalizer()

    def _map(self, name: str, nbytes: int, new: bool = False) -> torch.Tensor:
        base = torch.from_file(os.path.join(self.directory, name), shared=True, size=nbytes, dtype=torch.uint8)
        if new:
            # Note [shared files touched before pinning]: a new file's pages are made here, by a
            # fill on the intra-op threads (a new file reads as zeros: nothing changes), before any
            # process pins its mapping. cudaHostRegister of untouched pages makes them one fault at
            # a time: each worker took 10.3 s to pin Llama-3.1-8B's 15 GiB gradient file (2 H200s,
            # 44th session). Here (2 cores) locking a second mapping of a 4 GiB file took 9.75 s
            # untouched, 2.77 + 0.43 s after the fill; posix_fallocate (1.01 s) left the pages to
            # be zeroed at their first fault, and the lock took 3.93 s. The fill also speeds the
            # first write: a bf16 copy of 2^29 fp32 elements into a new file took 1.5-1.8 s, and
            # 0.67 + 0.05 s after the fill (Llama-3.1-8B's "working copies made": 8.6 s on 2 H200s).
            # Measured there (45th session): the workers pinned the gradient file in 1.6-3.0 s
            # against 10.4-11.1 s, the main process made the copies in 10.4-12.2 s against 7.3-8.5 s.
            base.zero_()
        if self._register is not None:
            self._register(base)
        self._files[name] = base
        self._by_ptr[base.untyped_storage().data_ptr()] = name
        return base

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new shared host tensor (its own file)."""
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        with self._lock:
            if self.others + self.created_bytes + nbytes > self.capacity:
                raise SharedMemoryFull(
                    f"rpcompile: worker processes keep host buffers in shared memory ({_shm_root()}, "
                    f"{self.capacity / 2**30:.2f} GiB, {self.others / 2**30:.2f} GiB of it used by others), and "
                    f"{(self.created_bytes + nbytes) / 2**30:.2f} GiB would not fit. Give the machine a larger "
                    "/dev/shm (docker run --shm-size=..., or mount -o remount,size=... /dev/shm) or use "
                    "Config(workers='threads').")
            name = f"{os.getpid()}-{next(self._names)}"
            with open(os.path.join(self.directory, name), "wb") as f:
                f.truncate(nbytes)
            base = self._map(name, nbytes, new=True)
            self.created_bytes += nbytes
            self._made[name] = nbytes
        return base[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def page_lock(self, t: torch.Tensor) -> bool:
        """Page-lock this process's mapping of the file t lies in (once per file), for
        asynchronous copies between it and a device: the main process's optimizer uploads
        gradients from files the workers write and copies working copies down into files they
        read (Notes [gradients page-locked in the main process] and [working copies from the
        devices] in runtime/flat.py). False if t lies in none of this process's files, or
        registering it failed (warned of once; its copies are then synchronous, as from any
        pageable memory: slower, same results)."""
        with self._lock:
            name = self._by_ptr.get(t.untyped_storage().data_ptr())
            if name is None or name in self._lock_failed:
                return False
            if name not in self._locked and self._register is None:
                try:
                    cuda_register(self._files[name])
                except RuntimeError as e:
                    self._lock_failed.add(name)
                    if len(self._lock_failed) == 1:
                        warnings.warn(f"rpcompile: {e}; the optimizer's copies between such files and the "
                                      "devices are synchronous (slower, same results)", stacklevel=2)
                    return False
                self._locked[name] = self._files[name]
        return True

    def forget(self, names) -> None:
        """Drop this process's mappings of files no slot set holds any more (Note [outgrown
        slots]), unpinned first; the owner also removes the files, so that their memory goes once
        no process maps them (a tensor still viewing one keeps its mapping until it dies)."""
        for name in names:
            with self._lock:
                base = self._files.pop(name, None)
                if base is not None:
                    self._by_ptr.pop(base.untyped_storage().data_ptr(), None)
                self.created_bytes -= self._made.pop(name, 0)
                locked = self._locked.pop(name, None) is not None
            if base is not None and self._unregister is not None:
                self._unregister(base)
            elif base is not None and locked:
                cuda_unregister(base)
            if self.owner:
                try:
                    os.remove(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def ref(self, t: torch.Tensor):
        """The Ref of a contiguous tensor in one of the files this process mapped, else None."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        name = self._by_ptr.get(t.untyped_storage().data_ptr())
        if name is None:
            return None
        return Ref(name, t.storage_offset() * t.element_size(), tuple(t.shape), t.dtype)

    def tensor(self, ref: Ref) -> torch.Tensor:
        """The tensor a Ref names (mapping its file on first use)."""
        base = self._files.get(ref.file)
        if base is None:
            with self._lock:
                base = self._files.get(ref.file)
                if base is None:
                    base = self._map(ref.file, os.path.getsize(os.path.join(self.directory, ref.file)))
        n = math.prod(ref.shape) * ref.dtype.itemsize
        return base[ref.offset:ref.offset + n].view(ref.dtype).view(ref.shape)


# Note [finalizers take no lock]: a step gives its slot set back from the finalizer of its
# StepState (runtime/executor.py; processes.py's _Hub.step_gone, which also has the workers drop
# the step). A finalizer runs where the last reference goes, or in a garbage collection that any
# allocation may start: in any thread, in the middle of any code, perhaps one holding the lock
# the finalizer would take (a plain Lock: a hang), or halfway through a message written to a
# worker's connection (a reentrant lock: a garbled message). So the finalizer only puts the set
# or record in a queue.SimpleQueue (whose put is safe there) and, with worker processes, wakes
# the receiver thread through a socket pair; the sets are sorted, and the steps released, by
# code that may take locks: the receiver thread, a landing, and SlotSets.take/free_sets
# (SlotSets.gather), so a step issued after the last one was dropped still finds its set free.
# Reused (runtime/host_buffers.py) is built the same way: its finalizer only appends. The
# executors' own finalizers (`_stop`, when a compiled model goes) likewise: worker threads take
# their end from a SimpleQueue; worker processes are told "stop" only where the connection's
# lock comes free within a second (else the worker ends at its connection's close, as on "stop").


def drained(q: queue.SimpleQueue):
    """The items queued in `q` so far, taken out one by one."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


class SlotSets:
    """Note [slot sets]: the shared files a step's downloads land in (activations, checkpoints,
    gradients of activations, outputs), per job of the step, reused by a later step's same job
    whichever worker runs it. A step takes a set when it is issued and gives it back when the
    main process releases it (every job landed, its StepState gone), so there are as many sets
    as steps alive at once (two in delayed mode: a step and the one whose backward jobs run
    beside it), each holding one step's downloads: what the plan counts as activations and
    checkpoints (passes/host_memory.py). Before, each worker kept the chunks (64 MiB and up) its
    steps had used for its own later steps; as the jobs rotate over the devices, every worker
    came to hold room for its largest share of a step, for each step alive, and a chunk one
    worker freed never served another. Measured on 4x H200 (Qwen3-1.7B, one run each, one
    machine): the workers' files 11.15 GiB against 12.73 GiB before. A set then held 1.7x what
    the plan counts for a step (6.5 GiB for two): the LM-head shard jobs also sent their weight
    rows' gradients, which no job read (each set's bytes per job, which the benchmarks record,
    showed it; passes/codegen.py keeps them out of a job's grad_inputs now).

    A set maps (run number, job) -> the Refs of that job's chunks. The job's worker
    bump-allocates its downloads in them in order (the same shapes every step: the same slots)
    and adds a chunk where they are full, reported with the job's landing; so a set grows to the
    largest step it served, and no further.

    Worker threads (runtime/executor.py) take sets too, of page-locked chunks of exactly their
    size, keyed (job, role), in place of torch's caching host allocator, which rounds each block
    up to a power of two and keeps every block it ever made (Llama-3.1-8B on one H200: 18.2 GiB
    of pinned blocks for the 6.0 GiB of activations the plan counts for two steps). A step's set
    goes back when its StepState is gone, with an event on each GPU stream: copies of the step
    issued before may still read its slots, so it is free once those events completed. A value
    the caller keeps (a call's outputs) is downloaded into a buffer of its own, never a slot.
    Measured (RESULTS.md, twentieth session), Qwen3-1.7B on one H100: host memory 35.7 GiB
    (plan 31.3) and 32 bytes in torch's host allocator, against 48.1 GiB without sets (that run
    timed out after 4 timed steps, its Inductor cache cold); 41,788 tokens/s.
    """

    def __init__(self):
        self._free: list = []
        self._pending: list = []      # (set, events): given back, free once the events completed
        self._given: queue.SimpleQueue = queue.SimpleQueue()   # (set, events) given back, not yet sorted
        self._lock = threading.Lock()
        self.made = 0
        self.gather: Optional[Callable[[], None]] = None   # gives back what the owner's finalizers queued

    def _sort_given(self) -> None:
        """(under the lock) The sets given back since, into the pending ones."""
        self._pending.extend(drained(self._given))

    def take(self) -> dict:
        if self.gather is not None:
            self.gather()
        with self._lock:
            self._sort_given()
            done = [all(e.query() for e in events) for _, events in self._pending]
            self._free += [slots for (slots, _), d in zip(self._pending, done) if d]
            self._pending = [p for p, d in zip(self._pending, done) if not d]
            if self._free:
                return self._free.pop()
            self.made += 1
            return {}

    def give(self, slots: dict, events=()) -> None:
        """A set no step uses; free once `events` (each device's streams as the step was dropped:
        with worker threads a copy may still read its slots then) have completed. Called from a
        step's finalizer (Note [finalizers take no lock]): it only queues the set."""
        self._given.put((slots, list(events)))

    def free_sets(self) -> list:
        """The sets no step holds now, whatever their events (what a benchmark reports of them)."""
        if self.gather is not None:
            self.gather()
        with self._lock:
            self._sort_given()
            return list(self._free) + [slots for slots, _ in self._pending]


class SlotPool:
    """Host slots for one job's downloads in one step, bump-allocated in the chunks of its slot
    set (Note [slot sets]) and in chunks it adds (`created`, reported to the main process)."""

    def __init__(self, memory, chunks=(), chunk_bytes: int = 256 << 10):
        self.memory, self.chunk_bytes = memory, chunk_bytes      # memory.empty(shape, dtype): a chunk
        self._chunks: list = [[c, 0] for c in chunks]      # [uint8 tensor, used bytes]
        self.created: list = []
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        need = -(-max(n, 1) // _ALIGN) * _ALIGN
        with self._lock:
            chunk = next((c for c in self._chunks if c[0].numel() - c[1] >= need), None)
            if chunk is None:
                base = self.memory.empty((max(self.chunk_bytes, need),), torch.uint8)
                self.created.append(base)
                chunk = [base, 0]
                self._chunks.append(chunk)
            start = chunk[1]
            chunk[1] += need
        return chunk[0][start:start + n].view(dtype).view(shape)

    def kept(self) -> list:
        """The chunks the job keeps in its slot set after this step. Note [outgrown slots]: a
        job's downloads are the same shapes every step at one sequence length, so its chunks
        fit them exactly; at a longer length they outgrow them, the pool adds chunks, and the
        old ones would stay in the set unused, step after step: the set would hold the sum over
        every length seen (Llama-3.1-8B's max-length search ran 32,768 then 65,536 tokens in one
        process and peaked at 251 GB of host memory, 31 B/param). So a step that added chunks
        keeps only the chunks it used; one that added none keeps them all (a shorter length's
        downloads fit the longer one's chunks: batches of varying length do not reallocate
        every step). With worker processes the chunks are shared files: the main process takes
        a job's dropped chunks out of the set and every process forgets them
        (`SharedMemory.forget`)."""
        with self._lock:
            return [c for c, used in self._chunks if used or not self.created]

    def dropped(self) -> list:
        """The chunks `kept` leaves out."""
        with self._lock:
            return [c for c, used in self._chunks if not used and self.created]


def cuda_register(base: torch.Tensor) -> None:
    """Page-lock a mapped file for asynchronous copies (cudaHostRegister), mapped into the
    device's address space too (hand-over counters are waited on there: runtime/handover.py)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(base.data_ptr(), base.numel(), 3)   # Portable | Mapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {base.numel()} bytes of shared host memory failed: {err}")


def cuda_unregister(base: torch.Tensor) -> None:
    """Undo `cuda_register` before the mapping goes."""
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
