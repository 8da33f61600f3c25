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
    """One flat host buffer of a GradLayout, allocated at its first use."""

    def __init__(self, layout, pin: bool, row_sums: dict, kind: str, exact: bool = False):
        self.layout, self.pin, self.kind, self.exact = layout, pin, kind, exact
        self.row_sums = row_sums        # param index -> host buffer its row pieces are summed into
        self._flat = None
        self._host_views: dict = {}     # stage -> {key: view of the host piece}, made once
        self._lock = threading.Lock()

    def flat(self) -> torch.Tensor:
        with self._lock:
            if self._flat is None:
                self._flat = host_empty((self.layout.numel,), torch.float32, self.pin, self.kind, exact=self.exact)
            return self._flat

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
    """The gradient sets of the runner's plans, kept across steps (one layout, one entry)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._sets: dict = {}       # layout signature -> [set 0, set 1]
        self._lock = threading.Lock()

    def set_for(self, layout, parity: int) -> GradSet:
        """Set `parity` (0 or 1) of `layout`; the row-sum buffers are shared by both sets. They
        are kept across steps, so pinned ones are exact (Note [exact pinned buffers])."""
        with self._lock:
            sets = self._sets.get(layout.signature)
            if sets is None:
                sums = {i: host_empty(shape, torch.float32, self.pin, "gradients", exact=True)
                        for i, shape in layout.row_sums.items()}
                sets = self._sets[layout.signature] = [
                    GradSet(layout, self.pin, sums, "gradients", exact=True),
                    GradSet(layout, self.pin, sums, "gradients in flight", exact=True)]
            return sets[parity]

    def fresh(self, layout) -> GradSet:
        """A set nobody else uses (a differentiable call's): made per call, so pinned ones come from
        the caching host allocator, which serves the next call's from the blocks this one freed."""
        sums = {i: host_empty(shape, torch.float32, self.pin, "call gradients") for i, shape in layout.row_sums.items()}
        return GradSet(layout, self.pin, sums, "call gradients")
