"""A stage job traced with fake tensors: the whole job as one aten graph, ops in program order.

`trace_job(cm, stage_index)` runs a stage's program under `make_fx` with a FakeJob behind
the job handle: the program ops' fake implementations (Note [program ops]) hand out fake
tensors shaped like the values the real job would see (sizes at the capture's example
shapes), and the compute graph traces into aten ops. Nothing is uploaded or run.
`live_peak(gm)` reads such a graph's peak memory off it: the most bytes live at once.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from . import ops


def _concrete(size):
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _fake_like(ev, device):
    return torch.empty([_concrete(s) for s in ev.shape], dtype=ev.dtype, device=device)


class FakeJob:
    """Stands behind a job handle while a program is traced with fake tensors."""

    def __init__(self, stage, role, device):
        self.stage, self.role, self.device = stage, role, device
        graph = stage.forward.graph
        self.values = {n.name: n.meta.get("example_value") for n in graph.nodes if n.op == "placeholder"}
        out = next(n for n in graph.nodes if n.op == "output")
        self.values.update({name: v.meta.get("example_value") for name, v in zip(stage.outputs, out.args[0])})
        self.by_fqn = {fqn: name for name, fqn in stage.fqn.items()}
        self.by_leaf = {index: name for name, index in stage.input_leaf.items() if stage.kinds[name] == "input"}

    def fake(self, kind, *args):
        if kind in ("weight", "buffer"):
            name = self.by_fqn[args[0]]
        elif kind == "weight_rows":
            name = next(n for n, (_, a, b) in self.stage.param_slices.items()
                        if self.stage.fqn[n] == args[0] and (a, b) == (args[1], args[2]))
        elif kind == "input":
            name = self.by_leaf[args[1]]
        elif kind == "seed":
            return torch.empty((), dtype=torch.float32, device=self.device)
        else:                       # act, grad: (mb, name)
            name = args[1]
        return _fake_like(self.values[name], self.device)

    def span(self, stream, name, fn, mb=None, **attrs):
        return fn()

    def sym(self, mb, name):
        return _concrete(self.values[name])

    def rng_key(self, mb):
        return 0


def trace_job(cm, stage_index: int, role=None, device=None) -> torch.fx.GraphModule:
    """The aten graph of one microbatch of a stage job (program ops kept, in program order)."""
    plan = cm.plan
    if plan is None:
        raise RuntimeError("trace_job needs a plan: run cm.train_step(...) or cm(...) once first")
    stage = plan.stages[stage_index]
    role = role or stage.kind
    device = torch.device(device) if device is not None else cm.config.devices[0]
    from ..passes.graph_utils import retarget   # the uncompiled program, on `device`
    program = retarget(stage.programs[role], {plan.captured.capture_device.type: device})
    handle = ops.register(FakeJob(stage, role, device))
    previous = getattr(ops._local, "reseed", None)
    ops._local.reseed = lambda key, position: None
    try:
        grad = torch.enable_grad() if role != "fwd" else torch.no_grad()
        with grad:
            return make_fx(lambda: program(handle, 0), tracing_mode="fake")()
    finally:
        ops._local.reseed = previous
        ops.unregister(handle)


def live_peak(gm: torch.fx.GraphModule) -> tuple:
    """(bytes, node name): the most bytes of tensors live at once in a traced job graph
    (trace_job), its ops run in program order, a value freed after its last use, views counted
    with the storage they share. A lower bound of the device memory the job takes run eagerly
    (no allocator rounding or fragmentation, no kernel workspaces); fused (Inductor) code keeps
    fewer intermediates. Beside the plan's job memory it shows where the memory model is off:
    Qwen3-1.7B at 65,536 tokens, the forward job with 14 LM-head shards was planned at 3.57 GiB
    and traces at 5.75 GiB (hence Note [working bytes] in passes/partition.py); a one-layer
    backward job is planned at 12.95 GiB and traces at 8.26 GiB."""
    from torch.multiprocessing.reductions import StorageWeakRef

    nodes = list(gm.graph.nodes)
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    refs: dict = {}        # storage -> [bytes, live nodes holding it]
    held: dict = {}        # node -> its storages
    live = best = 0
    where = None

    def drop(node):
        nonlocal live
        for key in held.pop(node, ()):
            refs[key][1] -= 1
            if refs[key][1] == 0:
                live -= refs.pop(key)[0]
    for i, n in enumerate(nodes):
        value = n.meta.get("val")
        keys = []
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, torch.Tensor):
                key = StorageWeakRef(t.untyped_storage()).cdata
                if key not in refs:
                    refs[key] = [t.untyped_storage().nbytes(), 0]
                    live += refs[key][0]
                refs[key][1] += 1
                keys.append(key)
        held[n] = keys
        if live > best:
            best, where = live, n.name
        for a in n.all_input_nodes:
            if last[a] == i:
                drop(a)
        if n not in last:
            drop(n)
    return best, where
