"""Host gradient buffers: each backward job's parameter gradients in one flat fp32 piece.

Note [host gradient buffers]: a job accumulates its parameter gradients over the
microbatches in one flat fp32 tensor on its device (views of it per parameter, laid out by
the plan's GradLayout, passes/host_memory.py) and brings it down with one copy into its piece
of a flat host buffer, allocated once and reused every step; the host gradients are views of
it. Which set a step writes:

- exact mode: set 0; the step's gradients are added into `param.grad` (copies) before
  train_step returns, so the next step may rewrite the set.
- overlapped mode: set 0 as well. The optimizer thread reads step t's gradients while step
  t + 1 runs, but a job writes its piece only after it gated (waited for the optimizer step
  of) every parameter of that piece, and the optimizer is done with a parameter's gradient
  when it sets its ready event (Note [overlapped optimizer]).
- delayed mode: set t % 2. Step t + 1 does not wait for the optimizer (Note [delayed
  optimizer]), so it writes the other set; step t + 2 starts only after optimizer step t
  completed, so set t % 2 is free again by then.
- a differentiable call (`cm(...)` then `.backward()`): a set of its own, since autograd may
  keep the gradients it is handed.

The plans of one compiled model (one per length its calls needed a new cut for) lay their
gradients out differently, but they share the memory: set 0 of every layout is a view of one
flat buffer, set 1 of another, each as large as the largest layout, and the row-sum buffers
are one per parameter. A train step switches layout only once the optimizer is done with the
buffer (runner.new_step), so a new plan costs no gradient memory.
"""
from __future__ import annotations

import math
import threading

import torch

from .host_buffers import host_empty


def param_index(key) -> int:
    """The parameter a gradient key names: an index, or (index, start, stop) for rows of it."""
    return key[0] if isinstance(key, tuple) else key


class GradSet:
    """One flat host buffer of a GradLayout: its own, or a view of `storage(numel)` (a buffer
    shared by the layouts of a compiled model), taken at its first use."""

    def __init__(self, layout, pin: bool, row_sums: dict, kind: str, storage=None):
        self.layout, self.pin, self.kind = layout, pin, kind
        self._row_sums = row_sums       # param index -> host buffer its row pieces are summed into
        self._storage = storage
        self._flat = None
        self._host_views: dict = {}     # stage -> {key: view of the host piece}, made once
        self._lock = threading.Lock()

    def flat(self) -> torch.Tensor:
        with self._lock:
            if self._flat is None:
                n = self.layout.numel
                self._flat = (host_empty((n,), torch.float32, self.pin, self.kind) if self._storage is None
                              else self._storage(n)[:n])
            return self._flat

    @property
    def row_sums(self) -> dict:
        """param index -> the whole gradient of a parameter with row gradients only: a buffer of
        its own the rows are summed into, or the place in this set where its rows lie in order
        (GradLayout.whole_rows)."""
        whole_rows = getattr(self.layout, "whole_rows", None)
        if not whole_rows:
            return self._row_sums
        flat = self.flat()
        return {**self._row_sums, **{i: flat[off:off + math.prod(shape)].view(shape)
                                     for i, (off, shape) in whole_rows.items()}}

    def piece(self, stage: int) -> torch.Tensor:
        """The host piece a stage's job downloads its gradients into."""
        start, stop = self.layout.stages[stage]
        return self.flat()[start:stop]

    def host_views(self, stage: int) -> dict:
        """{key: view} of a stage's gradients in its host piece."""
        views = self._host_views.get(stage)
        if views is None:
            views = self._host_views[stage] = self.views(stage, self.piece(stage))
        return views

    def views(self, stage: int, piece: torch.Tensor) -> dict:
        """{key: view} of a stage's gradients in `piece` (its host piece or a device twin)."""
        start = self.layout.stages[stage][0]
        return {key: piece[off - start:off - start + math.prod(shape)].view(shape)
                for key, off, shape in self.layout.keys[stage]}


class HostGrads:
    """The gradient sets of the runner's plans, kept across steps: per layout two GradSets,
    views of two flat buffers that every layout shares (as large as the largest), and one
    row-sum buffer per parameter. They are allocated once, so pinned ones are exact (Note
    [exact pinned buffers] in runtime/host_buffers.py)."""

    KINDS = ("gradients", "gradients in flight")

    def __init__(self, pin: bool):
        self.pin = pin
        self._sets: dict = {}       # layout signature -> [set 0, set 1]
        self._flats = [None, None]  # per parity: the buffer the sets of that parity view
        self._sums: dict = {}       # param index -> row-sum buffer
        self._last = [None, None]   # per parity: the layout signature that used it last
        self._lock = threading.Lock()

    def _storage(self, parity):
        def storage(numel):
            with self._lock:
                flat = self._flats[parity]
                if flat is None or flat.numel() < numel:
                    # a larger layout: a larger buffer; the sets that view the old one are made
                    # anew at their next use (a step that holds one keeps it alive)
                    flat = self._flats[parity] = host_empty((numel,), torch.float32, self.pin, self.KINDS[parity],
                                                            exact=True)
                    for sets in self._sets.values():
                        if sets[parity] is not None and sets[parity]._flat is not None:
                            sets[parity] = None
                return flat
        return storage

    def switches(self, layout, parity: int) -> bool:
        """Whether set `parity` was last used by another layout (whose gradients the optimizer
        may still read: the caller waits for it first)."""
        last = self._last[parity]
        return last is not None and last != layout.signature

    def set_for(self, layout, parity: int) -> GradSet:
        """Set `parity` (0 or 1) of `layout`."""
        with self._lock:
            sets = self._sets.setdefault(layout.signature, [None, None])
            if sets[parity] is None:
                sums = {}
                for i, shape in layout.row_sums.items():
                    if i not in self._sums:
                        self._sums[i] = host_empty(shape, torch.float32, self.pin, "gradients", exact=True)
                    sums[i] = self._sums[i]
                sets[parity] = GradSet(layout, self.pin, sums, self.KINDS[parity], storage=self._storage(parity))
            self._last[parity] = layout.signature
            return sets[parity]

    def fresh(self, layout) -> GradSet:
        """A set nobody else uses (a differentiable call's): made per call, so pinned ones come from
        the caching host allocator, which serves the next call's from the blocks this one freed."""
        sums = {i: host_empty(shape, torch.float32, self.pin, "call gradients") for i, shape in layout.row_sums.items()}
        return GradSet(layout, self.pin, sums, "call gradients")
