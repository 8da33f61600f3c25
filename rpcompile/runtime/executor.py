"""The dispatcher: one worker thread per device runs the stage jobs handed to it, in order.

What runs where is decided before the run, as data (runtime/schedule.py): stage job k of a
step runs on device (offset + k) mod N, the offset carrying on across steps, so the device
that ran the last job of a step is not the one that starts the next. The executor keeps the
offset and executes schedules.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Optional

import torch

from ..errors import StageError, StepAbandoned
from .device import DeviceRuntime, resolve
from .host_buffers import host_empty
from .job import JobLinks, StepState, run_job
from .replicas import GradExchange
from .schedule import Schedule
from .shared import SlotPool, SlotSets


class _Worker:
    def __init__(self, dev: DeviceRuntime, name: str):
        self.dev = dev
        # (a SimpleQueue: the executor's finalizer puts the end here, from any thread, in the
        # middle of anything: Note [finalizers take no lock] in shared.py)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self):
        self.dev.enter_thread()
        while True:
            item = self.jobs.get()
            if item is None:      # the executor was collected: end the thread
                return
            fn, finished = item
            try:
                fn()
            finally:
                # Drop the job (and the step it refers to) before blocking for the next one.
                item = fn = None
                finished.set()


class _PinnedChunks:
    """Chunks of a slot set in this process: page-locked, of exactly their size."""

    @staticmethod
    def empty(shape, dtype):
        return host_empty(shape, dtype, True, "activations", exact=True)


def _give_back(slot_sets, slots, devices):
    """A step is gone: its slot set is free once the copies issued so far on each GPU's
    streams (the step's among them) have completed (Note [slot sets])."""
    events = []
    for d in devices:
        if not d.is_cpu:
            for stream in (d.compute, d.acts_in, d.out):
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
    slot_sets.give(slots, events)


def _run_with_slots(step, a, stage, dev, program, links, slots):
    """run_job, its downloads in the job's chunks of the step's slot set."""
    mine = slots.setdefault((a.job, a.role, a.replica), [])
    pool = SlotPool(_PinnedChunks, mine)
    dev.host_slots = pool.empty
    try:
        run_job(step, a.job, a.prev_job, stage, a.role, dev, program, links, a.microbatches, a.replica)
    finally:
        mine[:] = pool.kept()       # Note [outgrown slots] (runtime/shared.py)


def _stop(workers, devices):
    for w in workers:
        w.jobs.put(None)
    for d in devices:
        d.close()
    # Wait for the threads to end while the interpreter is whole: a worker thread that ends
    # during interpreter shutdown (this runs at exit too) aborts the process in its C++
    # thread-local destructors ("terminate called without an active exception").
    for w in workers:
        if w.thread is not threading.current_thread():
            w.thread.join(timeout=10)


class Executor:
    """Worker threads for the devices of a Config, and the round-robin offset."""

    def __init__(self, devices, peer_transfers: bool = False):
        self.devices = [DeviceRuntime(d, peer_transfers) for d in devices]
        for i, d in enumerate(self.devices):
            d.worker_index = i
        self.workers = [_Worker(d, f"rpcompile-{d.device}-{i}") for i, d in enumerate(self.devices)]
        # Worker threads end when the compiled model (and with it this executor) goes away.
        weakref.finalize(self, _stop, list(self.workers), list(self.devices))
        self.offset = 0
        self.last_schedule: Optional[Schedule] = None   # the schedule of the last run
        self.in_flight = 0                               # runs issued and not yet waited for
        self.slot_sets = SlotSets()                      # Note [slot sets] (runtime/shared.py)

    def next_device(self) -> DeviceRuntime:
        """The device the next run's first job goes to."""
        return self.workers[self.offset % len(self.workers)].dev

    def run(self, step: StepState, schedule: Schedule, programs_for) -> None:
        """Run a schedule (runtime/schedule.py): each action on its worker; raise the first
        failure here, a StageError with the schedule's line, the failing job marked."""
        self.issue(step, schedule, programs_for).wait()

    def issue(self, step: StepState, schedule: Schedule, programs_for) -> "ThreadRun":
        """Hand a schedule's actions to the workers and return at once: the ThreadRun waits for
        them. A worker runs what it is handed in order, so the runs issued one after another
        (Note [overlapped steps], runtime/modes.py) share each device in the order given."""
        if schedule.num_devices != len(self.workers):
            raise ValueError(f"a schedule for {schedule.num_devices} devices given to an executor of "
                             f"{len(self.workers)}")
        actions = schedule.actions
        step.done_events.update({a.job: [threading.Event() for _ in step.micro] for a in actions})
        if schedule.replicas > 1:   # Note [replicas] (runtime/replicas.py)
            step.exchanges.update({job: GradExchange(schedule.replicas) for job in schedule.stages})
        if not self.in_flight:   # weights prefetched for jobs of runs that failed
            for w in self.workers:
                w.dev.prefetched.clear()
        for dev, future in step.first_upload:   # started before the step, for a device's first job
            first = next(a for a in actions if self.workers[a.device].dev is dev)
            dev.prefetched[(id(step), first.job)] = future
        # Every program exists before any job is handed out: a failure here must not leave
        # workers waiting on jobs that were never queued.
        programs = [programs_for(schedule.stage(a.job), a.role, self.workers[a.device].dev.device) for a in actions]
        self.last_schedule = schedule
        slots = getattr(step, "slot_set", None)
        if slots is None:
            slots = step.slot_set = self.slot_sets.take()
            weakref.finalize(step, _give_back, self.slot_sets, slots, list(self.devices)).atexit = False
        finished = {}
        for a, program in zip(actions, programs):
            worker = self.workers[a.device]
            links = JobLinks.of(a, schedule.stage,
                                None if a.next_device is None else self.workers[a.next_device].dev)
            ev = threading.Event()
            worker.jobs.put((lambda a=a, stage=schedule.stage(a.job), w=worker, p=program, links=links:
                             _run_with_slots(step, a, stage, w.dev, p, links, slots), ev))
            finished.setdefault(a.job, []).append(ev)     # (a job's copies: Note [replicas])
        self.offset = schedule.next_offset
        self.in_flight += 1
        return ThreadRun(self, step, schedule, finished)

    @property
    def placements(self) -> list:
        """(job index, stage index, role, device index) of every job of the last run."""
        s = self.last_schedule
        return [] if s is None else [(a.job, a.stage, a.role, a.device) for a in s.actions]


class ThreadRun:
    """A run handed to the worker threads: wait for some of its jobs, or all."""

    def __init__(self, executor, step, schedule, finished: dict):
        self.executor, self.step, self.schedule, self.finished = executor, step, schedule, finished
        self.ended = False
        self.landed = _landing(finished, weakref.ref(step), step.param_grads)

    def wait(self, jobs=None) -> None:
        """Block until `jobs` (default: all) have ended; on a failure, until every job has
        ended, then raise it (a StageError with the schedule's line, the failing job marked)."""
        for j in (self.finished if jobs is None else jobs):
            for ev in self.finished[j]:
                ev.wait()
        step = self.step
        if self.ended or (jobs is not None and step.error is None):
            return
        for events in self.finished.values():
            for ev in events:
                ev.wait()
        self.ended = True
        self.executor.in_flight -= 1
        err = step.error
        if isinstance(err, StageError) and err.schedule is None:
            err = err.with_schedule(self.schedule.render(failed=err.job, device=err.worker))
        if err is not None:
            raise err


def _landing(finished: dict, step_ref, param_grads: dict):
    """landed(job): block until `job` has ended and its gradients are on the host (any thread
    may ask; it holds no step: an optimizer submission waiting with it keeps none alive);
    StepAbandoned if a job of the step failed (ThreadRun.wait raises that failure)."""
    def landed(job: int) -> None:
        for ev in finished[job]:
            ev.wait()
        step = step_ref()
        if step is not None and step.error is not None:
            raise StepAbandoned(f"job {job}'s step failed")
        grads = param_grads.get(job)
        if grads:
            resolve(list(grads.values())[-1:])    # one copy brought them all (Note [few calls per step])
    return landed
