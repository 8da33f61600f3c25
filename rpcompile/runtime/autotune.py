"""Where Inductor's autotuning keeps the arguments a kernel writes while it times configs.

Note [autotune's clones on the device]: Inductor autotunes a Triton kernel at its first launch,
timing each candidate config. A kernel that writes an argument (a gradient accumulated in place)
must not see the argument changed by the trial launches, so each trial runs on a clone of it.
For backward and inference kernels Inductor first asks whether the clones fit under the memory
the process has used so far (its peak allocated less what is allocated now); those that do not
are copied to pinned host memory instead and copied back after every trial launch
(CachingAutotuner.copy_args_to_cpu_if_needed, restore_args_from_cpu). A stage job's first call
has used little of a large device by then, so its gradient buffers went the host way: on Qwen3-
1.7B's one-job plan 10 GiB of pinned blocks (Note [autotune's pinned copies], warmup.py); every
trial launch of such a kernel then timed a host-to-device copy of the buffer as well, and
turning pointwise autotuning off made the first step 10 s shorter and the host peak 4.4 GiB lower
(47th session, 2 H200s). So on a device with room for the clones, beside what its caching
allocator holds and under any memory fraction set for the process, with a margin for memory
outside the allocator (NCCL, CUDA's own), the clones are made on the device; elsewhere Inductor
does as it does. Measured (48th session, cold caches, each pair in one run): Qwen3-1.7B on 2
H200s, the autotuning 7.2 / 7.6 -> 2.2 / 2.2 s, setup 62.0 / 64.9 -> 60.4 / 56.0 s, host peak
27.2 / 27.4 -> 22.7 / 22.7 GiB, medians 0.732 s both; on 1 H200 setup 71.0 -> 60.6 s, host peak
26.5 -> 20.6 GiB, the device peak unchanged (78.7 GiB: the clones fit under the step's own).
Llama-3.1-8B on 2 H200s, whose jobs fill the devices, trained as before (21,561 tokens/s).
The wrap is process-wide (Inductor offers no option for it): code the user compiles in the same
process autotunes so too, with the same results; only where the trial copies live changes.
"""
from __future__ import annotations

import threading

import torch

MARGIN = 1 / 16        # of the device's memory, kept for what is allocated outside torch's allocator

_lock = threading.Lock()
_installed = [False]


def device_room(device) -> int:
    """Bytes the caching allocator of `device` can still hand out: the driver's free memory and
    the allocator's cached blocks, under a per-process memory fraction, less MARGIN."""
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    room = free + (reserved - allocated)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    if fraction < 1.0:
        room = min(room, int(fraction * total) - allocated)
    return room - int(MARGIN * total)


def written_bytes(names, written, args, kwargs) -> tuple:
    """(device, bytes) of the arguments a kernel writes (the storage each one spans)."""
    from torch._inductor.runtime.triton_heuristics import compute_required_storage_length
    device, size = None, 0
    for name, arg in list(zip(names, args)) + list(kwargs.items()):
        if name in written and isinstance(arg, torch.Tensor) and arg.device.type != "cpu":
            device = device or arg.device
            size += compute_required_storage_length(arg.size(), arg.stride(), 0) * arg.element_size()
    return device, size


def device_clones(autotuner, args, kwargs) -> bool:
    """Whether the arguments `autotuner`'s kernel writes are to be cloned on their device: Inductor
    would weigh host copies (optimize_mem) and the device has room for the clones."""
    if not getattr(autotuner, "optimize_mem", False):
        return False
    device, size = written_bytes(autotuner.fn.arg_names, autotuner.mutated_arg_names, args, kwargs)
    return device is not None and size <= device_room(device)


def clones_on_device() -> bool:
    """Install Note [autotune's clones on the device] once per process; False where this torch's
    autotuner lacks the method it wraps (then Inductor's own choice stands)."""
    with _lock:
        if _installed[0]:
            return True
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:
            return False
        host_copies = getattr(CachingAutotuner, "copy_args_to_cpu_if_needed", None)
        if host_copies is None:
            return False

        def copy_args_to_cpu_if_needed(self, *args, **kwargs):
            # no host copies: maybe_clone_args then clones every written argument on the device
            return {} if device_clones(self, args, kwargs) else host_copies(self, *args, **kwargs)

        CachingAutotuner.copy_args_to_cpu_if_needed = copy_args_to_cpu_if_needed
        _installed[0] = True
        return True
