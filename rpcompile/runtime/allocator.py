"""Device memory in expandable segments, and compute streams kept for the next compiled model.

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

Note [compute streams outlive their model]: cuBLAS keeps a workspace in device memory for every
(handle, stream) that ran a matmul, for the life of the process (65 MiB per stream on an H100,
cuBLAS and cuBLASLt). Each compiled model made compute streams of its own, so a model dropped and
compiled again (a notebook's second run) left its workspaces behind: on ["cuda:0", "cuda:0"],
130 MiB more of allocated device memory for every model compiled and dropped (95th session,
H100; torch._C._cuda_clearCublasWorkspaces() gave all of it back). The compute streams come from
a free list per device instead: a model gives its streams back as it goes, the next model takes
them, and with the worker threads' handles (cuBLAS's pool hands a thread that ended's handle to
the next) the workspaces are found again. Models alive at once still get streams of their own.
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


_free_compute_streams: dict = {}   # device -> [torch.cuda.Stream] no live model uses


def take_compute_stream(device: torch.device):
    """A compute stream for `device`: one a dropped model gave back, else a new one (Note
    [compute streams outlive their model])."""
    free = _free_compute_streams.setdefault(device, [])
    try:
        return free.pop()    # (pop and append: atomic, and a finalizer may give one back at any time)
    except IndexError:
        return torch.cuda.Stream(device)


def give_back_compute_stream(device: torch.device, stream) -> None:
    _free_compute_streams.setdefault(device, []).append(stream)
