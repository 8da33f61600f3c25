"""The weights of other stage jobs a device holds while a job runs.

Note [resident weights]: the solver costs a job without knowing its neighbours, so it counts the
job's weights twice (2P in passes/partition.py: the running job's and the prefetched next job's,
taken to be as large). The runtime held more than that where the neighbours were larger:
- each job prefetched all the weights of the job its device runs next (job k + N);
- in delayed mode the next step's first job's weights went up as soon as the loss was known
  (DelayedMode._upload_first_job in runtime/modes.py), onto the device that runs it, so the
  backward jobs still to run there held them too.
Llama-3.1-8B at 65,536 tokens under 24 GiB on one GPU: forward job 0 (6.7 GiB of weights) held
job 1's 7.8 GiB, and each one-layer backward job (0.4 GiB of weights, planned at 20.3 GiB) would
have held the next step's job 0 (6.7 GiB) as well. So the plan bounds both:
- a job prefetches the next job's weights only up to its allowance, the budget less what the
  job itself needs (`prefetch_allowance`, at least its own weights, which is what the solver
  counted); the rest go up when the next job reads them;
- the next step's first job goes up early only where every job it would sit beside has room
  for it (`settle`).
`resident_memory` is each job's memory with what is resident beside it: what the plan prints.
"""
from __future__ import annotations

import dataclasses


def job_weights(segments, stage_plan) -> list:
    """Bytes of the parameters each job reads (execution order), as the solver's P."""
    return [sum(s.param_bytes for s in segments[i:j]) for _, (i, j) in stage_plan.jobs()]


def prefetch_allowance(memory, weights, budget) -> tuple:
    """Bytes of the next job's weights each job may prefetch: the budget less the job's own
    memory without the solver's second P (at least P); () without a budget (no limit)."""
    return () if budget is None else tuple(max(p, budget - m + p) for m, p in zip(memory, weights))


def resident_memory(memory, weights, allowance, num_fwd: int, num_devices: int, early: bool) -> list:
    """Each job's memory (`memory`, the solver's with 2P), or more where the weights resident
    beside it are more than its second P: the prefetched part of the next job's on its device and, with
    the early upload, the next step's first job's on the device that runs it, in the jobs after
    the loss (the fused job is job num_fwd)."""
    J, N = len(weights), num_devices
    out = []
    for k, (m, p) in enumerate(zip(memory, weights)):
        beside = weights[k + N] if k + N < J else 0
        if allowance:
            beside = min(beside, allowance[k])
        # (a plan of one fused job, as each copy of replicas runs: the upload starts as it ends,
        # while its device may still compute its last microbatch)
        if early and (k > num_fwd or J == 1) and (k - J) % N == 0:
            beside += weights[0]
        out.append(max(m, m - p + beside))   # never below the solver's count, which its search and errors use
    return out


def settle(stage_plan, segments, budget, num_devices: int, may_upload_early: bool):
    """(stage plan with resident memory, prefetch allowances, whether the next step's first job
    goes up early): early where it fits the budget beside every job."""
    weights = job_weights(segments, stage_plan)
    allowance = prefetch_allowance(stage_plan.job_memory, weights, budget)
    def memory(early):
        return resident_memory(stage_plan.job_memory, weights, allowance, len(stage_plan.fwd_bounds),
                               num_devices, early)
    early = may_upload_early and (budget is None or max(memory(True)) <= budget)
    return dataclasses.replace(stage_plan, job_memory=tuple(memory(early))), allowance, early
