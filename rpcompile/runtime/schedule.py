"""The schedule of a run as data: job actions (stage, role, device), built before anything runs.

A run's jobs form a chain: job k reads what jobs before it wrote and runs on worker
(offset + k) mod N, the offset carrying on across runs. `build_schedule` places the jobs and
works out what each needs to know of its neighbours (the job it waits for, the job its device
runs next, whose weights it prefetches, the device the next job runs on, the values the next
and later jobs read, for peer transfers); the executor only hands the actions to the workers.

    str(schedule)               0F@0 1F@1 2FB@0 3B@1     (stage, role F / FB fused / B, @ worker)
    schedule.render(failed=2)   0F@0 1F@1 [2FB@0 failed] 3B@1

With replicas (Note [replicas] in runtime/replicas.py) every worker runs the whole chain over its
share of the microbatches, each action naming them: `0FB@0[0:2] 0FB@1[2:4]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ROLE_LETTERS = {"fwd": "F", "fused": "FB", "bwd": "B"}


@dataclass(frozen=True)
class JobAction:
    """One stage job of a run: which job, which stage in which role, on which worker, and its links."""

    job: int                               # job index (the key of the job's done events and gradients)
    stage: int                             # stage index
    role: str                              # "fwd", "fused" or "bwd"
    device: int                            # worker index
    prev_job: Optional[int] = None         # the job whose microbatches this one waits for
    next_on_device: Optional[int] = None   # the job this worker runs next: its weights are prefetched during this one
    next_device: Optional[int] = None      # worker of the next job in the chain
    # Names the next job reads, and names any job after the next one reads (out of the repr:
    # they list every parameter and activation a stage takes; ("grad", name) for a gradient).
    next_reads: frozenset = field(default=frozenset(), repr=False)
    later_reads: frozenset = field(default=frozenset(), repr=False)
    # Names a later run of the step reads (a differentiable call's backward, after its forward):
    # what this job hands on of them goes there through the main process (Note [values a later
    # run reads] in runtime/worker.py).
    then_reads: frozenset = field(default=frozenset(), repr=False)
    replica: int = 0                       # which copy of the chain (Note [replicas])
    microbatches: Optional[range] = None   # the microbatches it runs (None: all of the step's)

    @property
    def next_here(self) -> bool:
        """The next job in the chain runs on this worker (Note [hand-overs on the device] in runtime/job.py)."""
        return self.next_device == self.device

    def __str__(self) -> str:
        mbs = "" if self.microbatches is None else f"[{self.microbatches.start}:{self.microbatches.stop}]"
        return f"{self.stage}{ROLE_LETTERS.get(self.role, self.role)}@{self.device}{mbs}"


@dataclass(frozen=True)
class Schedule:
    """The actions of one run, in chain order, and where the rotation stood when it started."""

    actions: tuple
    num_devices: int
    offset: int                                                   # worker of the first job
    stages: dict = field(default_factory=dict, repr=False, compare=False)   # job index -> Stage
    replicas: int = 1                                             # copies of the chain (Note [replicas])

    @property
    def next_offset(self) -> int:
        """The worker the first job of the next run goes to."""
        return (self.offset + len(self.actions)) % self.num_devices

    def stage(self, job: int) -> Any:
        """The Stage object of a job."""
        return self.stages[job]

    def __str__(self) -> str:
        return self.render()

    def render(self, failed: Optional[int] = None, device: Optional[int] = None) -> str:
        """The actions on one line; the job `failed` (a job index; with replicas, its copy on
        worker `device`) marked."""
        def marked(a):
            return a.job == failed and (device is None or self.replicas == 1 or a.device == device)
        return " ".join(f"[{a} failed]" if marked(a) else str(a) for a in self.actions)


def build_schedule(jobs, num_devices: int, offset: int = 0, replicas: int = 1,
                   num_microbatches: Optional[int] = None, then=()) -> Schedule:
    """The schedule of a chain of jobs [(job index, stage, role), ...] over `num_devices`
    workers, its first job on worker `offset` (mod num_devices); with `replicas` > 1, a copy
    of the chain on each of workers 0..replicas-1, over consecutive shares of the
    `num_microbatches` (Note [replicas]). `then`: the jobs of a later run of the same step (a
    differentiable call's backward): what they read counts as read later, so it reaches the
    host. Pure: runs nothing.
    A stage needs `.index` and `.inputs` (the names it reads)."""
    if num_devices < 1:
        raise ValueError(f"a schedule needs at least one device, got {num_devices}")
    jobs = list(jobs)
    reads = [_reads(stage, role) for _, stage, role in jobs]
    after = frozenset().union(*(_reads(stage, role) for _, stage, role in then))
    if replicas > 1:
        return _replicated(jobs, reads, after, num_devices, offset, replicas, num_microbatches)
    devices = [(offset + k) % num_devices for k in range(len(jobs))]
    actions = []
    for k, (job, stage, role) in enumerate(jobs):
        same = next((i for i in range(k + 1, len(jobs)) if devices[i] == devices[k]), None)
        actions.append(JobAction(
            job=job, stage=stage.index, role=role, device=devices[k],
            prev_job=jobs[k - 1][0] if k > 0 else None,
            next_on_device=jobs[same][0] if same is not None else None,
            next_device=devices[k + 1] if k + 1 < len(jobs) else None,
            next_reads=reads[k + 1] if k + 1 < len(jobs) else frozenset(),
            later_reads=frozenset().union(*reads[k + 2:], after), then_reads=after))
    return Schedule(tuple(actions), num_devices, offset % num_devices, {job: stage for job, stage, _ in jobs})


def _reads(stage, role: str) -> frozenset:
    """What a job reads of the jobs before it: the names of its activations, and ("grad", name)
    for the gradients of its outputs a backward reads."""
    grads = () if role == "fwd" else getattr(stage, "grad_outputs", ())
    return frozenset(stage.inputs) | {("grad", name) for name in grads}


def microbatch_shares(num_microbatches: int, replicas: int) -> list:
    """Consecutive ranges of the microbatches, one per replica, as even as they go (the first
    ones one longer); a replica may get none where there are fewer microbatches than replicas."""
    base, extra = divmod(num_microbatches, replicas)
    out, start = [], 0
    for r in range(replicas):
        stop = start + base + (r < extra)
        out.append(range(start, stop))
        start = stop
    return out


def _replicated(jobs, reads, after, num_devices: int, offset: int, replicas: int,
                num_microbatches: Optional[int]) -> Schedule:
    """Every worker runs the chain over its share of the microbatches; a job's copies are
    listed together, in worker order (Note [replicas]). `reads`: what each job reads; `after`:
    what a later run reads."""
    if replicas > num_devices:
        raise ValueError(f"{replicas} replicas need as many devices, got {num_devices}")
    if num_microbatches is None:
        raise ValueError("a schedule of replicas needs the number of microbatches")
    shares = microbatch_shares(num_microbatches, replicas)
    actions = []
    for k, (job, stage, role) in enumerate(jobs):
        for r in range(replicas):
            actions.append(JobAction(
                job=job, stage=stage.index, role=role, device=r,
                prev_job=jobs[k - 1][0] if k > 0 else None,
                next_on_device=jobs[k + 1][0] if k + 1 < len(jobs) else None,
                next_device=r if k + 1 < len(jobs) else None,
                next_reads=reads[k + 1] if k + 1 < len(jobs) else frozenset(),
                later_reads=frozenset().union(*reads[k + 2:], after), then_reads=after,
                replica=r, microbatches=shares[r]))
    return Schedule(tuple(actions), num_devices, offset % num_devices, {job: stage for job, stage, _ in jobs},
                    replicas)
