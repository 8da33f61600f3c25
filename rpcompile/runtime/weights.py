"""Host working copies of the parameters in the devices' compute dtype (pinned, for uploads)."""
from __future__ import annotations

import threading

import torch


class HostWeights:
    """Pinned low-precision copies of host parameters, refreshed only when a parameter changed.

    A parameter's `_version` counts its in-place updates (an optimizer step is one), so a copy
    is rewritten only after the parameter moved. A copy is never rewritten while an upload
    from it is in flight: the event of its last upload is waited on first.
    """

    def __init__(self):
        self._copies: dict = {}      # (id(param), rows) -> [version, pinned tensor, last upload event]
        self._lock = threading.Lock()

    def get(self, param: torch.Tensor, dtype: torch.dtype, rows=None) -> list:
        """[version, pinned copy, last upload event] of param (or of its rows [start, stop))."""
        with self._lock:
            key = (id(param), rows)
            entry = self._copies.get(key)
            if entry is not None and entry[0] == param._version and entry[1].dtype == dtype:
                return entry
            src = param.detach() if rows is None else param.detach()[rows[0]:rows[1]]
            if entry is None or entry[1].dtype != dtype:
                entry = [None, torch.empty(src.shape, dtype=dtype, pin_memory=True), None]
                self._copies[key] = entry
            if entry[2] is not None:
                entry[2].synchronize()
            with torch.no_grad():
                entry[1].copy_(src)
            entry[0] = param._version
            return entry

    def nbytes(self) -> int:
        return sum(e[1].numel() * e[1].element_size() for e in self._copies.values())
