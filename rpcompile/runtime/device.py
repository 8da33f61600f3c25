"""One device as the runtime sees it: uploads, downloads and its random generator."""
from __future__ import annotations

import contextlib
import hashlib
import threading

import torch
from torch.utils import _pytree as pytree

from . import ops

# One lock per generator: CPU "devices" are threads sharing torch's one CPU generator.
_generator_locks: dict = {}
_locks_guard = threading.Lock()


def _lock_for(key) -> threading.Lock:
    with _locks_guard:
        return _generator_locks.setdefault(key, threading.Lock())


def stream_seed(key: int, position: int) -> int:
    digest = hashlib.blake2b(f"{key}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DeviceRuntime:
    """Transfers between the host and one device, in the device's working dtypes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cpu = device.type == "cpu"

    def __repr__(self):
        return f"DeviceRuntime({self.device})"

    def upload(self, value, dtype=None):
        """Host value (tensors inside tuples too) to this device; floating tensors cast to dtype."""
        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            want = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            if self.is_cpu and t.dtype == want:
                return t
            return t.to(self.device, dtype=want, non_blocking=not self.is_cpu)
        return pytree.tree_map(move, value)

    def download(self, value):
        """Device value to host memory (detached)."""
        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            return t if self.is_cpu else t.to("cpu")
        return pytree.tree_map(move, value)

    def generator(self):
        return torch.default_generator if self.is_cpu else torch.cuda.default_generators[self.device.index]

    @contextlib.contextmanager
    def rng_scope(self):
        """Let stage graphs reseed this device's generator; the caller's RNG state is restored after."""
        gen = self.generator()
        with _lock_for(("cpu",) if self.is_cpu else ("cuda", self.device.index)):
            state = gen.get_state()
            ops._local.reseed = lambda key, position: gen.manual_seed(stream_seed(key, position))
            try:
                yield
            finally:
                ops._local.reseed = None
                gen.set_state(state)
