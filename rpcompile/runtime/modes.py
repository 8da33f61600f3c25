"""The optimizer modes, each in one place: how a step starts (which weights its jobs read) and
what happens to its gradients when its jobs have ended.

- ExactMode: gradients are added into `param.grad`; the user steps the optimizer.
- OverlappedMode: the attached optimizer steps in a host thread (Note [overlapped optimizer]);
  the next step's jobs wait only for the parameters they read. Results equal exact mode.
- DelayedMode: the next step does not wait for the optimizer step (Note [delayed optimizer]):
  step t reads the copies optimizer step t - 2 wrote, one step of delay as RoundPipe's
  asynchronous step; its backward jobs write a gradient piece once the optimizer has read it
  (Note [one gradient set] in runtime/grads.py).

The runner calls `mode.start(runner, plan, micro)` for a step's state and, once its jobs have
ended, `mode.finish(runner, plan, step)` (or `mode.abandon(step)` if it failed).

Note [overlapped steps]: a step's jobs form one chain (forward jobs, the fused loss job, the
backward jobs), so a step alone keeps N devices busy only in its middle: with J jobs of M
microbatches each, J*M job-microbatches take J+M-1 slots of N devices (9 jobs, 4 microbatches, 4
GPUs: 36 of 48 slots, 75% at best). In delayed mode the next step needs nothing from this
step's backward jobs (it reads the weights of the optimizer step before, and writes a gradient
piece only once this step's submission is done with it), so `train_step` returns once the loss
is known and the next call issues its jobs behind the backward jobs still running: each
device runs its jobs in the order they were issued, and the next step's first jobs fill the
devices this step's chain has left. The call after that first ends the step before it
(`GraphRunner.settle`: wait for its backward jobs, hand its gradients to the optimizer), so at
most one step runs behind the caller. A failure of a step's backward jobs is raised by the
next call (or `cm.synchronize()`), after the step that call issued has been stopped; neither
step's gradients reach the optimizer. Whatever reads the parameters (a call, `synchronize`,
attaching an optimizer, a step of another plan) settles first. Steps whose jobs update buffers
in place (running statistics) do not overlap: the next step reads those buffers.
"""
from __future__ import annotations

import time

import torch

from .device import Pending, resolve
from .grads import param_index
from .weights import DelayedWeights


def _as(t, dtype):
    """t in dtype, without a call into torch when it already is (Note [few calls per step])."""
    return t if t.dtype == dtype else t.to(dtype)


def grad_indices(job_grads: dict) -> set:
    """Indices of the parameters a step's jobs made gradients for (without waiting for them)."""
    return {param_index(key) for grads in job_grads.values() for key in grads}


def use_order(plan) -> list:
    """Parameter indices in the order the forward reads them (stage order, then graph order)."""
    order, seen = [], set()
    for st in plan.stages:
        for i in list(st.params) + [key[0] for key in st.param_slices.values()]:
            if i not in seen:
                seen.add(i)
                order.append(i)
    return order


def host_indices(plan) -> list:
    """Parameter indices in the order their gradients lie in the plan's host gradient buffer
    (GradLayout), then the rest in captured order: the order the flat masters and working
    copies take, so a run contiguous in one is contiguous in the others (Note [flat host
    optimizer] in runtime/flat.py)."""
    layout, params = plan.host_memory.grad_layout, plan.captured.params
    order, seen = [], set()
    for s in sorted(layout.keys, key=lambda s: layout.stages[s][0]):
        for key, _, _ in layout.keys[s]:
            i = param_index(key)
            if i not in seen and (not isinstance(key, tuple) or i in layout.whole_rows):
                seen.add(i)
                order.append(i)
    return order + [i for i in range(len(params)) if i not in seen]


def piece_chunks(layout, order: list) -> tuple:
    """(chunk lengths, stage pieces per chunk) of parameter indices `order` (host_indices
    order): a chunk per piece of the gradient buffer, in its order, holding the parameters
    whose gradient lies there (none for a piece of row gradients only), and a last chunk of
    those whose gradient is a buffer of its own (row sums)."""
    piece_of = {}
    for s in layout.keys:
        for key, _, _ in layout.keys[s]:
            i = param_index(key)
            if i not in piece_of and (not isinstance(key, tuple) or i in layout.whole_rows):
                piece_of[i] = s
    stages = sorted(layout.keys, key=lambda s: layout.stages[s][0])
    counts = {s: 0 for s in stages}
    for i in order:
        if i in piece_of:
            counts[piece_of[i]] += 1
    lengths = [counts[s] for s in stages] + [sum(1 for i in order if i not in piece_of)]
    return lengths, [[s] for s in stages] + [[]]


def host_order(plan) -> list:
    """The parameters in host_indices order."""
    return [plan.captured.params[i] for i in host_indices(plan)]


def sum_param_grads(job_grads: dict, row_sums: dict) -> dict:
    """Host gradient per parameter index from {job: {key: host view}}, summed over the jobs (a
    job that took only rows of a parameter, keyed (index, start, stop), adds into those rows).

    One wait per job: a job's gradients come down in one copy, whose completion covers them
    all (Note [few calls per step]). A parameter's gradient is the view of the first job that
    made all of it, the other jobs' gradients of it added in place (the views are this step's
    own, Note [host gradient buffers]); a parameter with rows only is its entry of `row_sums`
    (param index -> its whole gradient, kept across steps): where its rows already lie there,
    in order (GradLayout.whole_rows), nothing is copied, else they are summed into it."""
    for grads in job_grads.values():
        resolve(list(grads.values())[-1:])
    entries = [(key, g.tensor if isinstance(g, Pending) else g) for j in sorted(job_grads)
               for key, g in job_grads[j].items()]
    totals = {}
    rows: dict = {}
    for key, g in entries:
        if isinstance(key, tuple):
            rows.setdefault(key[0], []).append((key[1], key[2], g))
        elif key in totals:
            totals[key].add_(g)
        else:
            totals[key] = g
    for i, parts in rows.items():
        if i not in totals:
            whole = row_sums[i]
            if not all(whole[start:stop].data_ptr() == g.data_ptr() for start, stop, g in parts):
                whole.zero_()
                torch._foreach_add_([whole[start:stop] for start, stop, _ in parts], [g for _, _, g in parts])
            totals[i] = whole
        else:
            torch._foreach_add_([totals[i][start:stop] for start, stop, _ in parts], [g for _, _, g in parts])
    return totals


class _Mode:
    def overlaps(self, plan) -> bool:
        """Whether train_step may return while the step's backward jobs still run (Note
        [overlapped steps]): only where the next step needs nothing of them."""
        return False

    def abandon(self, step) -> None:
        """A step started by start() that will not finish (it, or the step before it, failed)."""


class ExactMode(_Mode):
    """Gradients land in `param.grad` (fp32 on the host) when train_step returns."""

    optimizer = None

    def start(self, runner, plan, micro):
        return runner.new_step(plan, micro)

    def finish(self, runner, plan, step):
        with torch.no_grad():
            for i, g in sum_param_grads(step.param_grads, step.grads.row_sums).items():
                p = plan.captured.params[i]
                # a copy: the host gradient buffers are rewritten by the next step
                p.grad = g.to(p.dtype, copy=True) if p.grad is None else p.grad.add_(_as(g, p.dtype))


class OverlappedMode(_Mode):
    """The attached optimizer (runtime/optimizer.py) steps each step's gradients in its thread."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def start(self, runner, plan, micro):
        self.optimizer.flatten(host_order(plan))
        # one set of host gradients: Note [host gradient buffers]
        return runner.new_step(plan, micro, gate=self.optimizer.wait_param, ready=self.optimizer.is_ready)

    def _submission(self, plan, step, order_of=use_order):
        """(parameter indices in use order, grads()) of a finished step. The optimizer thread
        waits for the gradients' downloads, not train_step: the next step's jobs start while
        the last job's gradients still come down. It holds the gradients only, never the step
        (whose activations are freed for the next step)."""
        params, job_grads, row_sums = plan.captured.params, step.param_grads, step.grads.row_sums
        have = grad_indices(job_grads)
        order = [i for i in order_of(plan) if i in have]

        def grads():
            totals = sum_param_grads(job_grads, row_sums)
            return [_as(totals[i], params[i].dtype) for i in order]
        return order, grads

    def finish(self, runner, plan, step):
        order, grads = self._submission(plan, step)
        params = plan.captured.params
        self.optimizer.submit([params[i] for i in order], grads, runner.pinned_refresh(step.dtype))


class DelayedMode(OverlappedMode):
    """Note [delayed optimizer]: step t reads copy t % 2 (DelayedWeights), which optimizer step
    t - 2 wrote; the optimizer writes step t's result into copy t % 2 for step t + 2."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.copies = None            # DelayedWeights, made at the first step
        self.steps = 0                # train steps finished (submitted) since the optimizer was attached
        self.started = 0              # train steps started: those and the one still running (if any)
        self.next_upload = None       # (plan, device, key): the next step's first job's weights, going up
        self.start_waits: list = []   # seconds the last steps' starts waited for the optimizer

    def overlaps(self, plan) -> bool:
        # running statistics a step updates are read by the next one (and restored on failure)
        return not plan.mutated_buffers

    def _copies(self, runner, plan) -> DelayedWeights:
        """The two copies, made from the parameters as they are when the first step (or a step
        with parameters the copies lack) starts."""
        params = plan.captured.params
        if self.copies is None or not self.copies.covers(params):
            self.optimizer.synchronize()
            order = host_order(plan)
            self.optimizer.flatten(order)
            self.copies = DelayedWeights(order, runner.working_dtype(plan), pin=runner.host_placement)
        return self.copies

    def start(self, runner, plan, micro):
        t = self.started
        pending, self.next_upload = self.next_upload, None
        waited = time.perf_counter()
        self.optimizer.wait_completed(t - 1)
        # seconds each step's start waited for the optimizer step it reads (benchmarks read them)
        self.start_waits = (self.start_waits + [time.perf_counter() - waited])[-16:]
        step = runner.new_step(plan, micro, host_weights=self._copies(runner, plan).view(t % 2))
        # Note [one gradient set]: a job writes its piece once every earlier submission is done
        # with it, the one of a step still running included (Note [overlapped steps])
        step.grad_need = step.grads.submitted + (t - self.steps)
        if pending is not None:   # the upload finish() started, if it is for this step's first job
            was_plan, dev, key = pending
            future = dev.prefetched.pop(key, None)
            if (future is not None and was_plan is plan and key == ("next step", t)
                    and dev is runner.executor.next_device()):
                step.first_upload = (dev, future)
        self.started += 1
        return step

    def abandon(self, step):
        # its submission's place in the gradient pieces' counts is given up at once, so a later
        # step's job waiting for it goes on (after the earlier submissions: the counts only grow)
        self.optimizer.wait_completed(self.steps, raise_errors=False)
        gs = step.grads
        gs.submitted += 1
        gs.release(range(len(gs.consumed)), gs.submitted)
        self.started -= 1

    def finish(self, runner, plan, step):
        # one submission, in the order of the flat buffers (Note [flat host optimizer]), a chunk
        # per piece of the gradient buffer, each piece given back once stepped (Note [one
        # gradient set])
        self.optimizer.raise_if_failed()
        order, grads = self._submission(plan, step, host_indices)
        params = plan.captured.params
        have = set(order)
        slot = self.steps % 2
        copies, gs = self.copies, step.grads
        gs.submitted += 1
        count = gs.submitted
        lengths, pieces = piece_chunks(plan.host_memory.grad_layout, order)
        releases = iter(pieces)

        def refresh(ps):
            copies.write_many(ps, slot)
            gs.release(next(releases, ()), count)
        others = [p for i, p in enumerate(params) if i not in have and p.requires_grad]
        self.optimizer.submit([params[i] for i in order], grads, refresh, others, chunks=lengths,
                              on_done=lambda: gs.release(range(len(gs.consumed)), count))
        self.steps += 1
        self._upload_first_job(runner, plan, self.started)

    def _upload_first_job(self, runner, plan, t):
        """Step t's first job reads copy t % 2, final once optimizer step t - 2 is done, so its
        weights go up now (the uploader waits for that step), while the host ends step t - 1,
        rather than when step t starts."""
        dev = runner.executor.next_device()
        params = [(i, plan.captured.params[i]) for i in plan.stages[0].params]
        opt, key = self.optimizer, ("next step", t)
        if self.next_upload is not None and self.next_upload[2] == key:
            return            # asked for already (as the step before this one ended)
        dev.prefetch(key, params, runner.working_dtype(plan), self.copies.view(t % 2),
                     before=lambda: opt.wait_completed(t - 1, raise_errors=False))
        self.next_upload = (plan, dev, key)


def mode_for(config, optimizer):
    """The mode of Config.optimizer_mode, with an attached OverlappedOptimizer (or None)."""
    if config.optimizer_mode == "exact" or optimizer is None:
        return ExactMode()
    return DelayedMode(optimizer) if config.optimizer_mode == "delayed" else OverlappedMode(optimizer)
