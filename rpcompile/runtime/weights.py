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

    def get(self, param: torch.Tensor, dtype: torch.dtype, rows=None) -> list:
        """Refresh the copy of param now (the overlapped optimizer calls this after a step)."""
        with self.refreshed(param, dtype, rows) as entry:
            return entry

    def nbytes(self) -> int:
        return sum(e[1].numel() * e[1].element_size() for e in self._copies.values() if e[1] is not None)
