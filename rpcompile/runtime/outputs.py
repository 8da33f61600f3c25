"""Where a call's outputs land on the host.

Note [a call's outputs]: a batched output of a call (the logits) comes down microbatch by
microbatch straight into its rows of the one host tensor the caller gets, of exactly its size,
lent by `buffers` (Note [reused host buffers], runtime/host_buffers.py): once the caller lets a
call's tensor go, the next call's outputs come down into the same page-locked memory; memory
still held by a caller is never lent. A train step gives the free memory back (`release`): it is
not counted by the plan, so it is not kept into the training after an evaluation. Measured on one
H200 (benchmarks/runs/call_outputs: Qwen3-1.7B, 8 calls of 8 x 2048 tokens, 4.6 GiB of bf16
logits, after 2 delayed train steps): 0.20 s a call, where pinning a new exact tensor each call
took 1.08 s, downloading into pinned blocks of torch's caching host allocator and concatenating
them 0.78 s (and the allocator kept 8.0 GiB of blocks rounded up to powers of two into the
training), and pageable rows 4.2 s (a download into pageable memory blocks the worker thread).
Training through `loss.backward()` on calls (benchmarks/runs/call_grads): 1.47 s a step against
2.7-2.8 s. An output that is not batched, or whose microbatch does not fit its rows (another shape
or dtype), still comes into a buffer of its own. With worker processes a call's outputs come down
into the step's slots, each copied once into the caller's tensor (`concatenated`), which is lent
too (pageable: nothing is downloaded into it), so that a call's copy lands in memory already
touched rather than faulting in fresh pages: 0.33-0.36 s a call against 0.69-0.79 s for the
logits above (benchmarks/runs/call_outputs/processes).
"""
from __future__ import annotations

import threading

import torch

from .host_buffers import Reused

buffers = Reused("outputs")


class CallOutputs:
    """The host tensors of one call's batched outputs, filled in by the microbatches' downloads."""

    def __init__(self, rows: list, batched, pin: bool):
        self.rows = list(rows)
        self.starts = [sum(self.rows[:k]) for k in range(len(self.rows))]
        self.batched = set(batched)
        self.pin = pin
        self.whole: dict = {}           # output name -> the host tensor of every microbatch's rows
        self.served: dict = {}          # output name -> the microbatches downloaded into it
        self.settled: list = []         # each tensor's flag: its downloads are done
        self._lock = threading.Lock()

    def into(self, mb: int, name: str):
        """`into(shape, dtype)` for DeviceRuntime.download: microbatch mb's rows of output `name`,
        or None where they do not take it."""
        def rows_of(shape, dtype):
            with self._lock:
                return self._rows_of(mb, name, tuple(shape), dtype)
        return rows_of

    def _rows_of(self, mb, name, shape, dtype):
        if name not in self.batched or not shape or shape[0] != self.rows[mb] or mb in self.served.get(name, ()):
            return None
        whole = self.whole.get(name)
        if whole is None:
            whole, settled = buffers.lend((sum(self.rows),) + shape[1:], dtype, self.pin)
            self.whole[name] = whole
            self.settled.append(settled)
        elif whole.shape[1:] != shape[1:] or whole.dtype != dtype:
            return None
        self.served.setdefault(name, set()).add(mb)
        return whole[self.starts[mb]:self.starts[mb] + self.rows[mb]]

    def gather(self, name):
        """Output `name` whole, where every microbatch came down into its rows (call it once their
        downloads completed); else None."""
        if len(self.served.get(name, ())) != len(self.rows):
            return None
        for settled in self.settled:
            settled[0] = True
        return self.whole[name]


def concatenated(parts: list):
    """The parts of a batched output (host tensors) one after another along dim 0, in memory lent
    by `buffers` where they line up (else torch.cat's own)."""
    first = parts[0]
    if first.dim() == 0 or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                               or p.device.type != "cpu" for p in parts):
        return torch.cat(parts, 0)
    whole, settled = buffers.lend((sum(p.shape[0] for p in parts),) + tuple(first.shape[1:]), first.dtype, False)
    torch.cat(parts, 0, out=whole)
    settled[0] = True
    return whole


def release() -> int:
    """At a train step: the memory the calls before it had for their outputs, and that no caller
    holds, goes back (unpinned). Returns its bytes."""
    return buffers.release()
