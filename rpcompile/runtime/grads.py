"""Host gradient buffers: each backward job's parameter gradients in one flat fp32 piece.

Note [host gradient buffers]: a job accumulates its parameter gradients over the
microbatches in one flat fp32 tensor on its device (views of it per parameter, laid out by
the plan's GradLayout, passes/host_memory.py) and brings it down with one copy into its piece
of a flat host buffer, allocated once and reused every step; the host gradients are views of
it. Which set a step writes:

- exact mode: set 0; before train_step returns, the step's gradients become `param.grad`
  (views of the set, lent until the next step: Note [lent gradients] in runtime/modes.py) or
  are added into the `param.grad` the user holds.
- overlapped mode: the same set. The optimizer thread reads step t's gradients while step
  t + 1 runs, but a job writes its piece only after it gated (waited for the optimizer step
  of) every parameter of that piece, and the optimizer is done with a parameter's gradient
  when it sets its ready event (Note [overlapped optimizer]). Where the device that
  accumulated them steps them, they stay there (Note [gradients stay on the device]).
- delayed mode: the same set too (Note [one gradient set]).
- a differentiable call (`cm(...)` then `.backward()`): a set of its own, since autograd may
  keep the gradients it is handed.

Note [one gradient set]: in delayed mode step t + 1 does not wait for the optimizer, which
reads step t's gradients beside it; a second set (8.1 GB on Qwen3-1.7B, 4.7 B/param) kept
them apart. Instead the optimizer steps a submission piece by piece in the buffer's order
(the backward's order: the next step's first backward job writes the piece the optimizer
steps first; a piece goes back after the last chunk that reads it: Note [chunk-wise submission]
in runtime/submission.py) and counts, per piece, the submissions done with it (`GradSet.consumed`, an int32
table in the host buffers' placement, so worker processes read it too). A job writes its piece
(on a GPU: downloads into it; on a CPU device: starts accumulating in it) once the counter says
every earlier submission is done with it (`wait_free`), which on 4 GPUs it always is by then
(the optimizer needs ~0.06 s a piece; the first backward job ends ~0.4 s into a step).

Note [working-dtype gradients]: where the attached optimizer steps the host gradients
(overlapped and delayed modes) and the devices work in bf16, the set is bf16, not fp32: a job
still accumulates its microbatches in fp32 on its device and rounds once, as the copy comes
down. That halves the set (Llama-3.1-8B: 15 GiB, 2 B/param) and the gradient bytes on the
host link; the optimizer widens them a slice at a time (Note [flat host optimizer]). The
rounding is bf16's 2^-9 of each gradient, below the differences bf16 compute already makes
(a tied weight's two parts, summed on the host, and a clipped set are rounded once more). Exact mode and differentiable calls keep fp32: they
hand the gradients to the user (`param.grad`, autograd). So does fp16, whose range a loss
scale fills: a sum of microbatches that fit could round to inf.

The plans of one compiled model (one per length its calls needed a new cut for) lay their
gradients out differently, but they share the memory: set 0 of every layout is a view of one
flat buffer, set 1 of another, each as large as the largest layout, and the row-sum buffers
are one per parameter. A train step switches layout only once the optimizer is done with the
buffer (runner.new_step), so a new plan costs no gradient memory.
"""
from __future__ import annotations

import math
import threading
import time

import torch

from .device import Pending, resolve
from .host_buffers import Reused, host_empty


def param_index(key) -> int:
    """The parameter a gradient key names: an index, or (index, start, stop) for rows of it."""
    return key[0] if isinstance(key, tuple) else key


class GradSet:
    """One flat host buffer of a GradLayout: its own, or a view of `storage(numel)` (a buffer
    shared by the layouts of a compiled model), taken at its first use."""

    def __init__(self, layout, pin: bool, row_sums: dict, kind: str, storage=None, consumed=None,
                 dtype=torch.float32, per_step: bool = False):
        self.layout, self.pin, self.kind, self.dtype = layout, pin, kind, dtype
        self.per_step = per_step        # one step's own (a differentiable call's): it goes with the step
        # Note [one gradient set]: per stage piece, the optimizer submissions done with it
        self.submitted = 0              # optimizer submissions that read this set (main process)
        self.consumed = consumed if consumed is not None else host_empty(
            (max(layout.stages, default=0) + 1,), torch.int32, pin, "gradient counters").zero_()
        self._row_sums = row_sums       # param index -> host buffer its row pieces are summed into
        self._storage = storage
        self._flat = None
        self._host_views: dict = {}     # stage -> {key: view of the host piece}, made once
        self.settled: list = []         # a lent set's flags (HostGrads.fresh): nothing writes it now
        self._lock = threading.Lock()

    def settle(self, done: bool) -> None:
        """A lent set (HostGrads.fresh): whether its writes are done (a run of its step ended
        well), so that its memory may be lent again once it is let go (Note [reused host buffers])."""
        for flag in self.settled:
            flag[0] = done

    def flat(self) -> torch.Tensor:
        with self._lock:
            if self._flat is None:
                n = self.layout.numel
                self._flat = (host_empty((n,), self.dtype, self.pin, self.kind) if self._storage is None
                              else self._storage(n, self.dtype)[:n])
            return self._flat

    @property
    def row_sums(self) -> dict:
        """param index -> the whole gradient of a parameter with row gradients only: a buffer of
        its own the rows are summed into, or the place in this set where its rows lie in order
        (GradLayout.whole_rows)."""
        whole_rows = getattr(self.layout, "whole_rows", None)
        if not whole_rows:
            return self._row_sums
        flat = self.flat()
        return {**self._row_sums, **{i: flat[off:off + math.prod(shape)].view(shape)
                                     for i, (off, shape) in whole_rows.items()}}

    def release(self, stages, count: int) -> None:
        """Submission `count - 1` is done with the pieces of `stages` (Note [one gradient set])."""
        stages = list(stages)
        if stages:
            self.consumed[stages] = count

    def wait_free(self, stage: int, need: int, poll_s: float = 2e-4) -> None:
        """Block until `need` submissions are done with a stage's piece."""
        while need > 0 and int(self.consumed[stage]) < need:
            time.sleep(poll_s)

    def piece(self, stage: int) -> torch.Tensor:
        """The host piece a stage's job downloads its gradients into."""
        start, stop = self.layout.stages[stage]
        return self.flat()[start:stop]

    def host_views(self, stage: int) -> dict:
        """{key: view} of a stage's gradients in its host piece."""
        views = self._host_views.get(stage)
        if views is None:
            views = self._host_views[stage] = self.views(stage, self.piece(stage))
        return views

    def views(self, stage: int, piece: torch.Tensor) -> dict:
        """{key: view} of a stage's gradients in `piece` (its host piece or a device twin)."""
        start = self.layout.stages[stage][0]
        return {key: piece[off - start:off - start + math.prod(shape)].view(shape)
                for key, off, shape in self.layout.keys[stage]}


class HostGrads:
    """The gradient sets of the runner's plans, kept across steps: one GradSet per layout, each
    a view of one flat buffer every layout shares (as large as the largest), and one row-sum
    buffer per parameter. They are allocated once, so pinned ones are exact (Note [exact
    pinned buffers] in runtime/host_buffers.py)."""

    def __init__(self, pin: bool, drop=None):
        self.pin = pin
        self.drop = drop               # host tensors -> None: buffers let go (shared files: every process forgets them)
        self.calls = Reused("call gradients", drop)   # what differentiable calls' sets are lent from
        self._sets: dict = {}       # layout signature -> GradSet
        self.flat = None            # the buffer the sets view
        self._sums: dict = {}       # param index -> row-sum buffer
        self._last = None           # the layout signature that used it last
        self._lock = threading.Lock()

    def _storage(self, numel, dtype):
        old = []
        with self._lock:
            if self.flat is None or self.flat.numel() < numel or self.flat.dtype != dtype:
                # a larger layout (or another dtype): a new buffer; the sets that view the old
                # one are made anew at their next use (a step that holds one keeps it alive)
                if self.flat is not None:
                    old.append(self.flat)
                self.flat = host_empty((numel,), dtype, self.pin, "gradients", exact=True)
                for sig, gs in list(self._sets.items()):
                    if gs._flat is not None:
                        old.append(gs.consumed)
                        del self._sets[sig]
            flat = self.flat
        self._let_go(old)
        return flat

    def _let_go(self, tensors) -> None:
        """Buffers no set uses now: worker processes forget their files (a layout switch waited
        for the optimizer first: runner.new_step), which go once the views die; kept, every
        process mapped the old buffer for as long as the model lived."""
        if self.drop is not None and tensors:
            self.drop(tensors)

    def renew(self) -> None:
        """New buffers for the next set; the old ones stay with whoever holds views of them
        (Note [lent gradients] in runtime/modes.py). Worker processes forget their files (no run
        reads them: an exact-mode step has ended), which go once the views die; kept by the
        workers, a user who kept each step's gradients filled /dev/shm by a set a step."""
        with self._lock:
            old = [self.flat, *self._sums.values(), *(gs.consumed for gs in self._sets.values())]
            self.flat, self._sums = None, {}
            self._sets.clear()
        self._let_go([t for t in old if t is not None])

    def switches(self, layout) -> bool:
        """Whether the buffer was last used by another layout (whose gradients the optimizer
        may still read: the caller waits for it first)."""
        return self._last is not None and self._last != layout.signature

    def set_for(self, layout, dtype=torch.float32) -> GradSet:
        """The set of `layout`, in `dtype` (Note [working-dtype gradients])."""
        old = []
        with self._lock:
            gs = self._sets.get(layout.signature)
            if gs is not None and gs.dtype != dtype:
                old.append(gs.consumed)
                gs = None
            if gs is None:
                sums = {}
                for i, shape in layout.row_sums.items():
                    if i not in self._sums:
                        self._sums[i] = host_empty(shape, torch.float32, self.pin, "gradients", exact=True)
                    sums[i] = self._sums[i]
                gs = self._sets[layout.signature] = GradSet(layout, self.pin, sums, "gradients", storage=self._storage,
                                                            dtype=dtype)
            self._last = layout.signature
        self._let_go(old)
        return gs

    def fresh(self, layout) -> GradSet:
        """A set nobody else uses (a differentiable call's: autograd may keep the gradients it is
        handed). Note [call gradient sets]: its buffers are lent by `calls` (Note [reused host
        buffers]): once the call's step and every gradient handed out of it are gone (zero_grad),
        the next call's set is the same memory, exactly sized; a gradient the user keeps keeps its
        buffer. With worker processes that memory is shared files, which the workers map and pin
        once: a new set every call (6.4 GiB for Qwen3-1.7B, 8 x 2048 tokens, one H200) took ~3.2 s
        of each `loss.backward()` step, 5.2 s against 1.8-2.5 s now (benchmarks/runs/call_grads/lent).
        A train step lets the spare sets go (GraphRunner.release_call_buffers)."""
        flags = []

        def lend(shape, dtype):
            t, settled = self.calls.lend(tuple(shape), dtype, self.pin)
            flags.append(settled)
            return t
        sums = {i: lend(shape, torch.float32) for i, shape in layout.row_sums.items()}
        consumed = lend((max(layout.stages, default=0) + 1,), torch.int32).zero_()
        gs = GradSet(layout, self.pin, sums, "call gradients", storage=lambda n, dtype: lend((n,), dtype),
                     consumed=consumed, per_step=True)
        gs.settled = flags
        return gs


# Note [gradients stay on the device]: with the whole update on the device that accumulated the
# gradients (one GPU, overlapped mode: the plan puts every parameter's optimizer state there by
# room), each step's gradients crossed the host link twice for nothing: its job brought the fp32
# accumulator down rounded to bf16 into the host set, and the optimizer thread copied each slice
# back up to step it (Llama-3.1-8B's first 16 layers on one H200: 9.1 GB each way, the download
# 0.19 s between the last microbatch and the update, the uploads half the update's 0.56 s; the
# next step's first microbatch waits for the whole update: Note [weights as they arrive], job.py).
# So there the job's accumulator stays: the optimizer steps the parameters stepped on that device
# from views of it (fp32, rounded nowhere), and only the gradients of those the host steps come
# down (the plan's share by room leaves a few blocks there: 0.953 for Qwen3-1.7B on one H200, 151
# of 3,441 MB). The next step's job accumulates into the same memory, kept across steps
# (`DeviceGrads.accumulator`; a fresh one would be allocated while the optimizer still holds the
# last, twice the memory the plan counts). A job writes it only after gating every parameter it
# has gradients of (JobContext._start_grads), and the optimizer is done with a parameter's
# gradient when it sets the parameter ready (its device work synchronised first). Only where the
# plan has one job with gradients, its parameters stepped on one device (and the host), in worker
# threads (a worker process's accumulator is in its own CUDA context), and where the job runs
# there; anywhere else the job downloads as before. Delayed mode keeps the download: its next
# step's jobs run beside the optimizer reading the last step's gradients (Note [one gradient
# set]), so a kept accumulator would make them wait for it. Measured (59th session, one H200,
# overlapped mode, M=4, one fused job, both orders, benchmarks/runs/grads_stay): Qwen3-1.7B
# 39,634 -> 43,236 tokens/s (median step 1.63 -> 1.49-1.52 s), Llama-3.1-8B's first 16 layers
# 11,156 / 11,114 -> 15,611 / 15,506 (1.42-1.43 -> 0.99-1.00 s); the next step's first
# microbatch 0.58 -> 0.44 s and 0.87 -> 0.42 s; peak GPU memory allocated unchanged.
class DeviceGrads:
    """The accumulator a job's gradients stay in on `device` for the optimizer (Note [gradients
    stay on the device])."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.params = frozenset()     # indices of the parameters stepped there (set at each step's start)
        self._flat = None

    def accumulator(self, dev, piece, dtype):
        """The kept accumulator for a host piece like `piece`, in dtype (uninitialised at first:
        Note [first gradients copied], job.py); a new one where the piece's size or the dtype
        changed (another plan)."""
        t = self._flat
        if t is None or t.shape != piece.shape or t.dtype != dtype:
            self._flat = None       # (the old one is freed once the optimizer drops its views)
            # (own: on a CPU device too a tensor apart from the host set, as on a GPU)
            t = self._flat = dev.grad_accumulator(piece, own=True, dtype=dtype)
        return t

    def split(self, layout, stage: int, flat, got):
        """({key: view of `flat`} of the keys a gradient reached (`got`) whose parameters are
        stepped on this device (`params`), [the others' keys]), or None where a parameter stepped here has rows no gradient reached (the caller
        downloads them all then). The row pieces of a parameter laid out whole in place
        (GradLayout.whole_rows) are its whole key, as the host path's row sums find them."""
        start = layout.stages[stage][0]
        here, rest = {}, []
        for key, off, shape in layout.keys[stage]:
            i = param_index(key)
            whole_rows = isinstance(key, tuple) and i in layout.whole_rows
            if key not in got:
                if whole_rows and i in self.params:
                    return None
            elif i not in self.params:
                rest.append(key)
            elif whole_rows:
                if i not in here:
                    w_off, w_shape = layout.whole_rows[i]
                    here[i] = flat[w_off - start:w_off - start + math.prod(w_shape)].view(w_shape)
            else:
                here[key] = flat[off - start:off - start + math.prod(shape)].view(shape)
        return here, rest


def settled(tensors) -> None:
    """Wait for the work queued on the current stream of each GPU among `tensors` (gradients
    summed or cast on a device by this thread, before another stream steps them: Note
    [gradients stay on the device])."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


# Note [one microbatch a copy]: a job sums its microbatches' gradients in fp32 (Note [working-
# dtype gradients]), but where each copy of a job runs one microbatch (a 4-GPU run of 65,536
# tokens at M=4 makes four replicas of one microbatch each) there is no sum: the fp32 accumulator
# held the bf16 gradients widened, exactly, and was rounded back to bf16 on the way down. Its fp32
# cost every step a pass twice as wide as needed to fill it and twice the bytes in the copies'
# reduce-scatter over the GPUs' links. So there the accumulator takes the host set's dtype, and
# the values that come down are the same: each copy's bf16 gradient is exact, and the copies' sum is
# made in fp32 and rounded once (by worker threads, and by worker processes after an all-to-all:
# Note [narrow slices summed by their copy], replicas.py). The rule reads only the step and the
# number of copies, so every copy (one without a microbatch too) takes the same dtype, as the
# collective needs. Measured (2 H200s, Qwen3-1.7B, 32,768 tokens at M=2, with Note [first
# gradients copied], job.py): the copies' sum 12.7 and 19.6 -> 6.3 and 9.9 ms a step, the
# gradients' download 55 and 62 -> 41 and 45 ms; tokens/s unchanged (84,679 -> 84,022) while
# the optimizer's step set the pace (its jobs then waited ~20 ms longer for their gradient
# piece), and, with Note [masters down beside the next slice] (flat.py), 84,406 -> 86,584
# against neither (one run each side; the overlap alone 85,868 -> 86,790).
def accumulator_dtype(step, copies: int) -> torch.dtype:
    """The dtype of a job's gradient accumulator in `step`, for a job of `copies` copies (Note
    [one microbatch a copy])."""
    return step.grads.dtype if len(step.micro) <= copies else torch.float32


def as_dtype(t, dtype):
    """t in dtype, without a call into torch when it already is (Note [few calls per step])."""
    return t if t.dtype == dtype else t.to(dtype)


def for_step(t, dtype):
    """A gradient for the optimizer step of a parameter of `dtype`: a narrower one as it is (the
    step widens it a slice at a time, Note [working-dtype gradients]), a wider one in dtype."""
    return t if t.dtype.itemsize <= dtype.itemsize else t.to(dtype)


def sum_param_grads(job_grads: dict, row_sums: dict) -> dict:
    """Host gradient per parameter index from {job: {key: host view}}, summed over the jobs (a
    job that took only rows of a parameter, keyed (index, start, stop), adds into those rows).

    One wait per job: a job's gradients come down in one copy, whose completion covers them
    all (Note [few calls per step]). A parameter's gradient is the view of the first job that
    made all of it, the other jobs' gradients of it added in place (the views are this step's
    own, Note [host gradient buffers]); a parameter with rows only is its entry of `row_sums`
    (param index -> its whole gradient, kept across steps): where its rows already lie there,
    in order (GradLayout.whole_rows), nothing is copied, else they are summed into it."""
    for grads in job_grads.values():
        resolve(list(grads.values())[-1:])
    entries = [(key, g.tensor if isinstance(g, Pending) else g) for j in sorted(job_grads)
               for key, g in job_grads[j].items()]
    totals = {}
    rows: dict = {}
    for key, g in entries:
        if isinstance(key, tuple):
            rows.setdefault(key[0], []).append((key[1], key[2], g))
        elif key in totals:
            totals[key].add_(g)
        else:
            totals[key] = g
    for i, parts in rows.items():
        if i not in totals:
            whole = row_sums[i]
            if not all(whole[start:stop].data_ptr() == g.data_ptr() for start, stop, g in parts):
                whole.zero_()
                torch._foreach_add_([whole[start:stop] for start, stop, _ in parts], [g for _, _, g in parts])
            totals[i] = whole
        else:
            torch._foreach_add_([totals[i][start:stop] for start, stop, _ in parts], [g for _, _, g in parts])
    return totals
