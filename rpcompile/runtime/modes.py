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
ended, `mode.finish(runner, plan, step, run)` (or `mode.abandon(step)` if it failed); delayed mode
hands a step's gradients on as its loss is known (`submit_early`, Note [chunk-wise submission] in
runtime/submission.py).

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

import functools
import sys
import time

import torch

from . import timeline
from .executor import Executor
from .grads import DeviceGrads, as_dtype, for_step, param_index, settled, sum_param_grads
from .job import job_params
from .submission import ChunkGrads, host_indices, submission_chunks
from .weights import DelayedWeights


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


def _param_names(plan, params, shown: int = 4) -> str:
    names = {id(p): n for n, p in zip(plan.captured.param_names, plan.captured.params)}
    listed = [names.get(id(p), "?") for p in params]
    return ", ".join(listed[:shown]) + (f" and {len(listed) - shown} more" if len(listed) > shown else "")


def host_order(plan) -> list:
    """The parameters in host_indices order."""
    return [plan.captured.params[i] for i in host_indices(plan)]


class _Mode:
    def overlaps(self, plan) -> bool:
        """Whether train_step may return while the step's backward jobs still run (Note
        [overlapped steps]): only where the next step needs nothing of them."""
        return False

    def release(self, runner) -> None:
        """Before another mode takes over the host gradient set."""

    def forget_plan(self, plan) -> None:
        """A plan dropped with its capture (Note [captures kept] in plan_cache.py)."""

    def abandon(self, step):
        """A step started by start() that will not finish (it, or the step before it, failed);
        returns a note for the error, or None."""

    def submit_early(self, runner, plan, step, run) -> None:
        """The step's loss is known and its backward jobs run: hand its gradients on now, if the
        mode can (Note [chunk-wise submission])."""

    def issued(self, runner, plan) -> None:
        """The step's jobs have been handed to the devices."""

    def call_weights(self, runner, plan):
        """Where a call (not a train step) reads its weights; None: the live parameters, through
        the runner's HostWeights."""
        return None


class ExactMode(_Mode):
    """Gradients land in `param.grad` (fp32 on the host) when train_step returns.

    Note [lent gradients]: a parameter whose `.grad` is None gets a view of the host gradient
    set itself, not a copy (a fresh 6.9 GB copy a step cost Qwen3-1.7B on one H200 2.70 s a
    step against 2.17 s at the issue's tree: twenty-fourth session). Before the next step writes
    the set, `release` looks at what still holds each lent view: `param.grad` alone (no
    zero_grad, as in accumulation over calls, or zero_grad(set_to_none=False)) gets a copy, to
    which the step then adds, as eager's backward adds into `.grad`; a reference of the user's
    (the tensor kept past zero_grad()) keeps the memory, and the set moves to new memory
    (worker processes: a new shared file; every process forgets the old one, whose memory goes
    with the user's views: HostGrads.renew). With
    zero_grad() every step writes the same memory.
    """

    optimizer = None

    def __init__(self):
        self._lent: list = []           # (parameter, the view of the set it was given)

    def release(self, runner) -> None:
        lent, self._lent = self._lent, []
        kept = False
        while lent:
            p, view = lent.pop()
            in_grad = p.grad is view
            # references: `view` here, getrefcount's argument, and p.grad where it still is the view
            if sys.getrefcount(view) > 2 + in_grad:
                kept = True
            elif in_grad:
                p.grad = view.clone()
        if kept:
            runner.host_grads.renew()

    def start(self, runner, plan, micro):
        self.release(runner)
        return runner.new_step(plan, micro)

    def finish(self, runner, plan, step, run):
        with torch.no_grad():
            for i, g in sum_param_grads(step.param_grads, step.grads.row_sums).items():
                p = plan.captured.params[i]
                if p.grad is not None:
                    p.grad.add_(as_dtype(g, p.dtype))
                elif g.dtype == p.dtype and g.device == p.device:
                    lent = g.view(g.shape)     # a tensor of its own over the set (Note [lent gradients])
                    p.grad = lent
                    self._lent.append((p, lent))
                else:
                    p.grad = g.to(p.dtype, copy=True)


class OverlappedMode(_Mode):
    """The attached optimizer (runtime/optimizer.py) steps each step's gradients in its thread."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.prepared = False
        self.device_grads = None      # DeviceGrads (Note [gradients stay on the device], grads.py)

    def start(self, runner, plan, micro):
        self.optimizer.flatten(host_order(plan), runner.optimizer_share)
        # one set of host gradients: Note [host gradient buffers]
        step = runner.new_step(plan, micro, gate=self.optimizer.wait_param, ready=self.optimizer.is_ready)
        step.device_grads = self._device_grads(runner, plan)
        self._prepare(plan, step)
        return step

    def release(self, runner) -> None:
        self.device_grads = None      # (its memory goes to the next mode's jobs)

    def _device_grads(self, runner, plan):
        """The DeviceGrads a step's gradients stay in, or None where they come down (Note
        [gradients stay on the device]): one job with gradients, in a worker thread, its
        parameters stepped on one device (and the host)."""
        layout = plan.host_memory.grad_layout
        if plan.replicas > 1 or len(layout.stages) != 1 or layout.row_sums or not isinstance(runner.executor, Executor):
            return None
        params, masters = plan.captured.params, self.optimizer.masters
        (_, keys), = layout.keys.items()
        places = {i: masters.place_of(params[i])[1] for i in {param_index(key) for key, _, _ in keys}}
        devices = {r[2] for r in places.values() if r is not None}
        if len(devices) != 1:
            return None
        device = devices.pop()
        if self.device_grads is None or self.device_grads.device != device:
            self.device_grads = DeviceGrads(device)
        self.device_grads.params = frozenset(i for i, r in places.items() if r is not None)
        return self.device_grads

    def _prepare(self, plan, step, host_buffers=()):
        """At the first step's start, with worker processes and a share of the optimizer on the
        devices: Note [ready before the first step] (runtime/flat.py)."""
        if (not self.prepared and self.optimizer.stepper.page_lock is not None
                and any(self.optimizer.masters.on_devices.values())):
            self.prepared = True
            self.optimizer.prepare(plan.captured.params, [step.grads.flat(), *host_buffers])

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
            out = [for_step(totals[i], params[i].dtype) for i in order]
            settled(out)      # (summed or cast on a device: Note [gradients stay on the device])
            return out
        return order, grads

    def finish(self, runner, plan, step, run):
        order, grads = self._submission(plan, step)
        params = plan.captured.params
        refresh = runner.pinned_refresh(step.dtype)
        # where the jobs read the working copies the refresh writes, not the host masters
        # (Note [masters down after the copies], runtime/flat.py)
        self.optimizer.submit([params[i] for i in order], grads, refresh, masters="last" if refresh is not None else "each")


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
        self.skipped = 0              # optimizer submissions of steps that failed after it (abandon)
        self.grad_keys: dict = {}     # id(plan) -> (plan, {job: gradient keys}) of a step that ended
        self.carried: dict = {}       # rows key -> its rows, copied out of their piece (Note [chunk-wise submission])

    def overlaps(self, plan) -> bool:
        # decided when the plan was made (passes._steps_overlap), which costed it so
        return plan.steps_overlap

    def _new_copies(self, runner, plan) -> None:
        """The two copies, made from the parameters as they are when the first step starts, made
        again where a parameter has none or trains now (Note [changes between delayed steps],
        weights.py), each holding what the copies it replaces held."""
        self.optimizer.synchronize()
        runner.release_call_copies()    # (the first train plan's host budget counted them free)
        t0 = time.perf_counter()
        order = host_order(plan)
        self.optimizer.flatten(order, runner.optimizer_share)
        timeline.mark("flat masters made", time.perf_counter() - t0)
        t0 = time.perf_counter()
        previous, self.copies = self.copies, None
        self.copies = DelayedWeights(order, runner.working_dtype(plan), pin=runner.host_placement, previous=previous)
        if previous is not None:
            runner.forget_shared(previous.buffers)
        timeline.mark("working copies made", time.perf_counter() - t0)

    def start(self, runner, plan, micro):
        t = self.started
        params = plan.captured.params
        # what changed since the last step (Note [changes between delayed steps]), once a step
        renew = self.copies is None or self.copies.needs_new_copies(params)
        written = [] if renew else self.copies.written_since(params)
        changed = self.copies is not None and (renew or bool(written))
        if changed:
            runner.settle()      # (the step behind reads the copies: its end queues the next uploads)
        pending, self.next_upload = self.next_upload, None
        waited = time.perf_counter()
        self.optimizer.wait_completed(t - 1 + self.skipped)
        # seconds each step's start waited for the optimizer step it reads (benchmarks read them)
        self.start_waits = (self.start_waits + [time.perf_counter() - waited])[-16:]
        if changed and pending is not None:     # read from the copies as they were: let them land unused
            for dev in pending[1]:
                future = dev.prefetched.pop(pending[2], None)
                if future is not None:
                    future.result()
            pending = None
        if renew:
            self._new_copies(runner, plan)
        elif written:
            self.copies.rewrite_shared(written)
        step = runner.new_step(plan, micro, host_weights=self.copies.view(t % 2))
        # Note [one gradient set]: a job writes its piece once every earlier submission is done
        # with it, the one of a step still running included (Note [overlapped steps])
        step.grad_need = step.grads.submitted + (t - self.steps)
        self._prepare(plan, step, self.copies.buffers)
        if pending is not None:   # the uploads finish() started, if they are for this step's first jobs
            was_plan, devs, key = pending
            firsts = _first_devices(runner, plan)
            for dev in devs:
                future = dev.prefetched.pop(key, None)
                if future is not None and was_plan is plan and key == ("next step", t) and dev in firsts:
                    step.first_upload.append((dev, future))
        self.started += 1
        return step

    def call_weights(self, runner, plan):
        """Note [calls read the newest copies]: a call reads the parameters as every submitted
        optimizer step left them, which delayed mode's copies hold already, each parameter in the
        copy its last step wrote: a call through the runner's HostWeights instead made a third
        working copy, pinned and kept (2 B a parameter the host plan does not count: 15 GiB for
        Llama-3.1-8B, beside a plan the host budget fits to within its margin; on one H200 with
        125.8 GiB of host, a process at 105.6 GiB ended at such a call, where reading the copies
        adds nothing: benchmarks/runs/call_copies). A parameter whose copy does not equal it
        (written in place since) is read through HostWeights as before; the check (a compare of
        each copy with its parameter) runs once per optimizer write or in-place change. The
        copies a call made before the first train step go when delayed mode's are made (with
        worker processes, their shared files too: they would stay beside them for nothing), and
        the first train plan's host budget counts them free, in every mode (exact and overlapped
        modes train with them: the plan's working copies): measured with them taken,
        Llama-3.1-8B's on that host was 84.7 GiB, where nothing fits (benchmarks/runs/call_before)."""
        if self.copies is None or not self.copies.covers(plan.captured.params):
            return None
        self.optimizer.synchronize()
        return self.copies.call_view(runner.host_weights)

    def abandon(self, step):
        if step.submission is not None:
            # submitted when its loss was known (Note [chunk-wise submission]): the optimizer
            # stops it at the next chunk; its place in the pieces' counts is given up by then
            self.optimizer.wait_completed(step.submission, raise_errors=False)
            stepped = self.optimizer.abandoned.pop(step.submission, [])
            self.optimizer.take_back(step.hyper)
            self.steps -= 1
            self.skipped += 1
            self.started -= 1
            if not stepped:
                return None
            names = _param_names(step.plan, stepped)
            return (f"the optimizer had already stepped {len(stepped)} parameters with this step's gradients, "
                    f"which were complete ({names}); the other parameters are unchanged")
        self.optimizer.take_back(step.hyper)      # (taken as train_step returned: submit_early)
        # its submission's place in the gradient pieces' counts is given up at once, so a later
        # step's job waiting for it goes on (after the earlier submissions: the counts only grow)
        self.optimizer.wait_completed(self.steps + self.skipped, raise_errors=False)
        gs = step.grads
        gs.submitted += 1
        gs.release(range(len(gs.consumed)), gs.submitted)
        self.started -= 1
        return None

    def forget_plan(self, plan) -> None:
        self.grad_keys.pop(id(plan), None)

    def submit_early(self, runner, plan, step, run):
        keys = self.grad_keys.get(id(plan))
        if keys is not None and keys[0] is plan:
            self._submit(runner, plan, step, run, keys[1])
        else:     # submitted at the next call: it steps by the groups as train_step returns
            step.hyper = self.optimizer.take_hyperparameters()    # (Note [hyperparameters per submission])

    def finish(self, runner, plan, step, run):
        if step.submission is not None:
            return
        keys = {job: list(grads) for job, grads in step.param_grads.items() if grads}
        # the gradient keys of a plan's jobs are the same every step: the next steps of this
        # plan are submitted when their loss is known (Note [chunk-wise submission])
        self.grad_keys[id(plan)] = (plan, keys)
        self._submit(runner, plan, step, run, keys)

    def _submit(self, runner, plan, step, run, keys):
        """One submission, in the order of the flat buffers (Note [flat host optimizer]), a
        chunk per piece of the gradient buffer, each stepped once its jobs landed and each
        piece given back after the last chunk that reads it (Note [chunk-wise submission])."""
        self.optimizer.raise_if_failed()
        step.hyper = step.hyper or self.optimizer.take_hyperparameters()
        params = plan.captured.params
        chunks = submission_chunks(plan, keys)
        have = set(chunks.order)
        slot = self.steps % 2
        copies, gs = self.copies, step.grads
        gs.submitted += 1
        count = gs.submitted
        releases = iter(chunks.release)

        land_later = functools.partial(self.optimizer.stepper.copy_down, land_later=True)

        def refresh(ps):
            # the gradients are read (stepped): their pieces go back before the copies are written,
            # which come down from the devices while the next chunk steps (Note [chunks within a
            # piece], runtime/submission.py)
            gs.release(next(releases, ()), count)
            copies.write_many(ps, slot, land_later)
        grads = ChunkGrads(chunks, gs, run.landed, {i: params[i].dtype for i in chunks.order}, self.carried)
        # (frozen since the copies were made too: Note [changes between delayed steps])
        others = [p for i, p in enumerate(params) if i not in have and copies.two_copies(p)]
        # no job reads the host masters: those stepped on the devices stay there (Note [masters
        # kept on the devices], runtime/flat.py)
        self.optimizer.submit([params[i] for i in chunks.order], grads, refresh, others, chunks=chunks.lengths,
                              on_done=lambda: gs.release(range(len(gs.consumed)), count), masters="kept",
                              hyper=step.hyper)
        self.steps += 1
        step.submission = self.steps + self.skipped     # the optimizer's count once it is done
        self._upload_first_job(runner, plan, self.started)

    def issued(self, runner, plan) -> None:
        """Note [next weights during the step]: where each device runs one job a step (the
        fused job, replicated or not), the next step's first job is this step's job on every
        device, and its weights (copy (t + 1) % 2) are final once the optimizer has stepped the
        gradients of step t - 1, which it does while step t runs. Asked for at the step's end,
        as with more jobs, their upload (3.2 GiB for Qwen3-1.7B: about 60 ms at the 55 GB/s
        measured from shared host memory) starts between the steps, where two H200s (replicas)
        had 80-90 ms without compute each 0.8 s step, the next step's first kernel waiting. So
        they go up as soon as that optimizer step is done, during this step. With more jobs a
        device, its uploader is busy with this step's next jobs (and worker threads wait for
        the optimizer in that uploader), so they are asked for at the step's end as before.
        Measured (39th session, 2 H200s, Qwen3-1.7B, 16 timed steps): the GPU's idle time between
        the steps 93-100 -> 65-71 ms, median step 0.786 -> 0.762 s, 82,189 -> 84,805 tokens/s."""
        if len(plan.stages) == 1:
            self._upload_first_job(runner, plan, self.started)

    def _upload_first_job(self, runner, plan, t):
        """Step t's first job reads copy t % 2, final once optimizer step t - 2 is done, so its
        weights go up now (the uploader waits for that step), while the host ends step t - 1
        (or earlier: Note [next weights during the step]), rather than when step t starts."""
        if not plan.early_first_upload:   # the device has no room for it yet (Note [resident weights])
            return
        devs = _first_devices(runner, plan)
        params = job_params(plan.captured.params, plan.stages[0])
        opt, key, done = self.optimizer, ("next step", t), t - 1 + self.skipped
        if self.next_upload is not None and self.next_upload[2] == key:
            return            # asked for already (as the step before this one ended)
        for dev in devs:
            dev.prefetch(key, params, runner.working_dtype(plan), self.copies.view(t % 2),
                         before=lambda: opt.wait_completed(done, raise_errors=False))
        self.next_upload = (plan, devs, key)


def _first_devices(runner, plan) -> list:
    """The devices that run a copy of the next step's first job: the next in the rotation, or
    with replicas each of theirs (Note [replicas])."""
    workers = runner.executor.workers
    return [w.dev for w in workers[:plan.replicas]] if plan.replicas > 1 else [runner.executor.next_device()]


def mode_for(config, optimizer):
    """The mode of Config.optimizer_mode, with an attached OverlappedOptimizer (or None)."""
    if config.optimizer_mode == "exact" or optimizer is None:
        return ExactMode()
    return DelayedMode(optimizer) if config.optimizer_mode == "delayed" else OverlappedMode(optimizer)
