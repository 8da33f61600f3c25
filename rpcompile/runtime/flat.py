"""Flat host tensors for the optimizer: master weights, their optimizer state and their
gradients as views of a few large buffers, stepped a run of parameters at a time.

Note [flat host optimizer]: torch's CPU kernels (the fused AdamW, a copy) run one parallel
region per tensor, and a region ends when its slowest thread does. With every core busy (a
64-core host, four worker processes beside the optimizer thread) a thread that loses its core
for a scheduler slice holds up its region by milliseconds, once per tensor: stepping
Qwen3-1.7B's 197 tensors with the fused AdamW took 1.27 s on an idle 64-core host, one flat
tensor of the same 1.72B elements 0.25 s, and the bf16 refresh 1.24 s per tensor against
0.10 s flat (benchmarks/optim_probe.py, RESULTS.md). So:

- `flatten_masters` re-points the trainable parameters (`p.data`) into one buffer per dtype,
  laid out in the order their gradients lie in the host gradient buffer (GradLayout), so a
  run of parameters that is contiguous there is contiguous here too;
- `FlatStepper` steps such a run as one tensor with a twin of the user's optimizer (same class
  and hyperparameters), whose state is the run's slice of flat state buffers; the user's
  `optimizer.state[p]` entries are views of those same buffers, so `state_dict()` and a later
  per-parameter step see and update the same numbers. Only optimizers whose update is
  elementwise (Adam, AdamW, SGD) are stepped so; any other steps per parameter as before.
- `merge_adjacent` turns copies between adjacent views into one copy per run (the refresh of
  the working copies, laid out in the same order).

Gradients may come in a narrower dtype than the masters (Note [working-dtype gradients] in
runtime/grads.py: bf16 host gradients beside fp32 masters): a run is then stepped a slice of
WIDEN elements at a time, each slice's gradient widened into one reused buffer, so no gradient
exists in fp32 for more than a slice.

A parameter's first step is a per-parameter step of the user's optimizer (which makes its state
the way the optimizer makes it: SGD's momentum is the first gradient, Adam's moments zeros);
its state is then moved into the flat buffers, a PIECE of elements at a time (a parameter larger
than that by twins over its slices), so that a first step's state never exists twice for more
than a piece. A parameter whose state lives on a device has its first step there, by twins over
its slices (Note [first step on the device]). The user's state entries are checked every step
(a `load_state_dict` replaces them: they are moved again), and scalar state (Adam's `step`) is
kept per parameter as the optimizer keeps it, a run stepping only parameters whose values agree.

Note [optimizer state on the devices]: at 4 GPUs the host's update of Llama-3.1-8B (widen, fused
AdamW, refresh: 40 B of memory traffic per element) took 2.5-2.7 s a step on a 64-core H100 host,
more than the devices' work (1.6 s a step), while each GPU had ~50 GiB left beside its largest
stage job. So `Config.optimizer_on_devices` puts a share of each flat buffer's parameters on the
devices, in blocks of about 64Mi elements (whole parameters) interleaved with the host's and dealt
to the devices in turn: the optimizer steps a chunk of the parameters at a time and each chunk's
masters are read (the refresh) right after it, so a chunk spread over every device and the host
keeps them all busy, where a device's contiguous quarter would have one busy at a time. An fp32
copy of those masters and their optimizer state live there (AdamW: 12 B a parameter), and a run's
part there is stepped by a twin on that device. Per element the host then copies the gradient up
and the stepped master down (2 + 4 B of DMA), and refreshes the working copies as before. The
host's masters stay what the user reads and writes: a master goes up again only where its
parameter's `_version` moved since it came down (an in-place write through the parameter or
`load_state_dict`; as for the working copies, HostWeights in runtime/weights.py, a write through
`p.data` is not seen), and every one after a failed step. Going up each step cost 4 B more of
host-to-device traffic per element, beside the weight uploads (at 4 GPUs with Llama-3.1-8B, 8 GB
a GPU a step).
The user's `optimizer.state[p]` entries are views of the device buffers (`state_dict()` holds
device tensors there; `load_state_dict` moves them back where they belong); scalar state stays
on the host. A run whose scalar state disagrees is stepped a parameter at a time, never by the
user's optimizer (whose state is not all on the host any more).

Note [gradients page-locked in the main process]: a device's part of a run is uploaded straight
from the host gradient set, which must be page-locked for the copy to be asynchronous (from
pageable memory it holds the optimizer thread for its whole length, one device after another).
With worker threads the set is pinned; with worker processes it lies in shared files the
workers page-lock in their own address spaces only, so the first upload from a file registers
the main process's mapping of it too (`SharedMemory.page_lock`: once per file, 0.5 s per 4 GiB
of pages already written). Before, each slice was copied into one of two page-locked staging
buffers per device: a CPU copy of 2 B per element a step, in the optimizer's critical path,
and 1 GiB of host memory for Qwen3-1.7B at 4 GPUs, whose update on the devices took 0.40 s a
step (0.33 s without them, 4x H200, twenty-seventh session).

Note [ready before the first step]: the first optimizer step also did what only it needs, in
the time a later step waits for it (delayed mode: the third train step's jobs read its weights):
page-locking the worker processes' gradient and working-copy files in the main process (0.8 s
for Qwen3-1.7B: Note [gradients page-locked in the main process]) and putting the device ranges'
masters there (4 B an element up). With 2 worker processes on one H200 and every update on the
device (Config.optimizer_on_devices=1.0) that step took 2.4-2.6 s against 0.8-1.3 s for the
next ones, and the third train step waited for it. So the modes queue `FlatStepper.prepare` at
the first train step's start: the optimizer thread does both while that step's jobs run (its
compiles take tens of seconds); the first optimizer step then took 1.8-1.9 s. A parameter
written in place before its first step goes up again then (its `_version` moved), as every
later step checks. Only with worker processes (and a share on the devices): with worker threads
the host buffers are pinned already, and at 1 GPU (the share 0.95) the host peak rose by the
gradient set's size (28.7 against 25.6-25.8 GiB, two same-call A/Bs in both orders) for a first
optimizer step 0.3 s shorter that no step waited for. Preparing made the set at step 1's start,
where a job makes it at its first gradients (after the compiles: Job.accumulate_grads), so it
lay under the compiles' passing peak (the main process's RSS was 3.2 GiB higher from then until
step 1 ended, the same after). Worker processes make their gradient files as step 1's jobs are
sent (ProcessExecutor._grads_key): the proxy's peak did not move. Not yet measured at 1 GPU
after this.

Note [working copies from the devices]: after a chunk is stepped, the working copies of its
parameters are rewritten (the bf16 copies the next steps upload). For a parameter whose
masters were just stepped on a device, the copy comes from there (`copy_down`): cast on the
device and copied down (2 B per element more of device-to-host traffic) while the host copies
its own part, instead of the host reading the fp32 masters it just received and writing bf16
(6 B of host memory traffic per element, on cores the workers and the optimizer share): at 4
H200s that refresh took 0.14 s a step for Qwen3-1.7B and 0.58 s of Llama-3.1-8B's 2.07 s step;
from the devices 0.05 s for Qwen3-1.7B (125,154 tokens/s against 118,103, RESULTS.md).
The masters there equal the host's only if the parameter's `_version` is the one they were
stepped to (an in-place write through the parameter since, or a failed step, and the host
copies it). With worker processes the copies are shared files, page-locked in the main
process at their first copy like the gradients.

Note [masters down after the copies]: a slice stepped on a device had its fp32 masters copied
down before its chunk was marked ready, so the working copies of the next chunk, which the next
step's jobs wait for in overlapped mode, shared the device-to-host link with twice their bytes
of masters (one H200, Qwen3-1.7B, the whole update there: 6.8 GB of masters a step, ~0.16 s of
link, beside 3.4 GB of working copies and 3.4 GB of gradients). Where the jobs read the working
copies the refresh writes (overlapped mode on GPUs), no job reads the host masters, so a
submission asked so (`masters="last"`, modes.py) brings them down once its last chunk is ready
(`masters_down`), before it counts as done (whatever reads the parameters waits for that).
Where the jobs read the host masters themselves (overlapped mode on CPU devices: no working
copies) a slice's come down before its chunk is ready, and so in delayed mode, whose next steps
wait for the whole submission (Note [delayed optimizer]): there the masters at the end made it
longer than a step (one H200, Llama-3.1-8B's first 16 layers, the submission 0.86 -> 1.10 s,
17,444 -> 13,833 tokens/s). A failed submission brings down what it stepped, as before.
Measured (58th session, one H200, overlapped mode, M=4, one fused job, each pair in one call in
both orders, benchmarks/runs/masters_after_copies): the next step's first microbatch, which
waits for the update, 0.65-0.67 -> 0.59-0.62 s for Qwen3-1.7B (37,615 / 37,808 -> 38,705 /
38,327 tokens/s) and 1.04-1.07 -> 0.86-0.88 s for Llama-3.1-8B's first 16 layers (10,070 /
10,098 -> 11,102 / 11,026).

Note [masters kept on the devices]: in delayed mode no job reads the host masters (the jobs read
the two working copies, which the refresh writes from the devices), so a submission there asks
for `masters="kept"`: the fp32 masters stepped on a device stay there, the device's copy is the
parameter's value, and they come down only when something reads the host's: `synchronize()`
(which the user calls before reading parameters, and which `model.state_dict()` and the
optimizer's state_dict / load_state_dict call through their pre-hooks, compiled.py), a call that
reads the live parameters (runner.new_step), bringing the state home, and a failed submission
(whose error makes every master go up again from the host). Each slice is pending once however
many steps it stays (the same device buffer), so coming down costs one step's bytes. A
parameter written in place on the host after `synchronize()` goes up again as before (its
`_version` moved); one written without it, while the host's masters were stale, would go up
stale: the same write races the optimizer thread in delayed mode anyway. Before, delayed mode
brought 4 B an element down every step (one H200, Llama-3.1-8B's first 16 layers: 18 GB of the
step's 36 GB device-to-host). Alone that measured nothing (sixtieth session: 17,583 against
17,378 tokens/s; the masters came down on their own stream, off the path the next steps wait
on); it leaves the down link to the working copies, which come down beside the next chunk's
step (Note [chunks within a piece] in runtime/submission.py, measured with it).
"""
from __future__ import annotations

import bisect
import contextlib
import inspect
import math

import torch

from .host_buffers import host_empty

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _same_groups(groups: list, live: list) -> bool:
    """Whether a submission's param groups are the optimizer's as they are now."""
    if len(groups) != len(live):
        return False
    for g, h in zip(groups, live):
        if g.keys() != h.keys() or len(g["params"]) != len(h["params"]) or \
                any(p is not q for p, q in zip(g["params"], h["params"])):
            return False
        for key, v in g.items():
            w = h[key]
            if key != "params" and not (v is w or (torch.equal(v, w) if isinstance(v, torch.Tensor) and
                                                     isinstance(w, torch.Tensor) else v == w)):
                return False
    return True


def _step_with_groups(optimizer, groups: list) -> None:
    """`optimizer.step()` by `groups` instead of its param_groups, which the caller's thread may
    be changing meanwhile (Note [hyperparameters per submission] in runtime/optimizer.py): a
    shallow twin shares its state, defaults and hooks; what else its step sets on itself (a
    counter) or on a group (a group's step count) is set on the optimizer after."""
    twin = object.__new__(type(optimizer))
    own = {k: v for k, v in vars(optimizer).items() if k != "step"}   # (a scheduler's wrapper of the optimizer's step)
    vars(twin).update(own)
    twin.param_groups = groups
    was = [dict(g) for g in groups]
    twin.step()
    for key, v in vars(twin).items():
        if key not in ("param_groups", "step") and own.get(key, _MISSING) is not v:
            setattr(optimizer, key, v)
    for g, before, live in zip(groups, was, optimizer.param_groups):
        for key, v in g.items():
            if before.get(key, _MISSING) is not v:
                live[key] = v


_MISSING = object()


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b starts where a ends, in the same storage, both contiguous and of one dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def _joined(ts: list) -> torch.Tensor:
    """One 1-D view over adjacent tensors."""
    t = ts[0]
    return t.as_strided((sum(x.numel() for x in ts),), (1,), t.storage_offset()) if len(ts) > 1 else t.view(-1)


def _wait(streams) -> None:
    """Block until each distinct stream among `streams` (None: a CPU device's, whose work is
    done) has done what was queued on it."""
    for stream in set(streams):
        if stream is not None:
            stream.synchronize()


def move_into(buf: torch.Tensor, params) -> list:
    """Copy the parameters, one after another, into the flat host tensor buf and make each one's
    data its view there (set_data keeps p's own version counter); their element offsets."""
    offsets, off = [], 0
    with torch.no_grad():
        for p in params:
            view = buf[off:off + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            offsets.append(off)
            off += p.numel()
    return offsets


def merge_adjacent(dsts: list, srcs: list) -> tuple:
    """(dsts, srcs) for one copy per run: consecutive pairs whose destinations and sources
    both continue each other are joined into one 1-D view each."""
    out_d, out_s, run = [], [], []
    for d, s in zip(dsts, srcs):
        if run and _adjacent(run[-1][0], d) and _adjacent(run[-1][1], s) and d.numel() == s.numel():
            run.append((d, s))
            continue
        if run:
            out_d.append(_joined([x for x, _ in run]))
            out_s.append(_joined([y for _, y in run]))
        run = [(d, s)] if (d.numel() == s.numel() and d.is_contiguous() and s.is_contiguous()) else []
        if not run:
            out_d.append(d)
            out_s.append(s)
    if run:
        out_d.append(_joined([x for x, _ in run]))
        out_s.append(_joined([y for _, y in run]))
    return out_d, out_s


def _pieces(d, s, n: int) -> list:
    """A copy from s into d with a cast, as pairs of at most n elements (1-D views); a copy
    without a cast, or of other views, whole."""
    if d.dim() != 1 or s.dim() != 1 or d.dtype == s.dtype or d.numel() <= n:
        return [(d, s)]
    return [(d[a:a + n], s[a:a + n]) for a in range(0, d.numel(), n)]


class FlatMasters:
    """The flat buffers the trainable host parameters were moved into: param id -> (buffer
    index, offset); and the ranges of each buffer whose optimizer steps on a device (Note
    [optimizer state on the devices]): buffer index -> [(start, stop, device)]."""

    def __init__(self, state_devices=(), share: float = 0.0):
        self.buffers: list = []
        self.where: dict = {}
        self.devices = [torch.device(d) for d in state_devices]
        self.state_devices, self.share = [], 0.0
        self.on_devices: dict = {}
        self.choose(share)

    def choose(self, share: float) -> None:
        """The share of the parameters to place on the devices, until the first are placed
        (Note [optimizer share by room] in passes/host_memory.py: the plan chooses it)."""
        if not self.buffers:
            self.share = float(share or 0.0)
            self.state_devices = self.devices if self.share else []

    BLOCK = 1 << 26     # elements of consecutive parameters placed together (at least one parameter)

    def device_range(self, k: int, off: int):
        """(start, stop, device) of buffer k's range on a device that holds offset off, or None."""
        ranges = self.on_devices.get(k, ())
        i = bisect.bisect_right(ranges, (off, math.inf)) - 1
        return ranges[i] if i >= 0 and off < ranges[i][1] else None

    def place_of(self, p) -> tuple:
        """((buffer index, offset) of p's masters, the device range that holds them): (None, None)
        for a parameter not flattened, a range of None for one the host steps (a parameter is
        never split between two places)."""
        where = self.where.get(id(p))
        return where, (None if where is None else self.device_range(*where))

    def host_offset(self, k: int, off: int) -> int:
        """Where offset off of buffer k (stepped on the host) lies among the host's elements only."""
        return off - sum(b - a for a, b, _ in self.on_devices.get(k, ()) if b <= off)

    def host_numel(self, k: int) -> int:
        return self.buffers[k].numel() - sum(b - a for a, b, _ in self.on_devices.get(k, ()))

    def _place(self, k: int, sizes: list) -> None:
        """`share` of buffer k's elements on the devices: blocks of about BLOCK elements (whole
        parameters) in order, each to the devices (in turn) while their part is below the share,
        else to the host, so every stretch of the parameters (a chunk the optimizer steps) is
        spread over the host and every device."""
        n, total = len(self.state_devices), sum(sizes)
        if not n or not total:
            return
        ranges, off, placed, start, block = [], 0, 0, 0, 0
        for i, size in enumerate(sizes):
            off += size
            block += size
            if block < self.BLOCK and i + 1 < len(sizes):
                continue
            if placed + block / 2 <= self.share * off:       # half the block within the share of what came so far
                d = len(ranges) % n
                ranges.append((start, off, self.state_devices[d]))
                placed += block
            start, block = off, 0
        self.on_devices[k] = ranges

    def covers(self, params) -> bool:
        return all(id(p) in self.where for p in params)

    def flatten(self, params) -> None:
        """Move the given parameters (in this order; trainable floating-point CPU leaves only,
        others are left where they are) into one new buffer per dtype, unless already moved."""
        todo: dict = {}
        for p in {id(p): p for p in params}.values():
            if (id(p) not in self.where and p.requires_grad and p.is_leaf and p.device.type == "cpu"
                    and p.is_floating_point() and p.numel() > 1 and p.is_contiguous()):
                todo.setdefault(p.dtype, []).append(p)
        for dtype, ps in todo.items():
            numel = sum(p.numel() for p in ps)
            if any(d.type == "cuda" for d in self.state_devices):
                # page-locked: the device parts' masters go up and down every step
                buf = host_empty((numel,), dtype, True, "flat masters", exact=True)
            else:
                buf = torch.empty(numel, dtype=dtype)
            k = len(self.buffers)
            self.buffers.append(buf)
            self._place(k, [p.numel() for p in ps])
            for p, off in zip(ps, move_into(buf, ps)):
                self.where[id(p)] = (k, off)


class FlatStepper:
    """Steps the user's optimizer over (parameter, gradient) pairs, a contiguous run at a time
    where it can (Note [flat host optimizer]), per parameter where it cannot."""

    # elements of a first step made at once (per parameter, or a slice of a larger one): its
    # widened gradient and AdamW state take 12 B each on the host beside the flat buffers until
    # the state is moved (384 MiB; at 1 << 27, 1.5 GiB on top of a 4-GPU run's host memory)
    PIECE = 1 << 25
    # elements of a narrower gradient widened at once: a 256 MiB fp32 buffer, and 120 steps of
    # Llama-3.1-8B a submission (each call may wait for the interpreter lock: Note [few calls per step]).
    # 2^24 (a buffer the host's 300 MiB last-level cache keeps) stepped 17% faster on the host alone
    # (benchmarks/widen_probe.py, 2 H200s' host), but not in a run beside the devices' copies: Llama-3.1-8B's
    # update 2.26 against 1.98 s a step at 1 GPU, 2.11 against 1.99-2.05 s at 2 (RESULTS.md, 46th session)
    WIDEN = 1 << 26

    def __init__(self, optimizer, masters: FlatMasters):
        self.optimizer, self.masters = optimizer, masters
        self.elementwise = type(optimizer) in ELEMENTWISE
        self._state_bufs: dict = {}     # (buffer index, key) -> flat state buffer
        self._views: dict = {}          # id(param) -> {tensor key: the view we put in its state}
        self._twins: dict = {}          # (buffer index, start, stop, group index) -> (twin optimizer, run view)
        self._stepped: set = set()      # ids of parameters stepped per parameter at least once
        self._wide = None               # the buffer a slice of a narrower gradient is widened into
        self._device_masters: dict = {}  # (buffer index, range start) -> the range's fp32 masters on its device
        # (buffer index, range start) -> {id(param): its _version when the masters there last equalled the host's}
        self._device_synced: dict = {}
        self.master_uploads = 0         # elements of masters copied up to the devices so far
        self._streams: dict = {}        # device -> the stream this thread steps on (not a worker's)
        self._down_streams: dict = {}   # device -> the stream its stepped masters come down on
        # (buffer index, slice start) -> (device, step stream, host masters, device masters) stepped
        # but not yet down (Note [masters down after the copies], Note [masters kept on the devices])
        self._masters_pending: dict = {}
        self._copies_pending: list = []  # the down streams of copies issued with land_later (copy_down)
        self.tracer = None              # a submission's Tracer: the devices' parts as spans (Note [optimizer spans])
        # page_lock(t): page-lock the shared file t lies in, in this process (worker processes' gradients)
        self.page_lock = None
        sig = inspect.signature(type(optimizer).__init__).parameters
        self._ctor_keys = [k for k in sig if k not in ("self", "params")]

    # -- per parameter -------------------------------------------------------------------------
    def _step_alone(self, pairs, groups=None) -> None:
        """The user's optimizer stepped with `pairs` [(p, g)] as the only gradients it sees, and
        the param groups `groups` (a submission's: Note [hyperparameters per submission] in
        runtime/optimizer.py; default: the optimizer's own).

        Note [held gradients]: `optimizer.step()` steps every parameter whose `.grad` is set, and
        a user's `.grad` may hold gradients of their own (a differentiable call's backward between
        train steps). Left there, each chunk's step applied them again (the lm_head moved 25x its
        gradient with SGD, overlapped mode), and the chunk's own parameters lost theirs. They are
        held aside around the step and put back: an attached optimizer steps the step's
        gradients, and `.grad` is the user's."""
        held = [(p, p.grad) for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        for p, _ in held:
            p.grad = None
        try:
            for p, g in pairs:     # (g may be on a device: Note [gradients stay on the device])
                p.grad = g.to(device=p.device, dtype=p.dtype)
            # (its post-hook marks what it stepped as written: Note [steps through .data])
            if groups is None or _same_groups(groups, self.optimizer.param_groups):
                self.optimizer.step()
            else:
                _step_with_groups(self.optimizer, groups)
        finally:
            for p, _ in pairs:
                p.grad = None
            for p, g in held:
                p.grad = g

    def _per_param(self, pairs, groups) -> None:
        """Step pairs with the user's optimizer itself, a slice of about PIECE elements at a time,
        and move the state it made into the flat buffers after each slice: the state of a first
        step exists twice only for one slice, not for the model. A parameter larger than a slice,
        or whose state lives on a device, has its first step in slices of its own
        (`_first_in_slices`)."""
        piece: list = []
        settle: dict = {}       # the devices' first steps, waited for once (_first_in_slices)
        # only what the optimizer holds was stepped: a parameter it does not hold (yet), taken as
        # stepped with no state, was stepped flat after an add_param_group, its state (momentum)
        # in the twin only, missing from optimizer.state and so from its state_dict
        members = {id(q) for group in groups for q in group["params"]}
        try:
            for i, (p, g) in enumerate(pairs):
                if not self._first_in_slices(p, g, settle, groups):
                    piece.append((p, g))
                if piece and (i + 1 == len(pairs) or sum(q.numel() for q, _ in piece) >= self.PIECE):
                    self._step_alone(piece, groups)
                    for q, _ in piece:
                        if id(q) in self.masters.where and id(q) in members:
                            self._stepped.add(id(q))
                            if id(q) not in self._views:
                                self._adopt(q)
                    piece = []
        finally:
            _wait(settle.pop("streams", ()))
            for state, key, v in settle.pop("scalars", ()):
                state[key] = v.cpu()

    def _first_in_slices(self, p, g, settle: dict, groups) -> bool:
        """A flat parameter's first step (it has no state yet), PIECE elements at a time, each
        slice by a twin over that slice of the masters, whose state goes into the flat buffers
        before the next slice is stepped; False (nothing done) where that does not apply, or for
        a parameter of at most PIECE elements stepped on the host (the user's optimizer steps it,
        with others, in `_per_param`).

        The optimizers stepped flat are elementwise, so a slice's state is made as the whole
        parameter's would be (Adam's zeros, SGD's first gradient), and the user's state entries
        end as views of the flat buffers, as `_adopt` leaves them. Stepped whole by the user's
        optimizer, Qwen3-1.7B's tied embedding (311M elements) made its fp32 gradient and AdamW
        state at once: 3.5 GiB more host memory for a moment, the peak of a 4-GPU run.

        Note [first step on the device]: a parameter whose state lives on a device has its first
        step there, as every later one: its masters go up, twins over slices of WIDEN/4 elements
        make the state on the device, the stepped masters come down. Made on the host and copied
        up, the state of a 4-GPU Qwen3-1.7B with `optimizer_on_devices=1.0` (13.6 GB: page
        faults of fresh zeros, a host AdamW over 1.7B elements, pageable copies) held the third
        step's jobs, which wait for the first step's weights, for about 5 s (4 workers on one
        H200). Nothing waits for a device here: `settle` gets the streams the caller waits for once
        the parameters are issued (a wait after each held the device idle while this thread made
        the next one's twins: 1.6 s against a later step's 0.6 s, 2 worker processes, one H200),
        and the scalar state to bring to the host then."""
        where, r = self.masters.place_of(p)
        if where is None or (r is None and p.numel() <= self.PIECE):
            return False
        group = next((grp for grp in groups if any(q is p for q in grp["params"])), None)
        if (not self.elementwise or group is None or group.get("differentiable") or self.optimizer.state.get(p)
                or g.shape != p.shape or not g.is_contiguous()):
            return False
        k, off = where
        device = None if r is None else r[2]
        flat_p, flat_g, n = p.detach().view(-1), g.view(-1), p.numel()
        stream = self._stream(device) if device is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if device is not None:
                dm = self._device_masters_of(k, r)
                on_dev = dm[off - r[0]:off - r[0] + n]
                if self._device_synced[(k, r[0])].get(id(p)) != p._version:     # (not put there by `prepare`)
                    on_dev.copy_(flat_p, non_blocking=True)
                    self.master_uploads += n
            # on a device a slice's new state and gradient (AdamW: 8 + 2 + 4 B an element) stay
            # within what the plan keeps there for a widened gradient (WIDEN x 6 B:
            # device_optimizer_bytes in passes/host_memory.py)
            piece = self.PIECE if device is None else min(self.PIECE, self.WIDEN // 4)
            for a in range(0, n, piece):
                b = min(n, a + piece)
                part = flat_p[a:b] if device is None else on_dev[a:b]
                twin = type(self.optimizer)([part], **{c: group[c] for c in self._ctor_keys if c in group})
                part.grad = (flat_g[a:b] if device is None else self._upload(flat_g[a:b], device)).to(p.dtype)
                try:
                    twin.step()
                finally:
                    part.grad = None
                made = twin.state[part]
                for key, v in made.items():
                    if isinstance(v, torch.Tensor) and v.shape == part.shape:
                        buf, i = self._state_buf(k, key, off, v.dtype)
                        buf[i + a:i + b].copy_(v)
            if device is not None:
                flat_p.copy_(on_dev, non_blocking=True)     # (through p: its _version moves)
        if stream is not None:
            settle.setdefault("streams", set()).add(stream)
        # (the scalar state, `step`, is every slice's, kept on the host; a state that is not
        # tensors, SGD's momentum_buffer None without momentum, stays what the optimizer made)
        tensors = all(isinstance(v, torch.Tensor) and (v.shape == part.shape or v.dim() == 0) for v in made.values())
        state, views = {}, {}
        for key, v in made.items():
            if tensors and v.shape == part.shape:
                buf, i = self._state_buf(k, key, off, v.dtype)
                state[key] = views[key] = buf[i:i + n].view(p.shape)
            elif isinstance(v, torch.Tensor) and v.dim() == 0:
                state[key] = v          # (on the host once the stream is done: _per_param)
                settle.setdefault("scalars", []).append((state, key, v))
            else:
                state[key] = v
        self.optimizer.state[p] = state
        self._stepped.add(id(p))
        if tensors:
            self._views[id(p)] = views
            if device is not None:      # the masters there are the host's
                self._device_synced[(k, r[0])][id(p)] = p._version
        return True

    def prepare(self, params, host_buffers=()) -> None:
        """Before the first step, while the first train step's jobs run (Note [ready before the
        first step]): page-lock the host buffers the device parts copy to and from, and put every
        device range's masters there (those of `params` then count as the host's)."""
        ranges = [(k, r) for k, rs in self.masters.on_devices.items() for r in rs]
        if not ranges:
            return
        for t in host_buffers:
            self._lock_pages(t, ranges[0][1][2])
        members: dict = {}
        for p in params:
            where, r = self.masters.place_of(p)
            if r is not None:
                members.setdefault((where[0], r[0]), []).append(p)
        streams = set()
        for k, r in ranges:
            if (k, r[0]) in self._device_masters:     # there already (stepped, or prepared before)
                continue
            stream = self._stream(r[2])
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._device_masters_of(k, r).copy_(self.masters.buffers[k][r[0]:r[1]], non_blocking=True)
            self.master_uploads += r[1] - r[0]
            synced = self._device_synced[(k, r[0])]
            for p in members.get((k, r[0]), ()):
                synced[id(p)] = p._version
            streams.add(stream)
        _wait(streams)

    def _adopt(self, p) -> bool:
        """Move p's (tensor) optimizer state into the flat state buffers; False if its state is
        not of a kind a run can step (then p keeps being stepped per parameter)."""
        state = self.optimizer.state.get(p) or {}
        if not state and id(p) not in self._stepped:
            return False        # (a parameter stepped once with no state, as plain SGD's, is fine)
        k, off = self.masters.where[id(p)]
        views = {}
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.device == p.device:
                buf, i = self._state_buf(k, key, off, v.dtype)
                if buf.dtype != v.dtype:
                    return False
                view = buf[i:i + p.numel()].view(p.shape)
                view.copy_(v)
                state[key] = view
                views[key] = view
            elif not (isinstance(v, torch.Tensor) and v.dim() == 0):
                return False
        self._views[id(p)] = views
        r = self.masters.device_range(k, off)
        if r is not None and r[2].type == "cuda":
            # made and filled on the device's current stream; stepped on this thread's own
            torch.cuda.current_stream(r[2]).synchronize()
        return True

    def _state_buf(self, k, key, off, dtype):
        """(the flat state buffer `key` that holds buffer k's offset off, the offset it starts at):
        one as long as the masters on the host, one per range on a device."""
        r, where, index = self._position(k, off)
        buf = self._state_bufs.get((k, key, where))
        if buf is None:
            if r is None:
                buf = torch.zeros(self.masters.host_numel(k), dtype=dtype)
            else:
                buf = torch.zeros(r[1] - r[0], dtype=dtype, device=r[2])
            self._state_bufs[(k, key, where)] = buf
        return buf, index

    def _position(self, k, off):
        """(device range or None, its key in _state_bufs: its start or None, where off lies in
        that range's buffers: the host's hold the host's elements only, in order)."""
        r = self.masters.device_range(k, off)
        if r is None:
            return None, None, self.masters.host_offset(k, off)
        return r, r[0], off - r[0]

    def bring_home(self) -> None:
        """Every device range's optimizer state back on the host, in host state buffers as long as
        the masters, which the user's state entries view again (Note [optimizer share by room] in
        passes/host_memory.py: a plan that does not fit beside it comes next). The host's masters
        are current (each step copies the stepped ones down). The caller's thread, nothing in
        flight."""
        if not any(self.masters.on_devices.values()):
            return
        old = self._state_bufs        # (alive until every entry is copied out of it)
        self._state_bufs = {}
        self.masters.on_devices.clear()
        self.masters.share, self.masters.state_devices = 0.0, []
        for cache in (self._twins, self._device_masters, self._device_synced):
            cache.clear()
        params = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) in self._views]
        for p in params:
            k, off = self.masters.where[id(p)]
            state, views = self.optimizer.state[p], {}
            for key, v in self._views[id(p)].items():
                buf, i = self._state_buf(k, key, off, v.dtype)
                views[key] = state[key] = buf[i:i + p.numel()].view(p.shape).copy_(v)
            self._views[id(p)] = views
        del old
        if any(d.type == "cuda" for d in self.masters.devices):
            torch.cuda.empty_cache()  # the memory is the jobs' now (worker processes' too)

    def _flat_ready(self, p, group) -> bool:
        views = self._views.get(id(p))
        if views is None:
            return False
        state = self.optimizer.state.get(p) or {}
        if views and not state:              # the user dropped its state: made anew per parameter
            del self._views[id(p)]
            return False
        if any(state.get(key) is not v for key, v in views.items()) or \
                any(key not in views and isinstance(v, torch.Tensor) and v.shape == p.shape for key, v in state.items()):
            return self._adopt(p)            # replaced (load_state_dict) or made since: move it again
        return True

    # -- runs ----------------------------------------------------------------------------------
    def _twin(self, k, start, stop, gi, group, example_state):
        """(an optimizer of the user's class and hyperparameters over elements start:stop of
        buffer k, its parameter): on the host a view of the masters, on a device a view of that
        range's masters there; its state views of the flat state buffers."""
        key = (k, start, stop, gi)
        twin = self._twins.get(key)
        if twin is not None:
            opt, run = twin
            state = opt.state[run]
            _, where, i = self._position(k, start)
            for name in example_state:       # (state the run got since: _new_state, _adopt)
                buf = self._state_bufs.get((k, name, where))
                if name not in state and buf is not None:
                    state[name] = buf[i:i + stop - start]
        if twin is None:
            r, where, i = self._position(k, start)
            if r is None:
                run = self.masters.buffers[k][start:stop]
            else:
                run = self._device_masters_of(k, r)[i:i + stop - start]
            opt = type(self.optimizer)([run], **{c: group[c] for c in self._ctor_keys if c in group})
            state = {}
            for name, v in example_state.items():
                buf = self._state_bufs.get((k, name, where))
                if buf is not None:
                    state[name] = buf[i:i + stop - start]
                elif r is not None and (group.get("fused") or group.get("capturable")):
                    state[name] = v.to(r[2], copy=True)   # (fused and capturable steps keep `step` on the device)
                else:
                    state[name] = v.clone()
            opt.state[run] = state
            twin = self._twins[key] = (opt, run)
        return twin

    def _device_masters_of(self, k, r):
        """The fp32 masters of buffer k's device range r = (start, stop, device) there."""
        dm = self._device_masters.get((k, r[0]))
        if dm is None:
            dm = self._device_masters[(k, r[0])] = torch.empty(r[1] - r[0], dtype=self.masters.buffers[k].dtype,
                                                               device=r[2])
            self._device_synced[(k, r[0])] = {}
        return dm

    def _slices(self, k, start, stop, narrow: bool) -> list:
        """[(a, b, device or None)]: start:stop cut where a device range begins or ends, and a
        narrower gradient's parts in slices of at most WIDEN elements."""
        cuts = {start, stop}
        for a, b, _ in self.masters.on_devices.get(k, ()):
            cuts.update(x for x in (a, b) if start < x < stop)
        out = []
        bounds = sorted(cuts)
        for a, b in zip(bounds, bounds[1:]):
            r = self.masters.device_range(k, a)
            # (on a device always in slices: the gradient goes up through WIDEN-element buffers)
            step = b - a if not narrow and r is None else self.WIDEN
            out += [(x, min(b, x + step), None if r is None else r[2]) for x in range(a, b, step)]
        return out

    def _lock_pages(self, t, device) -> None:
        """Page-lock the host memory t lies in where it is not yet, for an asynchronous copy
        between it and `device` (Note [gradients page-locked in the main process]); from pageable
        memory the copy would hold this thread for its whole length, one device after another."""
        if device.type == "cuda" and self.page_lock is not None and t.device.type == "cpu" and not t.is_pinned():
            self.page_lock(t)

    def _upload(self, g, device):
        """g on the device, copied asynchronously (_lock_pages)."""
        self._lock_pages(g, device)
        return g.to(device, non_blocking=True)

    def copy_down(self, dsts: list, params: list, land_later: bool = False):
        """Issue the copy of each parameter whose masters are current on a device into its
        working copy dsts[i], cast there and copied down one run at a time (Note [working copies
        from the devices]), on the device's down stream, after what this thread stepped there.
        Returns (the indices left for the host to copy, wait: blocks until the issued copies have
        landed); land_later: no wait, they land by `copies_landed()` (the submission's end: Note
        [chunks within a piece] in runtime/submission.py), while the next chunk steps."""
        rest, by_device = [], {}
        for i, p in enumerate(params):
            src = self._device_view(p)
            if src is None:
                rest.append(i)
            else:
                d = by_device.setdefault(src.device, ([], []))
                d[0].append(dsts[i])
                d[1].append(src)
        streams = []
        for device, (ds, ss) in by_device.items():
            stream = self._stream(device, self._down_streams)
            if stream is not None:
                stream.wait_stream(self._stream(device))
            start = self._mark(stream)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for d, src in zip(*merge_adjacent(ds, ss)):
                    self._lock_pages(d, device)
                    # the cast runs on the device (Note), into a temporary as large as the copy: at
                    # most WIDEN elements, within the room the plan keeps there for a widened
                    # gradient slice (device_optimizer_bytes); a whole run (Llama-3.1-8B's
                    # embedding: 1 GiB in bf16) was a temporary the plan did not count
                    for dp, sp in _pieces(d, src, self.WIDEN):
                        dp.copy_(sp, non_blocking=True)
            self._span(device, stream, "optimizer_down", "copies_down", start, elements=sum(d.numel() for d in ds))
            streams.append(stream)
        if land_later:
            self._copies_pending.extend(streams)
            return rest, None
        return rest, lambda: _wait(streams)

    def copies_landed(self) -> None:
        """Block until the copies issued with land_later have landed (copy_down)."""
        pending, self._copies_pending = self._copies_pending, []
        _wait(pending)

    def _device_view(self, p):
        """p's masters on its device, where they equal the host's (stepped there since it last
        changed), else None."""
        where, r = self.masters.place_of(p)
        if r is None or self._device_synced.get((where[0], r[0]), {}).get(id(p)) != p._version:
            return None
        dm = self._device_masters.get((where[0], r[0]))
        i = where[1] - r[0]
        return None if dm is None else dm[i:i + p.numel()].view(p.shape)

    def _mark(self, stream):
        """A span's start or end for self.tracer: an event on a device's stream, the host clock on
        a CPU device (whose work is done when the call returns); None when not tracing."""
        if self.tracer is None:
            return None
        return self.tracer.cuda_mark(stream) if stream is not None else self.tracer.now()

    def _span(self, device, stream, label, name, start, **attrs) -> None:
        """A span of this thread's work for `device`, from `start` (_mark) to now on `stream`
        (named `label` in the trace)."""
        if self.tracer is not None and start is not None:
            self.tracer.add(str(device), label, name, start, self._mark(stream), **attrs)

    def _stream(self, device, streams=None):
        if device.type != "cuda":
            return None
        streams = self._streams if streams is None else streams
        s = streams.get(device)
        if s is None:
            s = streams[device] = torch.cuda.Stream(device=device)
        return s

    def _master_down(self, device, stream, host, flat):
        """Issue the copy of stepped masters `flat` (on `device`, stepped on `stream`) into `host`;
        returns the stream it runs on (None on a CPU device, where it is done)."""
        # Note [masters down beside the next slice]: on the step's stream the fp32
        # masters' copy down (twice the bytes of the bf16 gradient that went up)
        # held the next slice's upload: the link's two directions took turns. On
        # their own stream they overlap it: the optimizer's step_s 0.211 -> 0.107 s
        # (2 H200s, Qwen3-1.7B replicas, one microbatch a copy), where its step had
        # set the pace (jobs waited 64-75 ms a step to write their gradient piece;
        # 85,868 -> 86,790 tokens/s, GPU-bound since)
        down = self._stream(device, self._down_streams)
        if down is None:
            start_mark = self._mark(None)
            host.copy_(flat)
        else:
            down.wait_stream(stream)
            start_mark = self._mark(down)
            with torch.cuda.stream(down):
                host.copy_(flat, non_blocking=True)
        self._span(device, down, "optimizer_down", "masters_down", start_mark, elements=flat.numel())
        return down

    def masters_down(self) -> None:
        """The masters stepped on the devices and not yet down come down; returns once they have
        landed (Note [masters down after the copies], Note [masters kept on the devices])."""
        _wait([self._master_down(*item) for item in self._masters_pending.values()])
        self._masters_pending = {}      # (kept where a copy failed: a later call tries again)

    @property
    def masters_away(self) -> bool:
        """Whether masters stepped on a device have not come down yet (masters_down)."""
        return bool(self._masters_pending)

    def _step_run(self, k, gi, group, run, masters="each") -> bool:
        """Step a run [(p, g, offset)] as one tensor; False (nothing done) if its scalar state
        disagrees. masters: "each", the masters stepped on a device come down before this
        returns; "last" or "kept", at masters_down() (step())."""
        p0 = run[0][0]
        state0 = self.optimizer.state[p0]
        scalars = [name for name, v in state0.items() if name not in self._views[id(p0)]]
        for name in scalars:
            vals = torch.stack([self.optimizer.state[p][name] for p, _, _ in run])
            if not bool((vals == vals[0]).all()):
                return False
        start, stop = run[0][2], run[-1][2] + run[-1][0].numel()
        grad = _joined([g for _, g, _ in run])
        master = self.masters.buffers[k]
        # a gradient as wide as the masters is stepped at once; a narrower one a slice at a time;
        # the parts on devices first (their copies and steps run while the host steps the rest)
        slices = self._slices(k, start, stop, grad.dtype != master.dtype)
        slices.sort(key=lambda x: x[2] is None)
        used, made = {}, {}
        try:
            for a, b, device in slices:
                stream = self._stream(device) if device is not None else None
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    opt, flat = self._twin(k, a, b, gi, group, state0)    # (a new twin's state: made on the stream)
                twin_group = opt.param_groups[0]
                for name, v in group.items():
                    if name != "params":
                        twin_group[name] = v
                twin_state = opt.state[flat]
                g = grad[a - start:b - start]
                if device is not None:
                    used[device] = stream
                    start_mark = self._mark(stream)
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        for name in scalars:       # (on the stream that steps: `step` may live on the device)
                            # a fill, not a copy: a copy from pageable host memory would wait for
                            # everything queued on the stream (the last slice's master download)
                            twin_state[name].fill_(state0[name])
                        synced = self._device_synced[(k, self.masters.device_range(k, a)[0])]
                        if any(synced.get(id(p)) != p._version for p, _, off in run if off < b and off + p.numel() > a):
                            # the host's masters changed since they came down (or never went up)
                            flat.copy_(master[a:b], non_blocking=True)
                            self.master_uploads += b - a
                        flat.grad = self._upload(g, device).to(flat.dtype)
                        try:
                            opt.step()
                        finally:
                            flat.grad = None
                        made.update(self._new_state(k, a, twin_state, state0))
                    self._span(device, stream, "optimizer", "step_on_device", start_mark, elements=b - a)
                    if masters != "each":
                        self._masters_pending[(k, a)] = (device, stream, master[a:b], flat)
                    else:
                        down = self._master_down(device, stream, master[a:b], flat)
                        if down is not None:
                            used[(device, "down")] = down
                    continue
                for name in scalars:
                    twin_state[name].copy_(state0[name])
                if g.dtype != master.dtype:
                    if self._wide is None or self._wide.numel() < b - a or self._wide.dtype != master.dtype:
                        # once: as large as a slice of the masters can be (what the plan counts)
                        self._wide = torch.empty(min(self.WIDEN, master.numel()), dtype=master.dtype)
                    g = self._wide[:b - a].copy_(g)
                flat.grad = g
                try:
                    opt.step()
                finally:
                    flat.grad = None
                made.update(self._new_state(k, a, twin_state, state0))
        finally:
            _wait(used.values())     # the masters are read (refresh) and the gradients rewritten next
        for name, dtype in made.items():     # the run's parameters view it too
            for p, _, off in run:
                buf, i = self._state_buf(k, name, off, dtype)
                self.optimizer.state[p][name] = self._views[id(p)][name] = buf[i:i + p.numel()].view(p.shape)
        src = [twin_state[name].cpu() for name in scalars]
        for name, v in zip(scalars, src):
            torch._foreach_copy_([self.optimizer.state[p][name] for p, _, _ in run], [v] * len(run))
        return True

    def _new_state(self, k, a, twin_state, known) -> dict:
        """Note [state made mid-run]: tensor state a twin's step made that its run had none of
        (SGD's momentum turned on after steps without it) lived in the twin only:
        missing from `optimizer.state` and so from its state_dict, and made anew by the next
        twin. It moves into the flat state buffers (the twin's state views them from now on);
        returns {name: dtype} of what moved, which the caller gives the run's parameters."""
        out = {}
        for name, v in list(twin_state.items()):
            if name in known or not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            buf, i = self._state_buf(k, name, a, v.dtype)
            twin_state[name] = buf[i:i + v.numel()].copy_(v.view(-1))
            out[name] = v.dtype
        return out

    def step(self, params: list, grads: list, masters: str = "each", groups=None) -> None:
        """One optimizer step of `params` with `grads` (aligned lists), by the param groups
        `groups` (default: the optimizer's own; a submission's copy: Note [hyperparameters per
        submission] in runtime/optimizer.py). masters: where the masters stepped on the devices
        come down: "each", before this returns; "last", at masters_down() once the submission's
        last chunk is refreshed (Note [masters down after the copies]); "kept", at masters_down()
        when something reads them (Note [masters kept on the devices]); the caller calls it."""
        if groups is None:
            groups = self.optimizer.param_groups
        if not self.elementwise:
            self._step_alone(list(zip(params, grads)), groups)
            return
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        flat, rest = [], []
        for p, g in zip(params, grads):
            gi = group_of.get(id(p))
            where = self.masters.where.get(id(p))
            if (gi is None or where is None or g.shape != p.shape or not g.is_floating_point() or not g.is_contiguous()
                    or groups[gi].get("differentiable") or not self._flat_ready(p, groups[gi])):
                rest.append((p, g))
            else:
                flat.append((where[0], gi, where[1], p, g))
        flat.sort(key=lambda x: (x[0], x[1], x[2]))
        runs, cur = [], []
        for k, gi, off, p, g in flat:
            if cur and (cur[0][0], cur[0][1]) == (k, gi) and cur[-1][2] + cur[-1][3].numel() == off \
                    and _adjacent(cur[-1][4], g):
                cur.append((k, gi, off, p, g))
            else:
                if cur:
                    runs.append(cur)
                cur = [(k, gi, off, p, g)]
        if cur:
            runs.append(cur)
        stepped = []
        try:
            for r in runs:
                k, gi = r[0][0], r[0][1]
                items = [(p, g, off) for _, _, off, p, g in r]
                if self._step_run(k, gi, groups[gi], items, masters):
                    stepped += [p for p, _, _ in items]
                elif self.masters.on_devices.get(k):
                    # scalar state disagrees: a parameter at a time (its state may be on a device,
                    # where the user's optimizer cannot step it)
                    for item in items:
                        self._step_run(k, gi, groups[gi], [item], masters)
                        stepped.append(item[0])
                else:
                    rest += [(p, g) for p, g, _ in items]
            self._per_param(rest, groups)
        except BaseException:
            for synced in self._device_synced.values():    # which masters came down is unknown: all go up
                synced.clear()
            raise
        if stepped:   # a step is an in-place update of each parameter (HostWeights reads _version)
            torch.autograd.graph.increment_version(stepped)
            for p in stepped:      # the stepped masters came down: host and device agree
                k, off = self.masters.where[id(p)]
                r = self.masters.device_range(k, off)
                if r is not None:
                    self._device_synced[(k, r[0])][id(p)] = p._version
