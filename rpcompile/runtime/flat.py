"""Flat host tensors for the optimizer: master weights, their optimizer state and their
gradients as views of a few large buffers, stepped a run of parameters at a time.

Note [flat host optimizer]: torch's CPU kernels (the fused AdamW, a copy) run one parallel
region per tensor, and a region ends when its slowest thread does. With every core busy (a
64-core host, four worker processes beside the optimizer thread) a thread that loses its core
for a scheduler slice holds up its region by milliseconds, once per tensor: stepping
Qwen3-1.7B's 197 tensors with the fused AdamW took 1.27 s on an idle 64-core host, one flat
tensor of the same 1.72B elements 0.25 s, and the bf16 refresh 1.24 s per tensor against
0.10 s flat (benchmarks/optim_probe.py, RESULTS.md). So:

- `flatten_masters` re-points the trainable parameters (`p.data`) into one buffer per dtype,
  laid out in the order their gradients lie in the host gradient buffer (GradLayout), so a
  run of parameters that is contiguous there is contiguous here too;
- `FlatStepper` steps such a run as one tensor with a twin of the user's optimizer (same class
  and hyperparameters), whose state is the run's slice of flat state buffers; the user's
  `optimizer.state[p]` entries are views of those same buffers, so `state_dict()` and a later
  per-parameter step see and update the same numbers. Only optimizers whose update is
  elementwise (Adam, AdamW, SGD) are stepped so; any other steps per parameter as before.
- `merge_adjacent` turns copies between adjacent views into one copy per run (the refresh of
  the working copies, laid out in the same order).

Gradients may come in a narrower dtype than the masters (Note [working-dtype gradients] in
runtime/grads.py: bf16 host gradients beside fp32 masters): a run is then stepped a slice of
WIDEN elements at a time, each slice's gradient widened into one reused buffer, so no gradient
exists in fp32 for more than a slice.

A parameter's first step is a per-parameter step of the user's optimizer (which makes its state
the way the optimizer makes it: SGD's momentum is the first gradient, Adam's moments zeros);
its state is then moved into the flat buffers. The user's state entries are checked every step
(a `load_state_dict` replaces them: they are moved again), and scalar state (Adam's `step`) is
kept per parameter as the optimizer keeps it, a run stepping only parameters whose values agree.
"""
from __future__ import annotations

import inspect

import torch

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b starts where a ends, in the same storage, both contiguous and of one dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def _joined(ts: list) -> torch.Tensor:
    """One 1-D view over adjacent tensors."""
    t = ts[0]
    return t.as_strided((sum(x.numel() for x in ts),), (1,), t.storage_offset()) if len(ts) > 1 else t.view(-1)


def merge_adjacent(dsts: list, srcs: list) -> tuple:
    """(dsts, srcs) for one copy per run: consecutive pairs whose destinations and sources
    both continue each other are joined into one 1-D view each."""
    out_d, out_s, run = [], [], []
    for d, s in zip(dsts, srcs):
        if run and _adjacent(run[-1][0], d) and _adjacent(run[-1][1], s) and d.numel() == s.numel():
            run.append((d, s))
            continue
        if run:
            out_d.append(_joined([x for x, _ in run]))
            out_s.append(_joined([y for _, y in run]))
        run = [(d, s)] if (d.numel() == s.numel() and d.is_contiguous() and s.is_contiguous()) else []
        if not run:
            out_d.append(d)
            out_s.append(s)
    if run:
        out_d.append(_joined([x for x, _ in run]))
        out_s.append(_joined([y for _, y in run]))
    return out_d, out_s


class FlatMasters:
    """The flat buffers the trainable host parameters were moved into: param id -> (buffer
    index, offset)."""

    def __init__(self):
        self.buffers: list = []
        self.where: dict = {}

    def covers(self, params) -> bool:
        return all(id(p) in self.where for p in params)

    def flatten(self, params) -> None:
        """Move the given parameters (in this order; trainable floating-point CPU leaves only,
        others are left where they are) into one new buffer per dtype, unless already moved."""
        todo: dict = {}
        for p in {id(p): p for p in params}.values():
            if (id(p) not in self.where and p.requires_grad and p.is_leaf and p.device.type == "cpu"
                    and p.is_floating_point() and p.numel() > 1 and p.is_contiguous()):
                todo.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype, ps in todo.items():
                buf = torch.empty(sum(p.numel() for p in ps), dtype=dtype)
                k = len(self.buffers)
                self.buffers.append(buf)
                off = 0
                for p in ps:
                    view = buf[off:off + p.numel()].view(p.shape)
                    view.copy_(p.data)
                    p.data = view           # (set_data keeps p's own version counter)
                    self.where[id(p)] = (k, off)
                    off += p.numel()


class FlatStepper:
    """Steps the user's optimizer over (parameter, gradient) pairs, a contiguous run at a time
    where it can (Note [flat host optimizer]), per parameter where it cannot."""

    PIECE = 1 << 27
    # elements of a narrower gradient widened at once: a 256 MiB fp32 buffer, and 120 steps of
    # Llama-3.1-8B a submission (each call may wait for the interpreter lock: Note [few calls per step])
    WIDEN = 1 << 26

    def __init__(self, optimizer, masters: FlatMasters):
        self.optimizer, self.masters = optimizer, masters
        self.elementwise = type(optimizer) in ELEMENTWISE
        self._state_bufs: dict = {}     # (buffer index, key) -> flat state buffer
        self._views: dict = {}          # id(param) -> {tensor key: the view we put in its state}
        self._twins: dict = {}          # (buffer index, start, stop, group index) -> (twin optimizer, run view)
        self._stepped: set = set()      # ids of parameters stepped per parameter at least once
        self._wide = None               # the buffer a slice of a narrower gradient is widened into
        sig = inspect.signature(type(optimizer).__init__).parameters
        self._ctor_keys = [k for k in sig if k not in ("self", "params")]

    # -- per parameter -------------------------------------------------------------------------
    def _per_param(self, pairs) -> None:
        """Step pairs with the user's optimizer itself, a slice of about PIECE elements at a time,
        and move the state it made into the flat buffers after each slice: the state of a first
        step exists twice only for one slice, not for the model."""
        piece: list = []
        for i, (p, g) in enumerate(pairs):
            piece.append((p, g))
            if i + 1 == len(pairs) or sum(q.numel() for q, _ in piece) >= self.PIECE:
                for q, h in piece:
                    q.grad = h if h.dtype == q.dtype else h.to(q.dtype)
                self.optimizer.step()
                for q, _ in piece:
                    q.grad = None
                    if id(q) in self.masters.where:
                        self._stepped.add(id(q))
                        if id(q) not in self._views:
                            self._adopt(q)
                piece = []

    def _adopt(self, p) -> bool:
        """Move p's (tensor) optimizer state into the flat state buffers; False if its state is
        not of a kind a run can step (then p keeps being stepped per parameter)."""
        state = self.optimizer.state.get(p) or {}
        if not state and id(p) not in self._stepped:
            return False        # (a parameter stepped once with no state, as plain SGD's, is fine)
        k, off = self.masters.where[id(p)]
        views = {}
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.device == p.device:
                buf = self._state_bufs.get((k, key))
                if buf is None:
                    buf = self._state_bufs[(k, key)] = torch.zeros_like(self.masters.buffers[k], dtype=v.dtype)
                if buf.dtype != v.dtype:
                    return False
                view = buf[off:off + p.numel()].view(p.shape)
                view.copy_(v)
                state[key] = view
                views[key] = view
            elif not (isinstance(v, torch.Tensor) and v.dim() == 0):
                return False
        self._views[id(p)] = views
        return True

    def _flat_ready(self, p, group) -> bool:
        views = self._views.get(id(p))
        if views is None:
            return False
        state = self.optimizer.state.get(p) or {}
        if views and not state:              # the user dropped its state: made anew per parameter
            del self._views[id(p)]
            return False
        if any(state.get(key) is not v for key, v in views.items()):
            return self._adopt(p)            # replaced (load_state_dict): move it again
        return True

    # -- runs ----------------------------------------------------------------------------------
    def _twin(self, k, start, stop, gi, group, example_state):
        key = (k, start, stop, gi)
        twin = self._twins.get(key)
        if twin is None:
            run = self.masters.buffers[k][start:stop]
            opt = type(self.optimizer)([run], **{c: group[c] for c in self._ctor_keys if c in group})
            state = {}
            for name, v in example_state.items():
                if name in self._views_keys(k):
                    state[name] = self._state_bufs[(k, name)][start:stop]
                else:
                    state[name] = v.clone()
            opt.state[run] = state
            twin = self._twins[key] = (opt, run)
        return twin

    def _views_keys(self, k):
        return {name for (kk, name) in self._state_bufs if kk == k}

    def _step_run(self, k, gi, group, run) -> bool:
        """Step a run [(p, g, offset)] as one tensor; False (nothing done) if its scalar state
        disagrees."""
        p0 = run[0][0]
        state0 = self.optimizer.state[p0]
        scalars = [name for name, v in state0.items() if name not in self._views[id(p0)]]
        for name in scalars:
            vals = torch.stack([self.optimizer.state[p][name] for p, _, _ in run])
            if not bool((vals == vals[0]).all()):
                return False
        start, stop = run[0][2], run[-1][2] + run[-1][0].numel()
        grad = _joined([g for _, g, _ in run])
        master = self.masters.buffers[k]
        # a gradient as wide as the masters is stepped at once; a narrower one a slice at a time
        step = stop - start if grad.dtype == master.dtype else self.WIDEN
        for a in range(start, stop, step):
            b = min(stop, a + step)
            opt, flat = self._twin(k, a, b, gi, group, state0)
            twin_group = opt.param_groups[0]
            for name, v in group.items():
                if name != "params":
                    twin_group[name] = v
            twin_state = opt.state[flat]
            for name in scalars:
                twin_state[name].copy_(state0[name])
            g = grad[a - start:b - start]
            if g.dtype != master.dtype:
                if self._wide is None or self._wide.numel() < b - a or self._wide.dtype != master.dtype:
                    # once: as large as a slice of the masters can be (what the plan counts)
                    self._wide = torch.empty(min(self.WIDEN, master.numel()), dtype=master.dtype)
                g = self._wide[:b - a].copy_(g)
            flat.grad = g
            try:
                opt.step()
            finally:
                flat.grad = None
        for name in scalars:
            torch._foreach_copy_([self.optimizer.state[p][name] for p, _, _ in run], [twin_state[name]] * len(run))
        return True

    def step(self, params: list, grads: list) -> None:
        """One optimizer step of `params` with `grads` (aligned lists)."""
        if not self.elementwise:
            for p, g in zip(params, grads):
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
            self.optimizer.step()
            for p in params:
                p.grad = None
            return
        group_of = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        groups = self.optimizer.param_groups
        flat, rest = [], []
        for p, g in zip(params, grads):
            gi = group_of.get(id(p))
            where = self.masters.where.get(id(p))
            if (gi is None or where is None or g.shape != p.shape or not g.is_floating_point() or not g.is_contiguous()
                    or groups[gi].get("differentiable") or not self._flat_ready(p, groups[gi])):
                rest.append((p, g))
            else:
                flat.append((where[0], gi, where[1], p, g))
        flat.sort(key=lambda x: (x[0], x[1], x[2]))
        runs, cur = [], []
        for k, gi, off, p, g in flat:
            if cur and (cur[0][0], cur[0][1]) == (k, gi) and cur[-1][2] + cur[-1][3].numel() == off \
                    and _adjacent(cur[-1][4], g):
                cur.append((k, gi, off, p, g))
            else:
                if cur:
                    runs.append(cur)
                cur = [(k, gi, off, p, g)]
        if cur:
            runs.append(cur)
        stepped = []
        for r in runs:
            k, gi = r[0][0], r[0][1]
            items = [(p, g, off) for _, _, off, p, g in r]
            if self._step_run(k, gi, groups[gi], items):
                stepped += [p for p, _, _ in items]
            else:
                rest += [(p, g) for p, g, _ in items]
        self._per_param(rest)
        if stepped:   # a step is an in-place update of each parameter (HostWeights reads _version)
            torch.autograd.graph.increment_version(stepped)
