"""Where a call's outputs land on the host.

Note [a call's outputs]: a batched output of a call (the logits) comes down microbatch by
microbatch straight into its rows of the one host tensor the caller gets, allocated when its
first microbatch comes down, of exactly its size. Before, each microbatch's output came into a
pinned block of torch's caching host allocator, rounded up to a power of two and kept by that
allocator after the call, and the caller got their concatenation: Qwen3-1.7B's call on 8 x 2048
tokens (4.6 GiB of bf16 logits) left 8.0 GiB of pinned blocks beside the caller's 4.6 GiB, memory
no plan counts, held into the training after it (benchmarks/runs/host_gap). Measured on one
H200 (benchmarks/runs/call_outputs: 8 calls after 2 delayed train steps, one run each): resident
memory after the calls 18.5 GiB against 26.7 (no pinned blocks left), a call 1.13 s against 0.78
(the median): pinning 4.6 GiB of exactly sized memory each call costs more than the
concatenation it saves, but the memory goes with the caller's tensor. Pageable rows (no pinning)
took 4.2 s a call: a download into pageable memory blocks the worker thread until it is done.
An output that is not batched, or whose microbatch does not fit its rows (another shape or
dtype), still comes into a buffer of its own. With worker processes a call's outputs come down
into the step's slots, each copied once into the caller's tensor (GraphRunner._gather_output).
"""
from __future__ import annotations

import threading

from .host_buffers import host_empty


class CallOutputs:
    """The host tensors of one call's batched outputs, filled in by the microbatches' downloads."""

    def __init__(self, rows: list, batched, pin: bool):
        self.rows = list(rows)
        self.starts = [sum(self.rows[:k]) for k in range(len(self.rows))]
        self.batched = set(batched)
        self.pin = pin
        self.whole: dict = {}           # output name -> the host tensor of every microbatch's rows
        self.served: dict = {}          # output name -> the microbatches downloaded into it
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
            whole = self.whole[name] = host_empty((sum(self.rows),) + shape[1:], dtype, self.pin, "outputs",
                                                  exact=True)
        elif whole.shape[1:] != shape[1:] or whole.dtype != dtype:
            return None
        self.served.setdefault(name, set()).add(mb)
        return whole[self.starts[mb]:self.starts[mb] + self.rows[mb]]

    def gather(self, name):
        """Output `name` whole, where every microbatch came down into its rows (call it once their
        downloads completed); else None."""
        if len(self.served.get(name, ())) != len(self.rows):
            return None
        return self.whole[name]

