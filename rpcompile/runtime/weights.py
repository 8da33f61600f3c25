"""Host working copies of the parameters in the devices' compute dtype (pinned, for uploads)."""
from __future__ import annotations

import contextlib
import threading

import torch


class HostWeights:
    """Pinned low-precision copies of host parameters, refreshed only when a parameter changed.

    A parameter's `_version` counts its in-place updates (an optimizer step is one), so a copy
    is rewritten only after the parameter moved. A copy is never rewritten while an upload
    from it is in flight: the event of its last upload is waited on first.
    """

    def __init__(self):
        self._copies: dict = {}      # (id(param), rows) -> [version, pinned tensor, last upload event, lock]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def refreshed(self, param: torch.Tensor, dtype: torch.dtype, rows=None):
        """[version, pinned copy, last upload event, lock] of param (or of its rows [start, stop)),
        up to date and held against other refreshes of it while the caller issues its upload."""
        with self._lock:
            key = (id(param), rows)
            entry = self._copies.get(key)
            if entry is None:
                entry = self._copies[key] = [None, None, None, threading.Lock()]
        # One lock per copy: the devices' uploaders and the optimizer refresh different
        # parameters at the same time.
        with entry[3]:
            if entry[0] != param._version or entry[1] is None or entry[1].dtype != dtype:
                src = param.detach() if rows is None else param.detach()[rows[0]:rows[1]]
                if entry[1] is None or entry[1].dtype != dtype:
                    entry[1] = torch.empty(src.shape, dtype=dtype, pin_memory=True)
                    entry[2] = None
                if entry[2] is not None:
                    entry[2].synchronize()
                with torch.no_grad():
                    entry[1].copy_(src)
                entry[0] = param._version
            yield entry

    @staticmethod
    def mark_upload(entry, event) -> None:
        """An upload from entry's copy was issued; `event` marks its end."""
        entry[2] = event

    def get(self, param: torch.Tensor, dtype: torch.dtype, rows=None) -> list:
        """Refresh the copy of param now (the overlapped optimizer calls this after a step)."""
        with self.refreshed(param, dtype, rows) as entry:
            return entry


class DelayedWeights:
    """Two host copies of every parameter for Config(optimizer_mode="delayed").

    Note [delayed optimizer]: step t computes its gradients at the parameters after the
    optimizer steps 0 .. t-2, while the optimizer applies step t-1's gradients beside it (one
    step of delay, as RoundPipe's asynchronous step). Step t reads copy t % 2; the optimizer,
    after stepping a parameter with step k's gradients, writes it into copy k % 2, which step
    k + 2 reads, never the copy step k + 1 is reading. So every step sees one consistent set of
    parameters whatever the timing, and results are deterministic. A copy is rewritten only
    after the uploads from it have completed (their events).
    """

    snapshot = True      # CPU devices read these copies too, never the live parameters

    def __init__(self, params, dtype, pin: bool):
        self._copies = {}            # id(param) -> [[tensor, [events], lock] for slot 0 and 1]
        for p in params:
            src = p.detach()
            want = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
            slots = []
            # A frozen parameter (a LoRA base) never changes: one copy serves both parities.
            for _ in range(2 if p.requires_grad else 1):
                t = torch.empty(src.shape, dtype=want, pin_memory=pin)
                with torch.no_grad():
                    t.copy_(src)
                slots.append([t, [], threading.Lock()])
            self._copies[id(p)] = slots * (1 if p.requires_grad else 2)

    def covers(self, params) -> bool:
        return all(id(p) in self._copies for p in params)

    def view(self, slot: int) -> "_SlotView":
        """What the jobs of a step with parity `slot` read."""
        return _SlotView(self, slot)

    def write(self, param, slot: int) -> None:
        """Copy param (just stepped) into copy `slot`, once its uploads have completed."""
        tensor, events, lock = self._copies[id(param)][slot]
        with lock:
            for ev in events:
                ev.synchronize()
            events.clear()
            with torch.no_grad():
                tensor.copy_(param.detach())

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
        tensor, events, lock = self.store._copies[id(param)][self.slot]
        with lock:
            yield [None, tensor if rows is None else tensor[rows[0]:rows[1]], events, lock]

    @staticmethod
    def mark_upload(entry, event) -> None:
        if event is not None:
            entry[2].append(event)
