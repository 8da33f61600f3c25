"""Device memory in expandable segments.

Note [expandable segments]: long sequences make stage jobs that allocate and free GiB-sized
values (an MLP intermediate of Llama-3.1-8B at 65,536 tokens is 1.75 GiB), one job after another
with different shapes, and torch's caching allocator keeps the freed blocks in segments of the
sizes first asked for. Llama-3.1-8B at 65,536 tokens under a 24 GiB cap (H200, this runtime's
plan: every job's measured peak within its planned memory) ran out of memory in its fifth job
asking for 1.75 GiB with 11.8 GiB allocated and 11.7 GiB reserved but free; with
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` the same run trained (steps of 17.8 s, the
largest job peak 19.1 GiB, reserved at most 23.3). So the runtime turns expandable segments on
for the devices it runs on, unless the process's allocator configuration names the setting
(then that choice stands). It applies to the segments allocated from then on.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

_lock = threading.Lock()
_done = False


def use_expandable_segments() -> bool:
    """Turn on expandable segments for CUDA memory once per process; False where the process's
    PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF already names the setting (left as it is)."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments" in conf:
            return False
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:   # torch releases before the accelerator-wide setting
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                setter = torch.cuda.memory._set_allocator_settings
        setter("expandable_segments:True")
        return True
