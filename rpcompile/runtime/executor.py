"""The dispatcher: one worker thread per device runs the stage jobs handed to it, in order.

Stage job k of a step runs on device (offset + k) mod N; the offset carries on across steps,
so the device that ran the last job of a step is not the one that starts the next.
"""
from __future__ import annotations

import queue
import threading
import weakref

from .device import DeviceRuntime
from .job import JobLinks, StepState, run_job


class _Worker:
    def __init__(self, dev: DeviceRuntime, name: str):
        self.dev = dev
        self.jobs: queue.Queue = queue.Queue()
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
        self.placements: list = []   # (job index, stage index, role, device index) of the last run

    def next_device(self) -> DeviceRuntime:
        """The device the next run's first job goes to."""
        return self.workers[self.offset % len(self.workers)].dev

    def run(self, step: StepState, jobs: list, programs_for) -> None:
        """Run [(job index, stage, role), ...] as a chain; raise the first failure here."""
        n = len(self.workers)
        step.done_events.update({j: [threading.Event() for _ in step.micro] for j, _, _ in jobs})
        for w in self.workers:
            w.dev.prefetched.clear()
        if step.first_upload is not None:   # started before the step, for its first job
            dev, future = step.first_upload
            dev.prefetched[(id(step), jobs[0][0])] = future
        # Every program exists before any job is handed out: a failure here must not leave
        # workers waiting on jobs that were never queued.
        devices = [(self.offset + k) % n for k in range(len(jobs))]
        programs = [programs_for(stage, role, self.workers[d].dev.device) for (_, stage, role), d in zip(jobs, devices)]
        finished = []
        self.placements = []
        prev = None
        reads = [frozenset(stage.inputs) for _, stage, _ in jobs]
        for k, (j, stage, role) in enumerate(jobs):
            d = devices[k]
            worker = self.workers[d]
            program = programs[k]
            links = JobLinks(next_on_device=(jobs[k + n][0], jobs[k + n][1]) if k + n < len(jobs) else None,
                             next_dev=self.workers[devices[k + 1]].dev if k + 1 < len(jobs) else None,
                             next_reads=reads[k + 1] if k + 1 < len(jobs) else frozenset(),
                             later_reads=frozenset().union(*reads[k + 2:]))
            ev = threading.Event()
            worker.jobs.put((lambda j=j, prev=prev, stage=stage, role=role, w=worker, p=program, links=links:
                             run_job(step, j, prev, stage, role, w.dev, p, links), ev))
            finished.append(ev)
            self.placements.append((j, stage.index, role, d))
            prev = j
        self.offset = (self.offset + len(jobs)) % n
        for ev in finished:
            ev.wait()
        if step.error is not None:
            raise step.error
