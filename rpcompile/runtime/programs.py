"""Stage programs ready to run on a device: retargeted to it and, on GPUs, compiled by Inductor.

One cache per process: the runner's (worker threads) or a worker process's own
(Config(workers="processes")), so a worker process compiles the programs it runs.
"""
from __future__ import annotations

import torch

from ..passes.graph_utils import retarget
from ..passes.regions import compile_regions
from .warmup import WarmupGuard


def compiled(prog, options=None, shared=None):
    """The program with its compute graphs compiled by Inductor (AOTAutograd for backward),
    cut at repeated blocks such as decoder layers (passes/regions.py): identical pieces share
    one compiled function, memoised in `shared`. The cache passes one dict per device and
    capture, so a decoder layer is one compiled object per device, whatever stage program or
    re-planned length uses it (first steps at 4 GPUs measured the same, 215-231 s against
    226 s: Inductor's caches had already served the repeats)."""
    prog = retarget(prog, {})   # a private copy whose children we may replace
    shared = {} if shared is None else shared

    def inductor(gm):
        return torch.compile(gm, dynamic=None, options=options)

    if hasattr(prog, "forward_graph"):
        prog.forward_graph = WarmupGuard(compile_regions(prog.forward_graph, inductor, shared))
    if hasattr(prog, "backward_graph"):
        prog.backward_graph.compute = compile_regions(prog.backward_graph.compute, inductor, shared)
        prog.backward_graph = WarmupGuard(prog.backward_graph)
    return prog


class ProgramCache:
    """Programs by (plan, stage, role, device), built on first use."""

    def __init__(self, compile_stages, on_gpu: bool, inductor_options=None):
        self.compile_stages, self.on_gpu, self.inductor_options = compile_stages, on_gpu, inductor_options
        self._programs: dict = {}
        self._pieces: dict = {}         # (capture key, device) -> compiled pieces by key (passes/regions.py)

    def use_inductor(self, stage) -> bool:
        on = self.on_gpu if self.compile_stages is None else self.compile_stages
        # Random stages stay eager: Inductor's own RNG would not replay our reseeded streams.
        return bool(on) and not stage.random

    def get(self, plan_key, capture_key, capture_device, stage, role, device):
        key = (plan_key, stage.index, role, device)
        prog = self._programs.get(key)
        if prog is None:
            prog = stage.programs[role]
            if capture_device != device:
                prog = retarget(prog, {capture_device.type: device})
            if self.use_inductor(stage):
                prog = compiled(prog, self.inductor_options, self._pieces.setdefault((capture_key, device), {}))
            self._programs[key] = prog
        return prog

    def clear(self):
        self._programs.clear()
