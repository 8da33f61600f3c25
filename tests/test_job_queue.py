"""A device's job queue and the prefetch of the next run's weights (Note [prefetch across
steps] in runtime/job.py): unit tests of JobQueue, and a delayed-mode run in which every
device's first job of a step gets its weights sent up while the step before still runs there."""
import threading

import torch

import rpcompile
from rpcompile.runtime.job_queue import JobQueue

from models import lm_batch, qwen3
from parity import close
from test_delayed import _eager_delayed


def _queue():
    started = []
    q = JobQueue(lambda item: None if item == "no weights" else (lambda: started.append(item)))
    return q, started


def test_the_running_job_prefetches_the_job_queued_after_it():
    q, started = _queue()
    q.put("a")
    q.put("b")
    q.prefetch_next()
    assert started == ["a"]          # the head of the queue: the job this device runs next
    assert q.get() == "a"


def test_a_job_queued_after_the_ask_is_prefetched_when_it_comes():
    q, started = _queue()
    q.prefetch_next()                # nothing queued yet: the ask waits for the next put
    assert started == []
    q.put("c")
    assert started == ["c"]
    q.put("d")                       # only the job right after the running one
    assert started == ["c"]


def test_nothing_is_prefetched_once_the_asking_job_ended_or_for_a_stop():
    q, started = _queue()
    q.prefetch_next()
    q.job_ended()                    # the device is idle: the next job uploads its own weights
    q.put("e")
    assert started == []
    q.get()
    q.prefetch_next()
    q.put(None)                      # the worker's stop
    q.put("no weights")
    assert started == []


def test_each_devices_first_job_of_a_step_is_prefetched_during_the_step_before(monkeypatch):
    """Delayed mode, 2 CPU devices: a device's last job of step t holds its end until step t + 1
    is issued (so the order is certain on a busy machine); every first job of step t + 1 on a
    device has its weights asked for from the queue, before it starts; results stay eager's."""
    from rpcompile.runtime import job_queue
    from rpcompile.runtime.device import DeviceRuntime
    from rpcompile.runtime.executor import Executor
    from rpcompile.runtime.job import JobContext

    local = threading.local()
    log, issued, steps = [], [], {}
    real_start, real_issue, real_init, real_finish = (JobQueue._start, Executor.issue, JobContext.__init__,
                                                      JobContext.finish)

    def start(self, item):
        local.queued = True
        try:
            real_start(self, item)
        finally:
            local.queued = False

    def prefetch(self, key, params, dtype, host_weights, ready=None, tracer=None, attrs=None, before=None):
        if getattr(local, "queued", False) and key not in self.prefetched:
            log.append(("asked", key))

    def issue(self, step, schedule, programs_for):
        steps[id(step)] = len(steps)
        run = real_issue(self, step, schedule, programs_for)
        issued.append(threading.Event())
        issued[-1].set()
        return run

    def init(self, step, job_index, *args, **kwargs):
        log.append(("started", (id(step), job_index)))
        real_init(self, step, job_index, *args, **kwargs)

    def finish(self):
        t = steps[id(self.step)]
        if self.links.next_on_device is None and t + 1 < 3:
            for _ in range(1000):            # wait for step t + 1's issue (at most 10 s)
                if len(issued) > t + 1:
                    break
                threading.Event().wait(0.01)
        real_finish(self)

    monkeypatch.setattr(job_queue.JobQueue, "_start", start)
    monkeypatch.setattr(DeviceRuntime, "prefetch", prefetch)
    monkeypatch.setattr(Executor, "issue", issue)
    monkeypatch.setattr(JobContext, "__init__", init)
    monkeypatch.setattr(JobContext, "finish", finish)
    model = qwen3(tied=False, layers=3)
    ref = __import__("copy").deepcopy(model)
    batches = [lm_batch(seed=s) for s in range(3)]
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode="delayed"))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = [cm.train_step(**b) for b in batches]
    cm.synchronize()
    J = len(cm.plan.stages)
    assert J > 2, "pick a plan with more jobs than devices"
    by_step = {t: s for s, t in steps.items()}
    for t in (1, 2):
        placements = [(k, (t * J + k) % 2) for k in range(J)]    # job k of step t on device (tJ + k) mod 2
        firsts = {dev: k for k, dev in reversed(placements)}
        for dev, k in firsts.items():
            key = (by_step[t], k)
            assert ("asked", key) in log, f"step {t}'s job {k}, first on device {dev}, was not prefetched from the queue"
            assert log.index(("asked", key)) < log.index(("started", key)), f"step {t}'s job {k} started first"
    ref_losses, _ = _eager_delayed(ref, batches, 1e-3)
    for t, (a, b) in enumerate(zip(losses, ref_losses)):
        close(a, b, 1e-5, 1e-6, f"loss at step {t}")
