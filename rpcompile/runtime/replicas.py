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

There each copy of a job holds its gradients in an fp32 accumulator on its device (in the host
set's dtype where each copy runs one microbatch: Note [one microbatch a copy], grads.py). The
copies wait for one another (`GradExchange.share`); then copy r sums slice r of every copy's
accumulator on its own device (reading the others device to device, each read holding the
source until it completed: DeviceRuntime.hold) and downloads that slice into slice r of the
job's host piece, so the host receives one gradient set, as from the pipeline, with each
device bringing down 1/N of it. On CPU devices the adds read the other threads' accumulators
directly (copy 0's is the host piece itself). The last copy to issue its download records an
event after all of them: the job's gradients are complete when it has.

A copy that failed sets the step's error, which ends the others' wait (they stop as jobs do
when another job failed); a copy with no microbatch (fewer microbatches than devices)
takes part with no accumulator.

Note [replicas in worker processes]: with one worker process per device (Config(workers=
"processes")) the copies cannot read one another's accumulators; the workers form a process
group (torch.distributed: NCCL on GPUs, gloo on CPU devices; made as the first replicated job
starts, where every worker gets to at the same point) and the copies' collectives leave
slice r of the sum on copy r's device, over the GPUs' own links (a part at a time: Note [copies'
sums a part at a time]). A collective waits for
every member, so a copy that failed before it would leave the others waiting for ever: each
copy first does what can fail (the group made, its buffers allocated), then tells the others
its gradient keys (a "replica" message between workers) and joins the collective once every
copy has said so. It stops instead when a copy that has not said so failed (the "fail"
message names the worker): that copy never will. A copy that failed after saying so (in a
later job) is no reason to stop, since every other copy may have joined the collective
already. The accumulators are padded to a multiple of the copies (the
collective's slices are equal) and never the host piece (each copy writes only its slice of
it). The workers run their jobs in the chain's order and the runs in the order sent, so every
member calls the collectives in the same order.

Note [narrow slices summed by their copy]: bf16 accumulators (Note [one microbatch a copy],
grads.py) summed by a bf16 reduce-scatter are rounded at every partial sum of the ring: with
four copies on CPU devices (gloo) every parameter differed from fp32 accumulators after three
AdamW steps (up to 1e-3), where worker threads, which sum a narrow slice in fp32
(`GradExchange.reduce`), were equal bit for bit. So there the collective only moves the values:
an all-to-all gives copy r every copy's slice r (the same bytes over the links as the
reduce-scatter, which moves (n-1)/n of the piece from each copy as well), and copy r sums them
in fp32, each part rounded once. Measured on 2 H200s (where the one sum was exact before too):
equal bit for bit to fp32 accumulators (tiny Qwen3, NCCL); Qwen3-1.7B at 32,768 tokens and M=2,
one run each side, 86,842 -> 87,393 tokens/s, the copies' sum 6.5 and 16.4 -> 10.8 and 12.5 ms,
their downloads 41 and 50 -> 45 and 46 ms.

Note [copies' sums a part at a time]: where each copy runs several microbatches its accumulator
is fp32 (4 B an element), and the reduce-scatter moved 3/4 of it from each of 4 copies (a fused
job a copy of Llama-3.1-8B: 24 GB a GPU a step, priced 0.16 s) into an output of a quarter of it
that the plan did not count (8 GB), although the gradients come down in the host set's dtype
(bf16, Note [working-dtype gradients] in grads.py). So a copy in a worker process sends the host
set's dtype where it is narrower than its accumulator's, as copies of one microbatch do: each
copy's partial sum is rounded once on its way (as each microbatch's bf16 gradient was, in a
copy of one), the parts are summed in fp32 and rounded again on the way down. And it sends a
part at a time: SUM_SLICE elements of every copy's slice are staged in one buffer (cast there),
the all-to-all (or, in fp32, the reduce-scatter) gives copy r every copy's part of slice r, and
their fp32 sum goes into copy r's own slice of its accumulator, read already (the sum comes down
from there). The device then holds the accumulator the plan counts and three parts (a 4-copy
part: 128 + 128 + 64 MiB), all made before the copy says it is ready. Worker threads read one
another's accumulators directly (GradExchange.reduce) and keep the fp32 sum.

Note [copies' sum beside the next step]: the sum ran in the compute stream, after the job's last
backward (0.035-0.05 s a step with 2 copies of Llama-3.1-8B, fp32; 0.085 s a 4-GPU step of
bf16 sums after two jobs), while the next step's forward, which reads none of it, waited. So the
sum runs in the device's `sums` stream, after the copy's accumulations. Where a copy runs one
job (one fused job, the whole model: Llama-3.1-8B at 4 GPUs and M=16, Qwen3-1.7B at 2 and 4
GPUs) the next thing its device runs is that job's next step, whose forward needs neither the
accumulator nor the sum: the accumulator stays (the worker's `KeptSum`, so its memory is what
the plan counts for the job: it is no larger while the sum runs on), and the next step's first
accumulation waits in the compute stream for the event after the last sum and its download
(`KeptSum.free`), not the forward before it. A worker keeps one, for one plan's job: another
job starting there (another length's plan) gives it back first, the compute stream waiting for
what is in flight on it. Where a copy runs several jobs the next job allocates its own
accumulator beside this one, which the plan does not count: there the compute stream waits for
the sum, as before.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch

from .device import Pending
from .grads import accumulator_dtype


class GradExchange:
    """Where the copies of one job of one step meet to sum their gradients."""

    stream_name = "compute"     # the device stream the sum runs in
    kept = None                 # worker threads keep no accumulator (Note [copies' sum beside the next step])

    def __init__(self, replicas: int):
        self.n = replicas
        self.accs: list = [None] * replicas       # each copy's accumulator (None: no gradients)
        self.ready: list = [None] * replicas      # GPU: event after the copy's last accumulation
        self.devs: list = [None] * replicas       # each copy's DeviceRuntime
        self.got: set = set()                     # gradient keys any copy made
        self.arrived = 0
        self.downloads: list = []                 # what the copies' downloads returned
        self._cond = threading.Condition()

    def share(self, r: int, acc, got, dev, step, numel: int) -> set:
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

    def received_bytes(self, r: int, numel: int) -> int:
        """What copy r reads of the other copies' accumulators for its slice (the trace's figure)."""
        lo, hi = self.bounds(r, numel)
        return sum((hi - lo) * acc.element_size() for q, acc in enumerate(self.accs) if q != r and acc is not None)

    @staticmethod
    def accumulator(r: int, dev, piece, wait_piece_free, dtype=torch.float32):
        """Copy r's accumulator for the host piece: copy 0's on a CPU device is the piece itself
        where it has that dtype (the others add into it), once the optimizer is done with it."""
        if r == 0 and dev.is_cpu:
            wait_piece_free()
        return dev.grad_accumulator(piece, own=r > 0, dtype=dtype)

    def reduce(self, r: int, dev, numel: int) -> torch.Tensor:
        """Slice r summed over the copies, on copy r's device (in its own accumulator where it
        is fp32)."""
        lo, hi = self.bounds(r, numel)
        own = self.accs[r]
        if own is None:
            total = torch.zeros(hi - lo, dtype=torch.float32, device=dev.device)
        else:     # (a narrow accumulator's slice is summed in fp32 and rounded once, on its way down)
            total = own[lo:hi] if own.dtype == torch.float32 else own[lo:hi].float()
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


class KeptSum:
    """A worker's accumulator kept from one run of a copy's job to the next (Note [copies' sum
    beside the next step]): `padded`, the job it is for (`key`: plan and job), and `free`, the
    event after which the last run's sum and download are done with it (None: nothing in flight)."""

    __slots__ = ("padded", "key", "free")

    def __init__(self):
        self.padded, self.key, self.free = None, None, None

    def release(self, dev) -> None:
        """Give the accumulator back, once the compute stream (in whose order its memory goes back)
        has waited for what is in flight on it; the caller's thread issues the jobs."""
        if self.free is not None:
            dev.compute.wait_event(self.free)
        self.padded, self.key, self.free = None, None, None


class PeerExchange:
    """Where the copy of a job in this worker process meets the copies in the others (Note
    [replicas in worker processes]): one per run and job in each worker."""

    SUM_SLICE = 1 << 24     # elements of each copy's slice sent at once (Note [copies' sums a part at a time])
    stream_name = "sums"    # the device stream the sum runs in

    def __init__(self, replicas: int, announce: Callable, group: Callable):
        self.n = replicas
        self._announce = announce          # announce(keys): tell the other copies this one is here
        self._group = group                # group(): the workers' process group (made once)
        self.kept: Optional[KeptSum] = None     # set where the copy runs one job (Note [copies' sum beside ...])
        self.kept_key = None                    # what the kept accumulator is for: (plan, job)
        self._kept_used = False                 # this run summed in the kept accumulator
        self.got: set = set()
        self.arrived: set = set()
        self.padded: Optional[torch.Tensor] = None      # this copy's accumulator, padded
        self.send: Optional[torch.Tensor] = None        # a part of every copy's slice, in the sum's dtype
        self.out: Optional[torch.Tensor] = None         # what the collective writes here
        self.wide: Optional[torch.Tensor] = None        # a narrow sum's fp32 part (Note [narrow slices ...])
        self._cond = threading.Condition()

    def arrive(self, r: int, keys) -> None:
        """Copy r is ready to sum (its gradient keys); from its message or this copy."""
        with self._cond:
            self.got.update(keys)
            self.arrived.add(r)
            self._cond.notify_all()

    def share(self, r: int, acc, got, dev, step, numel: int) -> Optional[set]:
        """As GradExchange.share: every copy's keys once all are ready (None: a copy that was
        not ready failed, or this worker did)."""
        self._group()
        c = self._chunk(numel)
        if self.padded is None:     # (a copy with no microbatch takes part with zeros, of the others' dtype)
            self.padded = torch.zeros(self.n * c, dtype=accumulator_dtype(step, self.n), device=dev.device)
        # the parts go in the host set's dtype where it is narrower (Note [copies' sums a part at a time])
        sent = step.grads.dtype if step.grads.dtype.itemsize < self.padded.dtype.itemsize else self.padded.dtype
        part = min(c, self.SUM_SLICE)
        with self._on_sums(dev):
            self.send = torch.empty(self.n * part, dtype=sent, device=dev.device)
            if sent == torch.float32:
                self.out, self.wide = None, None
            else:
                self.out = torch.empty(self.n * part, dtype=sent, device=dev.device)
                self.wide = torch.empty(part, dtype=torch.float32, device=dev.device)
        if not dev.is_cpu:          # the sum follows this copy's accumulations
            dev.sums.wait_stream(dev.compute)
        self._announce(list(got))
        self.arrive(r, got)
        with self._cond:
            while len(self.arrived) < self.n:
                if any(q not in self.arrived for q in step.failed_copies) or (
                        step.error is not None and not step.error_is_remote()):
                    return None
                self._cond.wait(0.05)
            return set(self.got)

    @staticmethod
    def _on_sums(dev):
        return contextlib.nullcontext() if dev.is_cpu else torch.cuda.stream(dev.sums)

    def _chunk(self, numel: int) -> int:
        return -(-numel // self.n)

    def bounds(self, r: int, numel: int) -> tuple:
        """Slice r of a piece of `numel` elements: equal slices, the last one cut short."""
        c = self._chunk(numel)
        return min(numel, r * c), min(numel, (r + 1) * c)

    def received_bytes(self, r: int, numel: int) -> int:
        """What copy r receives of the other copies for its slice, in the dtype sent (the trace's
        figure; the padding counts, as it goes too)."""
        return self._chunk(numel) * (self.n - 1) * self.send.element_size()

    def accumulator(self, r: int, dev, piece, wait_piece_free, dtype=torch.float32):
        """This copy's accumulator for the host piece, padded for the collective (the padding
        is summed too and never read); the kept one where it fits, once the last run is done with
        it (Note [copies' sum beside the next step])."""
        numel, k = self.n * self._chunk(piece.numel()), self.kept
        if k is not None and k.padded is not None:
            if k.key == self.kept_key and k.padded.numel() == numel and k.padded.dtype == dtype:
                if k.free is not None:
                    dev.compute.wait_event(k.free)
                self.padded = k.padded
                return self.padded[:piece.numel()]
            k.release(dev)
        self.padded = torch.empty(numel, dtype=dtype, device=dev.device)
        if k is not None:
            k.padded, k.key, k.free = self.padded, self.kept_key, None
        return self.padded[:piece.numel()]

    def reduce(self, r: int, dev, numel: int) -> torch.Tensor:
        """Slice r summed over the copies, on this copy's device, in its own accumulator's slice r
        (Note [copies' sums a part at a time]): in the device's sums stream, which the compute
        stream then waits for unless the accumulator is kept (Note [copies' sum beside the next
        step])."""
        import torch.distributed as dist
        full, send, out, wide = self.padded, self.send, self.out, self.wide     # (made by share)
        rows, group = full.view(self.n, -1), self._group()
        total, width = rows[r], send.numel() // self.n
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with self._on_sums(dev):
            for a in range(0, rows.shape[1], width):
                b = min(rows.shape[1], a + width)
                part = send[:self.n * (b - a)]
                part.view(self.n, -1).copy_(rows[:, a:b])
                if wide is None:     # (fp32: the collective sums)
                    scatter(total[a:b], part, group=group)
                    continue
                got = out[:part.numel()]
                dist.all_to_all_single(got, part, group=group)
                torch.sum(got.view(self.n, -1), 0, dtype=torch.float32, out=wide[:b - a])
                total[a:b].copy_(wide[:b - a])
        self._kept_used = self.kept is not None and full is self.kept.padded
        if not dev.is_cpu and not self._kept_used:
            dev.compute.wait_stream(dev.sums)     # (the accumulator goes back in the compute stream's order)
        self.padded = self.send = self.out = self.wide = None
        lo, hi = self.bounds(r, numel)
        return total[:hi - lo]

    def landed(self, down, dev):
        """This copy's slice is on its way: its own download's event (None on CPU devices), which
        a kept accumulator's next run waits for."""
        event = down.event if isinstance(down, Pending) else None
        if self._kept_used:
            self.kept.free = event
        return event
