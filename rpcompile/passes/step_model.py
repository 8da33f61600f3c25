"""How long a step of overlapping steps takes: the delayed runtime's schedule, replayed on job times.

Note [overlapped step model]: in delayed mode the steps overlap (Note [overlapped steps] in
runtime/modes.py), and the chain formula of passes/partition.py (the slowest job times
max(ceil(J/N), 1 + (J-1)/M)) no longer says what a plan costs. What sets the pace is:
- each device runs the jobs handed to it in the order they were issued, one job at a time, its
  microbatches one after another; job k of a step goes to device (offset + k) mod N, and the
  offset carries over (it moves by J a step), so with J a multiple of N a device runs the same
  jobs every step and its load is the sum of their times, while otherwise the jobs rotate over
  the devices and the loads even out over N / gcd(J, N) steps;
- microbatch m of job k waits for microbatch m of job k - 1 of its step;
- step t + 1 is issued once step t's loss is known (its fused job has ended) and step t - 1's
  jobs have all ended (at most one step runs behind the caller).
`overlapped_step_time` replays exactly that on the planned job times (no transfers, no host
work: those are in the job times) and returns the steady seconds per step, which the solver
minimises where steps overlap. The replay runs until the state the later steps depend on (each
device's backlog and the last step's end, relative to the next issue) recurs after whole
rotation cycles (up to 4): from there the steps repeat, and their mean is exact. A fixed window
was not: where one device's load is a little above the others' a backlog builds up slowly
(Qwen3-1.7B at 4 GPUs, 4 jobs of 387/436/570/568 ms: a window of 2 steps after 4 said 534 ms,
less than the 570 ms device 2 runs every step; measured, 739 ms). A state that does not recur
within 4 windows (whole cycles, at least 8 steps) falls back to the mean of the last window, and
the result is never below the busiest device's load per step, a bound no schedule beats. Against
a replay of 600 rotation cycles, 400 random tables agree within 4e-6 (the fixed window: 2e-4),
and the solver's search on Qwen3-1.7B's 458 segments takes 1.2 s (2 devices) and 1.5 s (4) on a
2-core sandbox, against 2.0 and 7.6 s with the fixed window (the same plans).

Measured against the model (job times from the plans' estimates, steady step from the runs;
benchmarks/runs, H200): Llama-3.1-8B, 2 GPUs, 4 jobs 1.05/1.61/1.61/1.56 s: model 3.17 s, run
3.40; Qwen3-1.7B, 2 GPUs, the same shape of plan: 1.01 against 0.94; Qwen3-1.7B, 4 GPUs, 9
jobs: 0.57 against 0.59; Llama-3.1-8B, 4 GPUs, 16 jobs: 1.79 against 1.95 (the chain formula
said 3.22, 1.01, 0.78 and 2.13). The first two plans put the two long jobs on one device
(1.61 + 1.56 s against 1.05 + 1.61 s): the chain formula cannot see that, the model does.
"""
from __future__ import annotations

import math
from typing import Sequence


def load_bound(times: Sequence[float], num_devices: int) -> float:
    """Seconds per step of the busiest device when the jobs `times` of every step go round-robin
    over the devices: a lower bound of overlapped_step_time."""
    J, N = len(times), num_devices
    cycle = N // math.gcd(J, N)          # steps until every device has run every job once
    load = [0.0] * N                     # each device's seconds over one cycle
    for s in range(cycle):
        for k, t in enumerate(times):
            load[(s * J + k) % N] += t
    return max(load) / cycle


def overlapped_step_time(times: Sequence[float], fused: int, num_devices: int,
                         num_microbatches: int) -> float:
    """Steady seconds per step of overlapping steps of jobs `times` (execution order; `fused`:
    the index of the job whose end makes the loss known), Note [overlapped step model]."""
    J, N, M = len(times), num_devices, num_microbatches
    cycle = N // math.gcd(J, N)          # steps until every device has run every job once
    bound = load_bound(times, N)
    measured = cycle * max(2, -(-8 // cycle))    # whole cycles: the loads even out over one
    tol = 1e-9 * max(times)
    mbs = [t / M for t in times]
    free = [0.0] * N                     # when each device has run the jobs issued to it so far
    issued = [0.0]                       # when each step was issued
    ends_before = 0.0                    # when step s - 1 ended (step s + 1 is issued no earlier)
    states: list = []
    offset = 0
    for s in range(4 * measured + 2):
        start = issued[-1]
        loss = end = start
        d = offset
        now = max(free[d], start)
        prev = [now + mbs[0] * (m + 1) for m in range(M)]    # microbatch ends of the job before
        free[d] = end = prev[-1]
        if fused == 0:
            loss = end
        for k in range(1, J):
            d = (offset + k) % N
            now, mb, ends = free[d], mbs[k], []
            if now < start:
                now = start
            for p in prev:
                now = (now if now > p else p) + mb
                ends.append(now)
            free[d], prev = now, ends
            if now > end:
                end = now
            if k == fused:
                loss = now
        offset = (offset + J) % N
        issued.append(max(loss, ends_before))
        ends_before, nxt = end, issued[-1]
        # what the steps after depend on, relative to the next issue (earlier is as good as now)
        state = [max(f - nxt, 0.0) for f in free] + [max(end - nxt, 0.0)]
        states.append(state)
        for span in range(cycle, min(s, 4 * cycle) + 1, cycle):
            if all(abs(x - y) <= tol for x, y in zip(state, states[s - span])):
                # the same state `span` steps later: from here on those steps repeat
                return max((nxt - issued[s + 1 - span]) / span, bound)
    return max((issued[-1] - issued[-1 - measured]) / measured, bound)
