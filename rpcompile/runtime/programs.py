"""Stage programs ready to run on a device: retargeted to it and, on GPUs, compiled by Inductor.

One cache per process: the runner's (worker threads) or a worker process's own
(Config(workers="processes")), so a worker process compiles the programs it runs.
"""
from __future__ import annotations

import time

import torch
from torch.fx.experimental.sym_node import DynamicInt as _DynamicInt   # (an int dynamo treats as symbolic)

from . import autotune, timeline
from .compile_once import in_sharing_pass
from .ops import arrive
from ..passes.graph_utils import generate_code, retarget
from ..passes.regions import compile_regions
from .warmup import WarmupGuard, _signature, calling_alone


def compiled(prog, options=None, shared=None, locks=None, inductor=True):
    """The program with its compute graphs cut at repeated blocks such as decoder layers
    (passes/regions.py) and, with `inductor`, each piece compiled by Inductor (AOTAutograd for
    backward): identical pieces share one compiled function, memoised in `shared`. The cache
    passes one dict per device and capture, so a decoder layer is one compiled object per
    device, whatever stage program or re-planned length uses it (first steps at 4 GPUs measured
    the same, 215-231 s against 226 s: Inductor's caches had already served the repeats).
    Uncompiled programs are cut too: their weights arrive piece by piece as well (Note [weights
    as they arrive], runtime/job.py). `locks`: worker processes' CompileLocks (Note [compile
    each piece once], compile_once.py)."""
    prog = retarget(prog, {})   # a private copy whose children we may replace
    shared = {} if shared is None else shared

    def piece(gm):
        if not inductor:
            return Arriving(gm)
        generate_code(gm)   # before Dynamo traces it (Note [lazy graph modules])
        return Arriving(LengthDynamic(gm, torch.compile(gm, dynamic=None, options=options), locks))

    def guard(gm):
        return WarmupGuard(gm, locks) if inductor else gm

    for name, child in list(prog.named_children()):
        if name == "forward_graph" or name.startswith("forward_part"):   # Note [forward parts] (codegen)
            setattr(prog, name, guard(compile_regions(child, piece, shared)))
    if hasattr(prog, "backward_graph"):
        prog.backward_graph.compute = compile_regions(prog.backward_graph.compute, piece, shared)
        prog.backward_graph = guard(prog.backward_graph)
    prog.weights_arrive = True
    return prog


class Arriving(torch.nn.Module):
    """A piece of a compute graph whose weights, where its job left them to go up as they are
    read, arrive before it runs (Note [weights as they arrive], runtime/job.py)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        arrive(args)
        # .forward: a GraphModule's __call__ prints its code around a failing line (ops.compute)
        return self.inner.forward(*args)

    @property
    def code(self) -> str:
        """The piece's code: a program of one piece is keyed by it (warmup.program_key)."""
        return self.inner.code


class LengthDynamic(torch.nn.Module):
    """A compiled graph whose sequence-length dims are dynamic from its first call.

    Note [length-dynamic pieces]: one plan serves every sequence length (Note [dynamic lengths]
    in lengths.py), and torch.compile's automatic dynamic shapes would compile each piece static
    at the first length and again, dynamic, at the second: 59 s on an H100 for Qwen3-1.7B's
    second length (16,384 then 32,768 tokens), where the issue allows 10. The capture knows
    which sizes are lengths: its symbolic sizes (`example_value` of the graph's inputs). So
    each call marks those dims `maybe_mark_dynamic` and passes those int arguments as
    `DynamicInt`: the first compile is already symbolic in the length and static in everything
    else (weights, hidden sizes, the batch), and later lengths reuse it. The marks are set on
    every call because dynamo may compile again for other reasons (grad mode: the forward and
    the recompute), and each compile must see them; a call costs 6-8 us more than the
    compiled function alone (CPU, 5 marked inputs and one int)."""

    def __init__(self, gm, compiled, locks=None):
        super().__init__()
        self.compiled = compiled
        self.dims, self.ints = length_inputs(gm)
        self.locks, self.code, self._seen = locks, gm.code, set()
        self.__dict__["eager"] = gm     # the uncompiled graph (not a second submodule)

    def forward(self, *args):
        # Note [compile each piece once] (compile_once.py). A piece's inputs follow from its
        # program's, so a new signature here comes only inside the program's first call: the
        # steady state computes none.
        if self.locks is not None and calling_alone():
            sig = _signature(args)
            if sig not in self._seen:
                if in_sharing_pass():    # Note [pieces compiled side by side] (compile_once.py)
                    out, called = self.locks.share("piece", self.code, sig, lambda: self._call(args),
                                                   lambda: self.eager(*args))
                else:
                    out, called = self.locks.first_call("piece", self.code, sig, lambda: self._call(args)), True
                if called:
                    self._seen.add(sig)
                return out
        return self._call(args)

    def _call(self, args):
        if self.dims or self.ints:
            args = list(args)
            for i, dims in self.dims:
                torch._dynamo.maybe_mark_dynamic(args[i], dims)
            for i in self.ints:
                args[i] = _DynamicInt(args[i])
        return self.compiled(*args)


def length_inputs(gm) -> tuple:
    """([(input index, [symbolic dims])], [indices of symbolic int inputs]) of gm, from its
    placeholders' `example_value` (the capture's symbolic sizes)."""
    dims, ints = [], []
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor):     # symbolic dims, and a shard's rows (passes/regions.py)
            sym = sorted({d for d, size in enumerate(ev.shape) if isinstance(size, torch.SymInt)}
                         | set(n.meta.get("rp_dynamic_dims", ())))
            if sym:
                dims.append((i, sym))
        elif isinstance(ev, torch.SymInt) or n.meta.get("rp_dynamic_int"):  # a shard bound (passes/regions.py)
            ints.append(i)
    return dims, ints


def compiles_stages(compile_stages, on_gpu: bool) -> bool:
    """Whether stages are compiled by Inductor on a device (Config.compile_stages; None: on GPUs)."""
    return bool(on_gpu if compile_stages is None else compile_stages)


class ProgramCache:
    """Programs by (plan, stage, role, device), built on first use."""

    def __init__(self, compile_stages, on_gpu: bool, inductor_options=None):
        self.compile_stages, self.on_gpu, self.inductor_options = compile_stages, on_gpu, inductor_options
        if on_gpu and self.inductor:
            autotune.clones_on_device()     # Note [autotune's clones on the device] (autotune.py)
        self.locks = None               # a worker process's CompileLocks (compile_once.py)
        self._programs: dict = {}
        self._pieces: dict = {}         # (capture key, device, inductor) -> pieces by key (passes/regions.py)

    @property
    def inductor(self) -> bool:
        return compiles_stages(self.compile_stages, self.on_gpu)

    def use_inductor(self, stage) -> bool:
        # Random stages stay eager: Inductor's own RNG would not replay our reseeded streams.
        return self.inductor and not stage.random

    def get(self, plan_key, capture_key, capture_device, stage, role, device):
        key = (plan_key, stage.index, role, device)
        prog = self._programs.get(key)
        if prog is None:
            t0 = time.perf_counter()
            prog = stage.programs[role]
            if capture_device != device:
                prog = retarget(prog, {capture_device.type: device})
            inductor = self.use_inductor(stage)
            prog = compiled(prog, self.inductor_options, self._pieces.setdefault((capture_key, device, inductor), {}),
                            self.locks, inductor)
            self._programs[key] = generate_code(prog)
            timeline.mark(f"program {stage.index}{role} for {device} built", time.perf_counter() - t0)
        return prog

    def release(self, plan_key, capture_key=None) -> None:
        """Drop the programs of a plan let go (Note [captures kept] in plan_cache.py) and, with
        `capture_key`, the pieces of its capture: keyed by ids, none may outlive its plan, whose
        id a later one may get. (list(): a plan's finalizer may run this beside a lookup.)"""
        for cache, gone in ((self._programs, plan_key), (self._pieces, capture_key)):
            for key in [k for k in list(cache) if gone is not None and k[0] == gone]:
                cache.pop(key, None)

    def clear(self):
        self._programs.clear()
