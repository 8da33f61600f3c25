"""One device as the runtime sees it: uploads, downloads and its random generator."""
from __future__ import annotations

import contextlib
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils import _pytree as pytree

from . import ops
from .flat import _adjacent, _joined
from .allocator import give_back_compute_stream, take_compute_stream, use_expandable_segments
from .host_buffers import host_empty
from .weights import working_dtype

ROUND_SLICE = 1 << 28   # elements rounded at once on the way down (512 MiB in bf16)

# One lock per generator: CPU "devices" are threads sharing torch's one CPU generator.
_generator_locks: dict = {}
_locks_guard = threading.Lock()


def _lock_for(key) -> threading.Lock:
    with _locks_guard:
        return _generator_locks.setdefault(key, threading.Lock())


def stream_seed(key: int, position: int) -> int:
    digest = hashlib.blake2b(f"{key}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Pending:
    """A host tensor whose download may still be in flight: `event` completes it."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor, event):
        self.tensor, self.event = tensor, event

    def wait_on(self, stream):
        stream.wait_event(self.event)

    def landed(self):
        """The host tensor once its download completed, never a copy (a worker process's slot,
        which `resolve` copies because a later step reuses it, read before then)."""
        self.event.synchronize()
        return self.tensor

    def resolve(self):
        """The host value the download's reader keeps."""
        return self.landed()


def resolve(value):
    """The host value behind a (tree of) Pending downloads, once they have completed."""
    if isinstance(value, Pending):
        return value.resolve()
    if isinstance(value, torch.Tensor) or value is None:
        return value
    return pytree.tree_map(lambda v: v.resolve() if isinstance(v, Pending) else v, value,
                           is_leaf=lambda v: isinstance(v, Pending))


# Note [one upload per run]: a stage job's weights went up one copy per tensor (559 a step for
# Llama-3.1-8B's 5-job plan, each a cudaMemcpyAsync, an event and a few Python calls on the
# uploader thread, under the interpreter lock the worker thread launches kernels with). In delayed
# mode the working copies are views of flat buffers in the order the forward reads the
# parameters, so a job's weights are a few runs of adjacent copies: each run goes up as one copy,
# and the job's weights are views of it on the device (kept alive together, freed together when
# the job is done with them). Copies in exact and overlapped mode are one buffer per parameter,
# and go up one by one as before. Measured with worker threads' slot sets (twentieth session,
# Qwen3-1.7B, 4 H100s, one call): 83,236 tokens/s against 83,378 before, host memory 46.6 GiB
# against 55.8; the uploads were not what held those steps.


def upload_runs(entries) -> list:
    """Runs of consecutive (index, entry) pairs (sorted by host address) whose copies (entry[1])
    continue each other in one buffer."""
    runs = []
    for i, e in entries:
        if runs and _adjacent(runs[-1][-1][1][1], e[1]):
            runs[-1].append((i, e))
        else:
            runs.append([(i, e)])
    return runs


def _map(fn, value, is_leaf=None):
    """fn over the leaves of value; a bare tensor (nearly every value a stage hands on) without
    pytree's flatten and unflatten: on 4 GPUs they were 8% of the interpreter lock's samples."""
    if isinstance(value, (torch.Tensor, Pending)):
        return fn(value)
    return pytree.tree_map(fn, value, is_leaf=is_leaf)


class DeviceRuntime:
    """Transfers between the host and one device, in the device's working dtypes.

    On a GPU there are four streams: weights in, activations in, compute (the worker thread's
    current stream) and out. Every transfer is ordered against compute with events; downloads
    land in pinned host buffers from torch's caching host allocator, which reuses a buffer
    only after the events of the copies that used it have completed.
    """

    def __init__(self, device: torch.device, peer_transfers: bool = False, label=None):
        self.device = device
        self.label = label or str(device)     # the device as the user named it (errors, traces)
        # host buffers for downloads: the running job's slots (Note [slot sets], set per job), and
        # for values a caller keeps (a call's outputs) buffers of their own
        self.host_slots = lambda shape, dtype: host_empty(shape, dtype, True, "activations")
        self.own_slots = lambda shape, dtype: host_empty(shape, dtype, True, "outputs")
        self.is_cpu = device.type == "cpu"
        self.prefetched: dict = {}       # (step, job) -> Future of {param key: (device tensor, event)}
        self.worker_index = 0
        self.peer_transfers = peer_transfers and not self.is_cpu
        self._held: list = []            # (tensor, event): kept alive until a peer's copy has read it
        self._held_lock = threading.Lock()
        self.closed = False
        if not self.is_cpu:
            use_expandable_segments()    # Note [expandable segments] (runtime/allocator.py)
            self.compute = take_compute_stream(device)   # Note [compute streams outlive their model]
            self.weights_in = torch.cuda.Stream(device)
            self.acts_in = torch.cuda.Stream(device)
            self.out = torch.cuda.Stream(device)
            self.sums = torch.cuda.Stream(device)     # copies' gradient sums (Note [copies' sum beside the next step])
            # Refreshing pinned working copies is host work (fp32 -> bf16): a thread of its own
            # does it and queues the uploads, so the worker thread never stops issuing compute.
            self.uploader = ThreadPoolExecutor(1, thread_name_prefix=f"rpcompile-upload-{device}",
                                               initializer=torch.cuda.set_device, initargs=(device,))

    def __repr__(self):
        return f"DeviceRuntime({self.device})"

    def close(self):
        if not self.is_cpu and not self.closed:
            self.closed = True
            self.uploader.shutdown(wait=False)
            give_back_compute_stream(self.device, self.compute)   # (jobs already queued may still use it)

    def stream_named(self, name):
        return {"compute": self.compute, "weights_in": self.weights_in, "acts_in": self.acts_in, "out": self.out,
                "sums": self.sums}[name]

    def enter_thread(self):
        """Called once by the worker thread that owns this device."""
        if not self.is_cpu:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.compute)

    def _copy_in(self, stream, t, want, wait=True, into=None):
        """Copy t to this device (into `into`, if given) on `stream`; compute waits for it now
        (wait) or the caller makes it wait on the returned event when the value is used."""
        if isinstance(t, Pending):
            t.wait_on(stream)
            t = t.tensor
        with torch.cuda.stream(stream):
            d = t.to(self.device, dtype=want, non_blocking=True) if into is None else into.copy_(t, non_blocking=True)
        d.record_stream(self.compute)
        ev = torch.cuda.Event()
        ev.record(stream)
        if wait:
            self.compute.wait_event(ev)
        return d, ev

    def upload(self, value, dtype=None):
        """Host value (tensors inside tuples too) to this device; floating tensors cast to dtype."""
        def move(t):
            base = t.tensor if isinstance(t, Pending) else t
            if not isinstance(base, torch.Tensor):
                return t
            want = working_dtype(base, dtype)
            if self.is_cpu:
                base = t.resolve() if isinstance(t, Pending) else base    # another device's copy may be in flight
                return base if base.dtype == want else base.to(dtype=want)
            return self._copy_in(self.acts_in, t, want)[0]
        return _map(move, value, is_leaf=lambda v: isinstance(v, Pending))

    def upload_weight(self, param, dtype, host_weights, rows=None, wait=True, into=None):
        """A parameter's working copy (or that of rows [start, stop)) on this device, from its
        pinned copy on a GPU; with wait=False, (tensor, event the compute must wait on). `into`:
        the weight_memory it goes into (Note [weights as they arrive], runtime/job.py)."""
        want = working_dtype(param, dtype)
        if self.is_cpu and not getattr(host_weights, "snapshot", False):
            p = param.detach() if rows is None else param.detach()[rows[0]:rows[1]]
            if into is not None:
                p = into.copy_(p)       # (copy_ casts to into's dtype, the working one)
            elif p.dtype != want:
                p = p.to(want)
            return p if wait else (p, None)
        with host_weights.refreshed(param, want, rows) as entry:
            if self.is_cpu:
                # a delayed-mode copy, rewritten once the jobs reading it landed (Note [chunk-wise
                # submission]); .data: its own version counter, so the rewrite of another
                # parameter in the same flat buffer does not trip a saved tensor's check
                p = entry[1].data if into is None else into.copy_(entry[1])
                return p if wait else (p, None)
            d, ev = self._copy_in(self.weights_in, entry[1], want, wait, into)
            host_weights.mark_upload(entry, ev, self.weights_in)
        return d if wait else (d, ev)

    def weight_memory(self, param, dtype, rows=None) -> torch.Tensor:
        """Memory for a parameter's working copy (or rows [start, stop) of it) on this device,
        which upload_weight(into=) fills later (Note [weights as they arrive], runtime/job.py)."""
        shape = param.shape if rows is None else (rows[1] - rows[0], *param.shape[1:])
        want = working_dtype(param, dtype)
        if self.is_cpu:
            return torch.empty(shape, dtype=want)
        with torch.cuda.stream(self.weights_in):    # as _copy_in's copies: made on the stream that fills it
            d = torch.empty(shape, dtype=want, device=self.device)
        d.record_stream(self.compute)
        return d

    def prefetch(self, key, params, dtype, host_weights, ready=None, tracer=None, attrs=None, before=None):
        """Start uploading a job's weights now, on the weights stream (double buffering); the
        uploader thread refreshes their pinned copies first. The tracer gets one span per job.
        params: [(key, parameter)], the key a parameter's index or, for rows of it, (index,
        start, stop) (Note [row weights prefetched] in runtime/job.py).

        ready(p) says whether p is free of a pending optimizer step; others are left to be
        uploaded when the job reads them, so a prefetch never blocks the job running now.
        before(), if given, runs first in the uploader thread (it may wait)."""
        if self.is_cpu or not params or key in self.prefetched:
            return

        def upload_all():
            if before is not None:
                before()
            start = tracer.cuda_mark(self.weights_in) if tracer is not None else None
            todo = [(i, p) for i, p in params if ready is None or ready(p)]
            whole = [(i, p) for i, p in todo if not isinstance(i, tuple)]
            if hasattr(host_weights, "held"):     # copies laid out flat: one copy per run
                got, copies = self._upload_runs(whole, host_weights)
            else:
                got = {i: self.upload_weight(p, dtype, host_weights, wait=False) for i, p in whole}
                copies = len(got)
            for key, p in todo:    # rows of a parameter, keyed (index, start, stop): an LM head shard's
                if isinstance(key, tuple):
                    got[key] = self.upload_weight(p, dtype, host_weights, rows=key[1:], wait=False)
                    copies += 1
            if tracer is not None:
                nbytes = sum(d.numel() * d.element_size() for d, _ in got.values())
                tracer.add(self.label, "weights_in", "prefetch_weights", start, tracer.cuda_mark(self.weights_in),
                           worker=self.worker_index, bytes=nbytes, params=len(got), copies=copies, **(attrs or {}))
            return got

        self.prefetched[key] = self.uploader.submit(upload_all)

    def _upload_runs(self, params, host_weights) -> tuple:
        """({index: (device weight, event)}, copies issued) for (index, param) pairs whose working
        copies lie in flat buffers (delayed mode's copies, a worker's shared ones): one copy per
        run of copies adjacent in host memory, the weights views of it (Note [one upload per run])."""
        got = {}
        with host_weights.held(params) as entries:
            runs = upload_runs(entries)
            for run in runs:
                src = _joined([e[1] for _, e in run])
                d, ev = self._copy_in(self.weights_in, src, src.dtype, wait=False)
                off = 0
                for i, e in run:
                    n = e[1].numel()
                    got[i] = (d[off:off + n].view(e[1].shape), ev)
                    off += n
                    host_weights.mark_upload(e, ev, self.weights_in)
        return got, len(runs)

    def take_prefetched(self, future: Future, key):
        """A weight a prefetch uploaded (compute now waits for its copy), or None."""
        got = future.result().pop(key, None)
        if got is None:
            return None
        d, ev = got
        self.compute.wait_event(ev)
        return d

    def peer_copy(self, src, ready):
        """A device-to-device copy of src (another GPU's tensor) once `ready` completed there;
        returns (copy, event that marks the end of the read of src)."""
        self.acts_in.wait_event(ready)
        with torch.cuda.stream(self.acts_in):
            d = src.to(self.device, non_blocking=True)
        d.record_stream(self.compute)
        done = torch.cuda.Event()
        done.record(self.acts_in)
        self.compute.wait_event(done)
        return d, done

    def hold(self, tensor, event):
        """Keep `tensor` (of this device) allocated until `event` (a peer's copy of it) completed."""
        with self._held_lock:
            self._held = [(t, e) for t, e in self._held if not e.query()] + [(tensor, event)]

    def can_reach(self, other) -> bool:
        """Whether a boundary activation may go from `other` to this device directly."""
        return (self.peer_transfers and other is not self and not other.is_cpu
                and torch.cuda.can_device_access_peer(self.device, other.device))

    def download(self, value, own: bool = False, into=None):
        """Device value to host memory (detached); on a GPU a Pending pinned copy, in the job's
        slots (`host_slots`, reused by a later step: Note [slot sets]) or, own=True, in a buffer
        of its own (a value the caller may keep: a call's outputs); into(shape, dtype): the host
        tensor a tensor lands in, where it gives one (Note [a call's outputs], runtime/outputs.py),
        on a CPU "device" too."""
        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            host = into(t.shape, t.dtype) if into is not None else None
            if host is None:
                if self.is_cpu:
                    return t
                host = (self.own_slots if own else self.host_slots)(t.shape, t.dtype)
            return self.download_into(t, host)
        return _map(move, value)

    def grad_accumulator(self, host_piece, own: bool = False, dtype=torch.float32):
        """The flat tensor (fp32, or `dtype`: Note [one microbatch a copy], grads.py) a job
        accumulates its parameter gradients in (Note [host gradient buffers]), uninitialised
        (Note [first gradients copied], job.py): on a CPU "device" the host piece itself where it
        has that dtype, so nothing is copied; else (or `own`: a copy of a job other than the
        first, Note [replicas]) a twin (on the device) that `download_into` brings down in one
        copy, rounded to the piece's dtype there (Note [working-dtype gradients])."""
        if self.is_cpu and host_piece.dtype == dtype and not own:
            return host_piece
        return torch.empty(host_piece.shape, dtype=dtype, device=self.device)

    def download_into(self, t, host, after: str = "compute"):
        """Device tensor t, made in stream `after`, into the host tensor `host` (same shape) with
        one copy; on a GPU a Pending (the copy is in flight on the download stream)."""
        if self.is_cpu:
            if t.data_ptr() != host.data_ptr():
                host.copy_(t)
            return host
        ready = torch.cuda.Event()
        ready.record(self.stream_named(after))
        self.out.wait_event(ready)
        with torch.cuda.stream(self.out):
            if t.dtype == host.dtype:
                host.copy_(t, non_blocking=True)
            else:
                # narrower on the host (Note [working-dtype gradients]): rounded on the device, so
                # fewer bytes cross the link, a slice at a time into one buffer (a rounded copy of
                # a whole piece would need GiBs the plan does not count); this stream orders the
                # reuse of the buffer after the slice before it came down
                flat_t, flat_h = t.view(-1), host.view(-1)
                n = flat_t.numel()
                buf = torch.empty(min(n, ROUND_SLICE), dtype=host.dtype, device=self.device)
                for a in range(0, n, ROUND_SLICE):
                    b = min(n, a + ROUND_SLICE)
                    flat_h[a:b].copy_(buf[:b - a].copy_(flat_t[a:b]), non_blocking=True)
        t.record_stream(self.out)
        done = torch.cuda.Event()
        done.record(self.out)
        return Pending(host, done)

    def generator(self):
        return torch.default_generator if self.is_cpu else torch.cuda.default_generators[self.device.index]

    @contextlib.contextmanager
    def rng_scope(self):
        """Let stage graphs reseed this device's generator; the caller's RNG state is restored after."""
        gen = self.generator()
        with _lock_for(("cpu",) if self.is_cpu else ("cuda", self.device.index)):
            state = gen.get_state()
            ops._local.reseed = lambda key, position: gen.manual_seed(stream_seed(key, position))
            try:
                yield
            finally:
                ops._local.reseed = None
                gen.set_state(state)
