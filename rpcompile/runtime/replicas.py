"""Replicas: each device runs a copy of the one-device plan over its share of the microbatches.

Note [replicas]: a pipeline of stage jobs handed round-robin recomputes more than one device
does alone. One GPU fits long fused jobs that keep their activations (Llama-3.1-8B's fused
job holds layers 11-31 and only layers 0-10 are recomputed: 969 TFLOP a microbatch), while a
plan for four GPUs cuts short jobs that each recompute (1,292 TFLOP), and its chain leaves
devices idle at its ends; measured, 4 GPUs ran 2.9-3.0x one GPU's tokens/s with both models.
So the planner also costs the one-device plan over a device's share of the microbatches
(passes.solve_stages_pass, Config.data_parallel) and takes it where it is faster: each device
then runs every job of the step over its microbatches (the schedule's actions name them,
`0FB@0[0:2] 0FB@1[2:4]`), and the devices meet only where a job's gradients come down.

There each copy of a job holds its gradients in an fp32 accumulator on its device. The copies
wait for one another (`GradExchange.share`); then copy r sums slice r of every copy's
accumulator on its own device (reading the others device to device, each read holding the
source until it completed: DeviceRuntime.hold) and downloads that slice into slice r of the
job's host piece, so the host receives one gradient set, as from the pipeline, with each
device bringing down 1/N of it. On CPU devices the adds read the other threads' accumulators
directly (copy 0's is the host piece itself). The last copy to issue its download records an
event after all of them: the job's gradients are complete when it has.

A copy that failed sets the step's error, which ends the others' wait (they stop as jobs do
when another job failed); a copy with no microbatch (fewer microbatches than devices)
takes part with no accumulator.
"""
from __future__ import annotations

import threading

import torch

from .device import Pending


class GradExchange:
    """Where the copies of one job of one step meet to sum their gradients."""

    def __init__(self, replicas: int):
        self.n = replicas
        self.accs: list = [None] * replicas       # each copy's fp32 accumulator (None: no gradients)
        self.ready: list = [None] * replicas      # GPU: event after the copy's last accumulation
        self.devs: list = [None] * replicas       # each copy's DeviceRuntime
        self.got: set = set()                     # gradient keys any copy made
        self.arrived = 0
        self.downloads: list = []                 # what the copies' downloads returned
        self._cond = threading.Condition()

    def share(self, r: int, acc, got, dev, step) -> set:
        """Copy r's accumulator and the keys it made; blocks until every copy has shared, then
        returns the keys of all copies (None if a job of the step failed meanwhile)."""
        ready = None
        if acc is not None and not dev.is_cpu:
            ready = torch.cuda.Event()
            ready.record(dev.compute)
        with self._cond:
            self.accs[r], self.ready[r], self.devs[r] = acc, ready, dev
            self.got.update(got)
            self.arrived += 1
            self._cond.notify_all()
            while self.arrived < self.n:
                if step.error is not None:
                    return None
                self._cond.wait(0.05)
            return set(self.got)

    def bounds(self, r: int, numel: int) -> tuple:
        """Slice r of a piece of `numel` elements."""
        return r * numel // self.n, (r + 1) * numel // self.n

    def reduce(self, r: int, dev, numel: int) -> torch.Tensor:
        """Slice r summed over the copies, on copy r's device (in its own accumulator)."""
        lo, hi = self.bounds(r, numel)
        own = self.accs[r]
        total = own[lo:hi] if own is not None else torch.zeros(hi - lo, dtype=torch.float32, device=dev.device)
        for q, acc in enumerate(self.accs):
            if q == r or acc is None:
                continue
            if dev.is_cpu:
                total.add_(acc[lo:hi])
                continue
            part, done = dev.peer_copy(acc[lo:hi], self.ready[q])
            self.devs[q].hold(acc, done)
            total.add_(part)
        return total

    def landed(self, down, dev):
        """Copy r issued its download (`down`, what download_into returned). The last copy gets
        an event after every copy's download (None on CPU devices, where they are done);
        the others get False."""
        with self._cond:
            self.downloads.append(down)
            if len(self.downloads) < self.n:
                return False
            downs = list(self.downloads)
        if dev.is_cpu:
            return None
        for d in downs:
            if isinstance(d, Pending):
                dev.out.wait_event(d.event)
        done = torch.cuda.Event()
        done.record(dev.out)
        return done
