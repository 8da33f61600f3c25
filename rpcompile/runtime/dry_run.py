"""Dry runs: a worker process compiles a stage program before its job's inputs arrive.

Note [dry runs]: a stage program's pieces compile at their first call (runtime/programs.py),
and a job's first call waits for the job before it in the chain. So the first step compiled its
jobs one after the other, whatever the number of worker processes: on two H200s with Qwen3-1.7B
(cold caches), job 0 compiled for 14 s while the fused job's worker waited, then the fused job
compiled for 27 s; at 4 GPUs nine jobs chained so, and the next three steps compiled again as
the rotation brought each job to a device that had not run it (108 s of first steps; the
issue's bar is 60). A dry run calls the job's program (a microbatch of each shape) with
stand-ins behind its ops (`DryRunJob`): zeros shaped as the planned values at this run's sizes
(`Stage.shapes`, passes/codegen.py) for what other jobs hand over, zero weights, the run's own
inputs and size values; what the program hands out goes nowhere. The program's own code makes
the calls, so each piece sees what the real job will give it (shapes, dtypes, grad mode, leaves
that require grad, the backward through vjp) and compiles as the real call would need it; the
real job then finds it compiled. A worker dry-runs a program when a job of it is the next of
its queue for the first time: its previous job has ended, and the chain has yet to reach this
one (the jobs between run on other devices), so the compile overlaps that wait, in every step
(the offset that moves the jobs from one run to the next, runtime/schedule.py, brings each job
to every device in turn), instead of following it. The first four steps of 4 worker processes
sharing one H200 (Qwen3-1.7B, cold caches) took 58 s instead of 95. (Also dry-running, while a
job waited, the programs queued behind it, with the weights a prefetch had uploaded: 64 s
against 99 in one run, and real jobs compiled again, 1-4 graphs each; not kept.) Stages that
run eagerly (no Inductor: CPU devices by default, random stages) have nothing to compile and
are not dry-run.

Note [first programs compiled beside the setup]: a train step's first run came to the workers
only once the main process had made the optimizer's flat masters and delayed mode's working
copies (and the workers had mapped them), so their first dry runs began after all of that: on 2
H200s Llama-3.1-8B's workers had imported the compile stack at 12-13 s and built their first
programs at 43.6 s, the main process having planned at 18.4 s (then masters 3.4 s, working copies
8.6 s, and the workers pinned the gradient file for 10.3 s); Qwen3-1.7B's at 17.8 s, planned at
12.0 s (setup timelines of the 2026-11-30 runs, benchmarks/runs/). A dry run needs none of
those: only the plan, the run's microbatches (sizes and inputs), its dtype and buffers, and the
parameters' shapes. So the first train step starts the workers and sends them that ("warm",
ProcessExecutor.warm) before the mode makes its host copies, and each worker dry-runs the program
of the first job the step's schedule gives it (`StandInStep` stands for the step), in its job
thread, ahead of any run; the real job then finds it dry-run (DryRuns.seen). Where each worker
runs a copy of the whole chain (replicas), it dry-runs every job's program so, in the order it
runs them: it would dry-run each right before its job anyway (the copies meet only where a job's
gradients are summed, and each dry-runs the same programs). In a pipeline the other jobs'
programs are dry-run as before, when their jobs come up (there a dry run overlaps the wait for
the chain; done first it would hold the chain's start). On 2 H200s (45th session, one run per
side, beside Note [shared files touched before pinning]) Llama-3.1-8B's first train step returned
at 52.4-57.0 s against 69.2-72.3 s, each worker's first dry run ending before the main process had
made the working copies; Qwen3-1.7B's at 62.0 against 58.0 s, its workers' first compiles running
12.4-13.7 s beside the main process's copies against 7.9-9.4 s after them.

A dry run changes nothing a step reads: it writes no slot, gradient or buffer (buffers and
inputs are cloned, so in-place updates stay in the clones), draws no random numbers, and
its failure only leaves the program to compile at its real first call. On the device it holds
about what its job holds for one microbatch, weights included, after the device's previous job
has ended: beside the job's own prefetched weights, that is the plan's room for one job and
the next job's weights.
"""
from __future__ import annotations

import time
import traceback

import torch

from . import compile_once, ops, timeline
from .job import JobContext
from .weights import working_dtype


class StandInStep:
    """What a dry run reads of a step, before the step exists (Note [first programs compiled
    beside the setup]): the parameters as meta tensors of their shapes and dtypes."""

    def __init__(self, params, buffers, micro, dtype, param_index, buffer_index):
        self.params = [torch.empty(shape, dtype=dt, device="meta") for shape, dt in params]
        self.buffers, self.micro, self.dtype = buffers, micro, dtype
        self.param_index, self.buffer_index = param_index, buffer_index


class DryRunJob:
    """Stands behind a job handle while a program runs on stand-in values."""

    def __init__(self, step, stage, role, dev):
        self.step, self.stage, self.role, self.dev = step, stage, role, dev
        self.handle = ops.register(self)

    def close(self):
        ops.unregister(self.handle)

    def _zeros(self, name, mb):
        sizes, dtype = self.stage.shapes[name]
        syms = self.step.micro[mb].syms
        shape = [s if isinstance(s, int) else int(s.xreplace({x: syms[x.name] for x in s.free_symbols}))
                 for s in sizes]
        return torch.zeros(shape, dtype=dtype, device=self.dev.device)

    def _copy(self, value):
        up = self.dev.upload(value, self.step.dtype)
        return up.clone() if isinstance(up, torch.Tensor) and self.dev.is_cpu else up

    # what the program's ops ask of a job (runtime/job.py's JobContext)
    def span(self, stream_name, name, fn, mb=None, **attrs):
        return fn()

    def weight(self, name, rows=None):
        p = self.step.params[self.step.param_index[name]]
        shape = p.shape if rows is None else (rows[1] - rows[0], *p.shape[1:])
        return torch.zeros(shape, dtype=working_dtype(p, self.step.dtype), device=self.dev.device)

    def buffer(self, name):
        return self._copy(self.step.buffers[self.step.buffer_index[name]])

    def fetch(self, mb, name):
        return self._zeros(name, mb)

    def fetch_grad(self, mb, name):
        return self._zeros(name, mb)

    def user_input(self, mb, index):
        return self._copy(self.step.micro[mb].leaves[index])

    sym = JobContext.sym                 # (read the step's microbatch only)
    loss_seed = JobContext.loss_seed
    loss_scale = JobContext.loss_scale

    def rng_key(self, mb):
        raise RuntimeError("a random stage is not dry-run")

    def wait(self, mb):
        pass

    def done(self, mb):
        pass

    def prefetch_next(self, mb):
        pass

    def offload(self, mb, name, value):
        pass

    def output(self, mb, name, value):
        pass

    def offload_grad(self, mb, name, value):
        pass

    def accumulate_grads(self, grads):
        pass


def dry_run(step, stage, role: str, dev, program, locks=None) -> None:
    """Run `program` (a stage job in `role`) on stand-in values (Note [dry runs]). Given worker
    processes' CompileLocks, first as a sharing pass, then, if it left pieces to other processes,
    again to load those from the caches (Note [pieces compiled side by side], compile_once.py)."""
    if locks is None:
        return _run(step, stage, role, dev, program)
    ok = False
    try:
        with compile_once.sharing_pass() as shared:
            _run(step, stage, role, dev, program)
        ok = True
    finally:
        locks.settle(ok)
    if shared.skipped:
        _run(step, stage, role, dev, program)


def _run(step, stage, role: str, dev, program) -> None:
    """One microbatch of each shape the step's microbatches have (a batch that does not split
    evenly has two)."""
    ctx = DryRunJob(step, stage, role, dev)
    shapes = set()
    try:
        with torch.enable_grad() if role != "fwd" else torch.no_grad():
            for mb, micro in enumerate(step.micro):
                shape = (micro.rows, tuple(sorted(micro.syms.items())))
                if shape not in shapes:
                    shapes.add(shape)
                    program.forward(ctx.handle, mb)
    finally:
        ctx.close()


class DryRuns:
    """Which programs a worker process has dry-run or run (Note [dry runs])."""

    def __init__(self, programs, dev):
        self.programs, self.dev = programs, dev
        self.seen: set = set()          # (plan key, stage, role) dry-run or run here

    def wanted(self, stage, role) -> bool:
        """Whether the program compiles, and every value it fetches has a planned shape."""
        if not self.programs.use_inductor(stage):
            return False
        fetched = {n for n in stage.inputs if stage.kinds.get(n) == "act"}
        if role != "fwd":
            fetched |= set(stage.grad_outputs)
        return fetched <= stage.shapes.keys()

    def before_job(self, step, plan, stage, role) -> None:
        """Dry-run the job's program unless this worker has run it (or tried to)."""
        key = (plan.key, stage.index, role)
        if key in self.seen:
            return
        self.seen.add(key)
        if not self.wanted(stage, role):
            return
        t0 = time.perf_counter()
        try:
            program = self.programs.get(plan.key, plan.capture_key, plan.capture_device, stage, role, self.dev.device)
            dry_run(step, stage, role, self.dev, program, self.programs.locks)
        except Exception:   # noqa: BLE001 - the real first call compiles, and reports what fails
            last = traceback.format_exc().strip().splitlines()[-1]
            timeline.mark(f"dry run of {stage.index}{role} on {self.dev.label} failed: {last}",
                          time.perf_counter() - t0)
            return
        timeline.mark(f"dry run of {stage.index}{role} on {self.dev.label}", time.perf_counter() - t0)
        timeline.mark_compile_seconds()
