"""What a device's compute waits for its weights, beyond what the stage plan's job times count.

Note [uploads behind the job before]: the solver prices a job as the longer of its compute and
its own upload (passes/partition.py), as if its weights went up while it ran. They go up before:
a job's weights are prefetched while the job before it on its device runs, up to that job's
allowance (Note [resident weights]), and the job starts once they are up. Where a short job
comes before a long one, the long one waits: Llama-3.1-8B on 2 H200s at 32,768 tokens split into
8 microbatches (jobs a copy: embedding-5 forward 0.08 s, 6-31 fused with 12 GiB of weights,
0-5 backward) ran 1.86 s steps against 1.71 s at 2 microbatches, the fused job's weights going up
behind the 0.08 s job (exposed uploads 0.36 -> 0.49 s a GPU), which the estimates (1.389 against
1.520 s) did not see. So `upload_wait` replays one device's weights stream against its compute
over a few steps: a job starts when the job before it has ended and its prefetched weights are
up; the rest of its weights go up as it reads them (its end no earlier than theirs); the next
step's first job goes up as the loss is known where the plan uploads it early (Plan.
early_first_upload; a plan of one job: during its step, Note [next weights during the step] in
runtime/modes.py), else as the step ends. What a steady step takes beyond the jobs' priced times
is the wait, which the planner adds to a plan's step where it weighs microbatch counts (Note
[finer microbatches]). One stream and one device: the copies of replicas each upload their own
weights alike; a pipeline's jobs hand over between devices, which this does not replay (0).
"""
from __future__ import annotations

from .resident import job_weights

STEPS = 3     # replayed; the last is steady (the first job's upload then follows the one before)


def upload_wait(compute, weights, allowance, upload_bw: float, early: bool, num_fwd: int) -> float:
    """Seconds a steady step of one device's jobs (execution order: `compute` seconds and
    `weights` bytes each; `allowance`, each job's prefetch of the next job's weights, () for no
    limit) takes beyond the sum of the jobs' priced times, max(compute, weights / upload_bw)."""
    J = len(compute)
    if not J or not upload_bw > 0 or upload_bw == float("inf"):
        return 0.0
    up = [w / upload_bw for w in weights]
    free = 0.0                        # when the weights stream is free

    def upload(at: float, seconds: float) -> float:
        nonlocal free
        free = max(free, at) + seconds
        return free

    pre = [up[0]] + [up[k] if not allowance else min(weights[k], allowance[k - 1]) / upload_bw
                     for k in range(1, J)]    # what goes up while the job before runs
    ends, end = [], 0.0
    ready = upload(0.0, up[0])        # the first step's first job: its weights from the start
    for _ in range(STEPS):
        next_first = None
        for k in range(J):
            start = max(end, ready)
            rest = up[k] - pre[k]     # read as the job runs: it ends no earlier than they are up
            floor = upload(start, rest) if rest > 0 else 0.0
            if early and J == 1:
                next_first = upload(start, up[0])
            if k + 1 < J:
                ready = upload(start, pre[k + 1]) if pre[k + 1] > 0 else start
            end = max(start + compute[k], floor)
            if early and J > 1 and k == num_fwd:
                next_first = upload(end, up[0])
        ready = next_first if next_first is not None else upload(end, up[0])
        ends.append(end)
    priced = sum(max(c, u) for c, u in zip(compute, up))
    return max(0.0, ends[-1] - ends[-2] - priced)


def plan_upload_wait(st) -> float:
    """upload_wait of a solved CompileState: its one device or each of its copies (0 for a
    pipeline over several devices)."""
    if st.replicas == 1 and len(st.config.devices) > 1:
        return 0.0
    sp, segs = st.stage_plan, st.segments
    M = -(-st.num_microbatches // st.replicas)
    compute = [M * sum(s.fwd_s if kind == "fwd" else s.bwd_s for s in segs[i:j]) for kind, (i, j) in sp.jobs()]
    return upload_wait(compute, job_weights(segs, sp), st.prefetch_bytes, st.hardware.upload_bw, st.early_first_upload,
                       len(sp.fwd_bounds))
