"""Host working copies of the parameters in the devices' compute dtype (pinned, for uploads)."""
from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from .host_buffers import host_empty

_marks = itertools.count()


def working_dtype(t: torch.Tensor, dtype):
    """The dtype t's working copy has: `dtype` for floating tensors (None: t's own)."""
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def upload_mark(event, stream) -> tuple:
    """What a copy from a host working copy leaves behind: (issue order, stream, end event)."""
    return (next(_marks), stream, event)


def wait_for_uploads(marks) -> None:
    """Block until the uploads `marks` name have read their host copies. A stream runs its
    copies in issue order, so only the newest mark of each stream is waited on: a handful of
    calls for any number of parameters (Note [few calls per step] in runtime/optimizer.py)."""
    newest: dict = {}
    for order, stream, event in marks:
        if event is not None and (stream not in newest or order > newest[stream][0]):
            newest[stream] = (order, event)
    for _, event in newest.values():
        event.synchronize()


class HostWeights:
    """Pinned low-precision copies of host parameters, refreshed only when a parameter changed.

    A parameter's `_version` counts its in-place updates (an optimizer step is one), so a copy
    is rewritten only after the parameter moved. A copy is never rewritten while an upload
    from it is in flight: the mark of its last upload is waited on first.
    """

    def __init__(self, pin: bool = True):
        self._copies: dict = {}      # (id(param), rows) -> [version, pinned tensor, last upload mark, lock]
        self._lock = threading.Lock()
        self._pin = pin

    def _entry(self, param, rows):
        with self._lock:
            key = (id(param), rows)
            entry = self._copies.get(key)
            if entry is None:
                entry = self._copies[key] = [None, None, None, threading.Lock()]
            return entry

    @staticmethod
    def _stale(entry, param, dtype) -> bool:
        return entry[0] != param._version or entry[1] is None or entry[1].dtype != dtype

    @staticmethod
    def _source(param, rows):
        return param.detach() if rows is None else param.detach()[rows[0]:rows[1]]

    @contextlib.contextmanager
    def refreshed(self, param: torch.Tensor, dtype: torch.dtype, rows=None):
        """[version, pinned copy, last upload mark, lock] of param (or of its rows [start, stop)),
        up to date and held against other refreshes of it while the caller issues its upload."""
        entry = self._entry(param, rows)
        # One lock per copy: the devices' uploaders and the optimizer refresh different
        # parameters at the same time.
        with entry[3]:
            if self._stale(entry, param, dtype):
                src = self._source(param, rows)
                if entry[1] is None or entry[1].dtype != dtype:
                    entry[1] = host_empty(src.shape, dtype, self._pin, "working copies")
                    entry[2] = None
                if entry[2] is not None:
                    wait_for_uploads([entry[2]])
                with torch.no_grad():
                    entry[1].copy_(src)
                entry[0] = param._version
            yield entry

    @staticmethod
    def mark_upload(entry, event, stream=None) -> None:
        """An upload from entry's copy was issued on `stream`; `event` marks its end."""
        entry[2] = upload_mark(event, stream)

    def refresh_many(self, params, dtype) -> None:
        """Rewrite the copies of the given (whole) parameters that changed, with one wait and one
        copy call for all of them (the optimizer thread calls this after stepping a chunk)."""
        entries = [(p, self._entry(p, None)) for p in params]
        stale = [(p, e) for p, e in entries if e[1] is not None and self._stale(e, p, dtype)]
        if not stale:     # (a copy never made yet is made by its first upload)
            return
        locks = [e[3] for _, e in stale]
        for lock in locks:
            lock.acquire()
        try:
            wait_for_uploads([e[2] for _, e in stale if e[2] is not None])
            with torch.no_grad():
                torch._foreach_copy_([e[1] for _, e in stale], [p.detach() for p, _ in stale])
            for p, e in stale:
                e[0] = p._version
        finally:
            for lock in locks:
                lock.release()


class DelayedWeights:
    """Two host copies of every parameter for Config(optimizer_mode="delayed").

    Note [delayed optimizer]: step t computes its gradients at the parameters after the
    optimizer steps 0 .. t-2, while the optimizer applies step t-1's gradients beside it (one
    step of delay, as RoundPipe's asynchronous step). Step t reads copy t % 2; the optimizer,
    after stepping a parameter with step k's gradients, writes it into copy k % 2, which step
    k + 2 reads, never the copy step k + 1 is reading. So every step sees one consistent set of
    parameters whatever the timing, and results are deterministic. A copy is rewritten only
    after the uploads from it have completed (their marks).
    """

    snapshot = True      # CPU devices read these copies too, never the live parameters

    def __init__(self, params, dtype, pin: bool):
        self._copies = {}            # id(param) -> [[tensor, [upload marks], lock] for slot 0 and 1]
        for p in params:
            src = p.detach()
            want = working_dtype(p, dtype)
            slots = []
            # A frozen parameter (a LoRA base) never changes: one copy serves both parities.
            for _ in range(2 if p.requires_grad else 1):
                t = host_empty(src.shape, want, pin, "working copies")
                with torch.no_grad():
                    t.copy_(src)
                slots.append([t, [], threading.Lock()])
            self._copies[id(p)] = slots * (1 if p.requires_grad else 2)

    def covers(self, params) -> bool:
        return all(id(p) in self._copies for p in params)

    def view(self, slot: int) -> "_SlotView":
        """What the jobs of a step with parity `slot` read."""
        return _SlotView(self, slot)

    def write_many(self, params, slot: int) -> None:
        """Copy the given parameters (just stepped) into copy `slot`, once the uploads from
        those copies have completed: one wait per stream and one copy call for all."""
        slots = [self._copies[id(p)][slot] for p in params]
        for s in slots:
            s[2].acquire()
        try:
            wait_for_uploads([m for s in slots for m in s[1]])
            with torch.no_grad():
                torch._foreach_copy_([s[0] for s in slots], [p.detach() for p in params])
            for s in slots:
                s[1].clear()
        finally:
            for s in slots:
                s[2].release()

    def nbytes(self) -> int:
        tensors = {id(s[0]): s[0] for slots in self._copies.values() for s in slots}
        return sum(t.numel() * t.element_size() for t in tensors.values())


class _SlotView:
    """One parity's copies, with HostWeights' upload interface."""

    snapshot = True

    def __init__(self, store: DelayedWeights, slot: int):
        self.store, self.slot = store, slot

    @contextlib.contextmanager
    def refreshed(self, param, dtype, rows=None):
        tensor, marks, lock = self.store._copies[id(param)][self.slot]
        with lock:
            yield [None, tensor if rows is None else tensor[rows[0]:rows[1]], marks, lock]

    @staticmethod
    def mark_upload(entry, event, stream=None) -> None:
        if event is not None:
            entry[2].append(upload_mark(event, stream))
