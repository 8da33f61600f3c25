"""The state of one step and the context a stage job's program runs in."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import InputError, StageError
from ..plan import key_numel
from . import ops, timeline
from .device import Pending
from .flat import merge_adjacent
from .grads import accumulator_dtype, param_index


def nbytes(value) -> int:
    """Bytes of the tensors in a (tree of) values, pending downloads included."""
    total = 0
    leaves = [value] if isinstance(value, (torch.Tensor, Pending)) else \
        torch.utils._pytree.tree_leaves(value, is_leaf=lambda v: isinstance(v, Pending))
    for t in leaves:
        t = t.tensor if isinstance(t, Pending) else t
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


class Aborted(Exception):
    """Another job of the step failed; this one stops without reporting."""


@dataclass
class Microbatch:
    leaves: list                      # the call's leaves, batched ones sliced to this microbatch
    syms: dict                        # size symbol name -> value
    rows: Optional[int] = None        # dim 0 of the batched inputs' slices (None: nothing is split)
    seed: float = 1.0                 # d(batch loss) / d(this microbatch's loss output)
    scales: tuple = ()                # its scale of each cross-entropy term (Note [cross-entropy terms])
    acts: dict = field(default_factory=dict)      # activations and checkpoints on the host
    grads: dict = field(default_factory=dict)     # gradients of activations on the host
    outputs: dict = field(default_factory=dict)   # values the model returns


@dataclass
class StepState:
    """Everything one step's jobs share; jobs of different devices meet only here."""

    plan: Any
    params: list
    buffers: list
    micro: list                       # Microbatch per microbatch
    rng_base: int = 0
    dtype: Optional[torch.dtype] = None
    param_grads: dict = field(default_factory=dict)    # job index -> {param key: host grad (Note [working-dtype gradients])}
    grads: Any = None                                  # runtime.grads.GradSet the jobs download into
    done_events: dict = field(default_factory=dict)    # job index -> [threading.Event per microbatch]
    error: Optional[BaseException] = None
    host_weights: Any = None                           # runtime.weights.HostWeights
    tracer: Any = None                                 # runtime.trace.Tracer, or None
    gate: Any = None                                   # gate(param): waits for its pending optimizer step
    ready: Any = None                                  # ready(param): no pending optimizer step (non-blocking)
    loss_weights: Any = None                           # call mode: how the loss output combines
    loss_ahead: Optional[int] = None                   # call mode: the job whose backward ran in the forward run (Note [the loss's backward ahead])
    output_shares: dict = field(default_factory=dict)  # call mode: output index -> per microbatch, its share of a max/min's gradient
    param_index: dict = field(default_factory=dict)    # parameter name -> index in params
    peer: dict = field(default_factory=dict)           # (mb, name) -> (device tensor, ready event, DeviceRuntime)
    first_upload: list = field(default_factory=list)   # [(device, future)]: its first job's weights, sent before the step
    grad_need: int = 0                                 # optimizer submissions done with a gradient piece before it is written
    submission: Optional[int] = None                   # delayed mode: the optimizer's count once its submission is done
    hyper: Any = None                                  # what its update steps by (Note [hyperparameters per submission])
    buffer_index: dict = field(default_factory=dict)
    exchanges: dict = field(default_factory=dict)      # job index -> replicas.GradExchange (Note [replicas])
    call_outputs: Any = None                           # a call's: runtime.outputs.CallOutputs, where its outputs land
    device_grads: Any = None                           # grads.DeviceGrads (Note [gradients stay on the device])
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_done(self, job: int, mb: int) -> None:
        """Block until `job` has finished microbatch mb."""
        self.done_events[job][mb].wait()

    def mark_done(self, job: int, mb: int) -> None:
        """`job` finished microbatch mb: the jobs after it may read its results."""
        self.done_events[job][mb].set()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        for events in self.done_events.values():
            for e in events:
                e.set()


@dataclass
class JobLinks:
    """What a job knows of its neighbours in the chain (for prefetch and peer transfers): its
    schedule action's links (runtime/schedule.py), resolved to a stage and a device."""

    next_on_device: Any = None        # (job index, stage) this device runs next: its weights are prefetched
    next_dev: Any = None              # DeviceRuntime of the next job in the chain
    next_reads: frozenset = frozenset()    # names the next job reads
    later_reads: frozenset = frozenset()   # names any job after the next one reads
    next_here: bool = False           # the next job runs on this device (Note [hand-overs on the device])

    @classmethod
    def of(cls, action, stage_of, next_dev=None) -> "JobLinks":
        """A schedule action's links, its next job on the device given its stage (`stage_of(job)`)."""
        nxt = action.next_on_device
        return cls(next_on_device=None if nxt is None else (nxt, stage_of(nxt)), next_dev=next_dev,
                   next_reads=action.next_reads, later_reads=action.later_reads, next_here=action.next_here)


class JobContext:
    """What the ops of a stage program act on: one stage job on one device in one step.
    `handle` is what the program's ops take as `job` (Note [program ops])."""

    def __init__(self, step: StepState, job_index: int, prev_job: Optional[int], stage, role: str, dev,
                 links: Optional[JobLinks] = None, replica: int = 0, pieces: bool = False):
        self.step, self.job_index, self.prev_job = step, job_index, prev_job
        self.stage, self.role, self.dev = stage, role, dev
        self.links = links or JobLinks()
        self.replica = replica
        self.exchange = step.exchanges.get(job_index)     # Note [replicas] (runtime/replicas.py)
        self.weights: dict = {}
        # data_ptr -> (name, key, parameter, memory): weights that go up as a piece reads them
        # (Note [weights as they arrive]); only where the program's compute runs as pieces
        self.late_weights: dict = {}
        self.pieces = pieces
        self.buffers: dict = {}
        self.write_back: list = []
        self.grad_acc: dict = {}          # param key -> view of the flat accumulator
        self.grad_flat = None             # the flat accumulator (Note [host gradient buffers])
        self.grad_got: set = set()        # keys a gradient reached
        self.microbatch = None
        self._rng = None
        self._prefetch_issued = False
        self.prefetched = dev.prefetched.pop((id(step), job_index), None)
        self.handle = ops.register(self)

    def close(self):
        self.release_rng()
        self.late_weights.clear()
        ops.unregister(self.handle)

    # --- tracing ---------------------------------------------------------------------------
    def span(self, stream_name, name, fn, mb=None, **attrs):
        """Run fn() (which enqueues work on `stream_name`, or for "host" does host work) and
        record it in the step's trace."""
        tracer = self.step.tracer
        if tracer is None:
            return fn()
        attrs = {"stage": self.stage.index, "role": self.role, "job": self.job_index, "microbatch": mb,
                 "worker": self.dev.worker_index, **attrs}
        if self.dev.is_cpu or stream_name == "host":
            t0 = tracer.now()
            out = fn()
            tracer.add(self.dev.label, stream_name, name, t0, tracer.now(),
                       **({} if stream_name == "host" else {"issued": t0}), **attrs)
            return out
        stream = self.dev.stream_named(stream_name)
        start = tracer.cuda_mark(stream)
        t0 = time.perf_counter()
        out = fn()
        # issue_s: host seconds spent enqueueing the work (kernel launches under the
        # interpreter lock), beside the device seconds the events measure (Note [issue lag])
        tracer.add(self.dev.label, stream_name, name, start, tracer.cuda_mark(stream),
                   issue_s=time.perf_counter() - t0, issued=t0, **attrs)
        return out

    # --- synchronisation -------------------------------------------------------------------
    def wait(self, mb):
        self.microbatch = mb
        if self.prev_job is not None:
            self.span("host", "wait", lambda: self.step.wait_done(self.prev_job, mb), mb)
        if self.step.error is not None:
            raise Aborted()

    def done(self, mb):
        self.release_rng()
        self.step.mark_done(self.job_index, mb)

    def release_rng(self):
        if self._rng is not None:
            rng, self._rng = self._rng, None
            rng.__exit__(None, None, None)

    # --- inputs ----------------------------------------------------------------------------
    # Note [weights as they arrive]: in overlapped mode the optimizer steps the last step's
    # gradients in forward order while the next step starts, and a job may read a weight only
    # once its parameter is stepped (`StepState.gate`). The program fetches every weight its
    # compute takes before calling it, so a job whose weights were not all stepped yet waited
    # for the last of them before issuing its first kernel: one H200, Qwen3-1.7B, one fused job,
    # 0.43-0.47 s a step between the last microbatch and the next step's first, the update's
    # chunks done one after another over ~0.35 s (benchmarks/runs/overlapped_one_gpu). So a
    # weight still being stepped when the program fetches it gets its device memory only, and
    # goes up when the first piece of the compute graph that reads it is about to run
    # (runtime/programs.py `Arriving`; every program's compute runs as pieces cut at the
    # decoder layers, passes/regions.py; a graph without repeated blocks is one piece, whose
    # weights arrive together): the host waits for that parameter's step there, and the first
    # layers' kernels are issued while the optimizer steps the later ones. A piece's
    # weights are its arguments (the top of a cut graph only calls pieces), found by their
    # memory; the backward's grad leaves share it. Measured (57th session, one H200, one fused
    # job, benchmarks/runs/weights_arrive): Qwen3-1.7B 36,480 / 36,217 -> 37,450 / 38,038 tokens/s,
    # Llama's first 16 layers 9,915 -> 10,152; the GPU idle between steps 0.43 -> 0.02 s. Only the
    # first microbatch's forward runs beside the update: its backward needs the last layers'
    # weights, stepped last. Worker processes gate every weight before a run (processes.py
    # weight_table), so this is the worker threads' path.
    def weight(self, name, rows=None):
        index = self.step.param_index[name]
        key = index if rows is None else (index, *rows)
        w = self.weights.get(key)
        if w is None:
            p = self.step.params[index]
            if self.step.gate is not None:
                if self.pieces and not self.step.ready(p) and p.numel():
                    w = self.weights[key] = self.dev.weight_memory(p, self.step.dtype, rows)
                    self.late_weights[w.data_ptr()] = (name, key, p, w)
                    return w
                self.step.gate(p)
            w = None if self.prefetched is None else self.dev.take_prefetched(self.prefetched, key)
            if w is None:
                w = self._upload_weight(name, key, p)
            self.weights[key] = w
        return w

    def _upload_weight(self, name, key, p, into=None):
        """Weight `name`'s working copy (key: its index, or (index, start, stop) for rows of it)."""
        rows = key[1:] if isinstance(key, tuple) else None
        numel = self.step.plan.param_numel(key)
        itemsize = (self.step.dtype or p.dtype).itemsize if p.is_floating_point() else p.element_size()
        return self.span("weights_in", "upload_weight",
                         lambda: self.dev.upload_weight(p, self.step.dtype, self.step.host_weights, rows, into=into),
                         param=name, bytes=numel * itemsize, **({} if into is None else {"late": True}))

    def arrive(self, args):
        """The late weights among a piece's arguments go up, each once its parameter is stepped
        (Note [weights as they arrive])."""
        for a in args:
            if isinstance(a, torch.Tensor):
                late = self.late_weights.pop(a.data_ptr(), None)
                if late is not None:
                    name, key, p, memory = late
                    self.span("host", "wait_param", lambda: self.step.gate(p), self.microbatch, param=name)
                    self._upload_weight(name, key, p, into=memory)

    # Note [buffer values a recompute starts from]: a buffer the forward updates in place
    # (Plan.mutated_buffers) may be read after the update by the same forward (an EMA normaliser,
    # spectral_norm's u), so a backward job's recompute of microbatch mb must start from the
    # value mb's forward started from: the updates of the microbatches before it, not of all of
    # them. The forward job that updates it (its only stage: Note [a buffer updated in place
    # stays in one stage], passes/cut_points.py) hands that value on beside its activations,
    # under a name no graph value has, so it reaches a backward job on another device or in
    # another worker process as they do; the recompute updates a copy of it, never the host's.
    # Before, every recompute started from the host value after all the forwards, and each
    # updated it again: gradients 0.2 of the largest off eager's (tests/test_parity.py). Only
    # the buffers some node other than their updates reads need it (Plan.buffers_at_start):
    # BatchNorm's running statistics, which only the batch_norm updating them takes, do not
    # decide the recompute's outputs, and its update of a copy of the host's is dropped.
    def buffer(self, name):
        index = self.step.buffer_index[name]
        plan = self.step.plan
        mutated = index in plan.mutated_buffers    # (no other goes back: Note [buffers written back])
        at_start = index in plan.buffers_at_start
        if at_start and self.role == "bwd":
            return self._buffer_at_start(index)
        b = self.buffers.get(index)
        if b is None:
            host = self.step.buffers[index]
            b = self.dev.upload(host, self.step.dtype)
            if mutated and self.role == "bwd":
                b = b.clone() if b is host else b     # (its recompute's update is not a second one)
            elif mutated and b is not host:
                self.write_back.append((host, b))
            self.buffers[index] = b
        if at_start and self.role == "fwd":
            self.offload(self.microbatch, _at_start(index), b.detach().clone())
        return b

    def _buffer_at_start(self, index):
        value = self.step.micro[self.microbatch].acts.get(_at_start(index))
        if value is None:
            raise RuntimeError(f"internal: no forward job recorded buffer {index}'s value at the start of microbatch "
                               f"{self.microbatch} for the recompute (Note [buffer values a recompute starts from])")
        b = self.dev.upload(value, self.step.dtype)
        return b.clone() if b is value else b

    def prefetch_next(self, mb):
        """Queue the next job's weights on this device behind this job's own (once per job)."""
        if self._prefetch_issued or self.links.next_on_device is None:
            return
        self._prefetch_issued = True
        nj, nst = self.links.next_on_device
        self.span("host", "prefetch_issue", lambda: None, mb, stage=nst.index, job=nj, issued_by=self.job_index)
        allowance = self.step.plan.prefetch_bytes     # Note [resident weights]
        _prefetch(self.step, self.dev, nj, nst, allowance[self.job_index] if allowance else None)

    def fetch(self, mb, name):
        peer = self.step.peer.pop((mb, name), None)
        if peer is not None and peer[2] is self.dev:    # Note [hand-overs on the device]
            self.check_rows(mb, name, peer[0])
            return peer[0]
        if peer is not None:
            src, ready, src_dev = peer
            out = self.span("acts_in", "fetch_peer", lambda: self.dev.peer_copy(src, ready), mb, value=name,
                            bytes=nbytes(src), source=str(src_dev.device))
            src_dev.hold(src, out[1])    # the source stays allocated until the copy has read it
            return out[0]
        host = self.step.micro[mb].acts[name]
        self.check_rows(mb, name, host)
        return self.span("acts_in", "fetch", lambda: self.dev.upload(host), mb, value=name, bytes=nbytes(host))

    def user_input(self, mb, index):
        value = self.step.micro[mb].leaves[index]
        name = next((n for n, i in self.stage.input_leaf.items() if i == index and self.stage.kinds.get(n) == "input"),
                    None)
        if name is not None:
            self.check_rows(mb, name, value)
        return self.dev.upload(value, self.step.dtype)

    def check_rows(self, mb, name, value):
        """Note [batched inputs]: a batched value must have this microbatch's rows (never off)."""
        expected = self.stage.row_checks.get(name)
        value = value.tensor if isinstance(value, Pending) else value
        if expected is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return
        micro = self.step.micro[mb]
        if micro.rows is None:
            return
        want = expected(micro.rows, micro.syms)
        if value.shape[0] != want:
            raise InputError(f"{name!r} has {value.shape[0]} rows on dim 0, but stage {self.stage.index} expects {want} "
                             f"for microbatch {mb} ({micro.rows} rows of the batch): a batched value would be paired "
                             "with the wrong rows")

    def sym(self, mb, name):
        return self.step.micro[mb].syms[name]

    def rng_key(self, mb):
        # The generator is held from here (after every wait) to done(): never while waiting,
        # so CPU threads sharing one generator cannot deadlock each other.
        self._rng = self.dev.rng_scope()
        self._rng.__enter__()
        return self.step.rng_base * 1_000_003 + mb

    def fetch_grad(self, mb, name):
        peer = self.step.peer.pop((mb, ("grad", name)), None)
        if peer is not None:        # Note [hand-overs on the device]
            self.check_rows(mb, f"grad of {name}", peer[0])
            return peer[0]
        g = self.step.micro[mb].grads.get(name)
        if g is None:   # no gradient reached it: an empty tensor says so (vjp skips it)
            return torch.empty(0, device=self.dev.device)
        self.check_rows(mb, f"grad of {name}", g)
        return self.dev.upload(g)

    def loss_seed(self, mb):
        return torch.full((), self.step.micro[mb].seed, dtype=torch.float32, device=self.dev.device)

    def loss_scale(self, mb, term):
        return torch.full((), self.step.micro[mb].scales[term], dtype=torch.float32, device=self.dev.device)

    # --- outputs ---------------------------------------------------------------------------
    # Note [hand-overs on the device]: a copy's jobs (Note [replicas]), or those of a plan for
    # one device, run one after another on one device, yet a job's outputs went down to the host
    # and the next job's inputs came back up. Those uploads queued behind the weights the device
    # uploads meanwhile: Llama-3.1-8B on 2 H200s at a 4-GPU run's load (32,768 tokens, M=2, half
    # the optimizer on the devices: the 4-GPU plan's jobs a copy), the fused job's input (134 MB)
    # came up 90-113 ms after the forward job had ended, as the fused job's 8.5 GB of weights
    # finished going up, and the backward job started 105-122 ms after the fused job's sum,
    # every step on both GPUs. So what the next job reads, activations and the gradients of its
    # outputs, stays on the device (the host still gets an activation a later job reads too); the
    # solver counts those values, M of each boundary on one device where it counted two
    # (passes/partition.py). Measured at that load (52nd session, four sides each way in two
    # calls): no gap left between the jobs of a traced step, but no shorter steps either (17,527
    # against 17,428 tokens/s on average; steady steps 1.774-1.791 against 1.778-1.794 s): there
    # the host's half of the update decides when weights may go up, and the waits moved into the
    # jobs. At the default share on 2 GPUs the jobs had no such gaps (51st session's trace). Kept
    # for the traffic it saves on the host link that the devices share (2 x 134 MB a step a
    # device there); not measured at 4 GPUs (benchmarks/runs/microbatches/README.md).
    # A differentiable call's backward jobs run later, as a run of their own: what they read
    # counts as read later (build_schedule's `then`), or its forward on one device left them
    # no host copy of the boundaries they recompute from.
    def offload(self, mb, name, value):
        links = self.links
        if isinstance(value, torch.Tensor) and name in links.next_reads and (
                links.next_here or (links.next_dev is not None and links.next_dev.can_reach(self.dev))):
            # On this device the next job reads it as it is (Note [hand-overs on the device]); on
            # a peer (Config.peer_transfers) it copies it device to device. The host gets a copy
            # only if a later job (a backward's checkpoint) reads it too.
            ready = None
            if not links.next_here:
                ready = torch.cuda.Event()
                ready.record(self.dev.compute)
            self.step.peer[(mb, name)] = (value.detach(), ready, self.dev)
            if name not in links.later_reads:
                return
        self.step.micro[mb].acts[name] = self.span("out", "offload", lambda: self.dev.download(value), mb,
                                                   value=name, bytes=nbytes(value))

    def output(self, mb, name, value):
        outs = self.step.call_outputs
        self.step.micro[mb].outputs[name] = self.dev.download(value, own=True,
                                                              into=outs and outs.into(mb, name))

    def offload_grad(self, mb, name, value):
        if value is None:
            return
        grads = self.step.micro[mb].grads
        if grads.get(name) is not None:     # (None: a gradient dropped, Note [the loss's backward ahead] in runner.py)
            # another job's part of this gradient (a value read by two jobs, such as the hidden
            # state the LM head's shards share): added on the device, so the sum comes down in
            # one copy and this thread goes on issuing; summed on the host, it waited for this
            # part's download and copied the sum into another slot
            value = value + self.dev.upload(grads[name])
        links, key = self.links, ("grad", name)
        if links.next_here and key in links.next_reads and key not in links.later_reads:
            self.step.peer[(mb, key)] = (value.detach(), None, self.dev)    # Note [hand-overs on the device]
            return
        grads[name] = self.dev.download(value)

    def accumulate_grads(self, grads):
        got = [(key, g) for key, g in zip(self.stage.grad_params, grads) if g is not None]
        if not got:
            return
        if self.grad_flat is None:
            self._start_grads()
        # a key's first gradient is copied in, the next ones added (Note [first gradients copied])
        first = [(key, g) for key, g in got if key not in self.grad_got]
        more = [(key, g) for key, g in got if key in self.grad_got] if first else got

        def add():      # (device work on the compute stream, traced as such: Note [gradients added per microbatch])
            if first:
                torch._foreach_copy_([self.grad_acc[key] for key, _ in first], [g for _, g in first])
            if more:
                torch._foreach_add_([self.grad_acc[key] for key, _ in more], [g for _, g in more])
        self.span("compute", "add_gradients", add, self.microbatch)
        self.grad_got.update(key for key, _ in first)

    # Note [first gradients copied]: a job's first gradients went into a zeroed accumulator with
    # an add: on a GPU the zeros and the add's read of them are two passes over the piece (fp32:
    # 6.8 GB on Qwen3-1.7B) that add nothing, every step, and a copy of one microbatch (a 4-GPU
    # run of 65,536 tokens at M=4) has no other microbatch to add. So the accumulator starts
    # uninitialised and each key's first gradient is copied in (widened as the add did). What no
    # gradient reached stays unwritten, and nothing reads it: the step's gradients are the keys
    # a gradient reached (`grad_got`), and the optimizer, the gradient norm and `param.grad` read
    # those only (a test fills the host set with NaN first). Where each copy runs two
    # microbatches (2 H200s, Qwen3-1.7B, 65,536 tokens at M=4) tokens/s were unchanged (88,602
    # -> 88,272, one run each side); with one a copy see Note [one microbatch a copy] (grads.py).
    def _start_grads(self):
        """The flat accumulator, uninitialised (Note [first gradients copied]); on a CPU device
        it is this job's host piece, so the parameters of the piece are gated first (Note [host
        gradient buffers])."""
        gate, params = self.step.gate, self.step.params
        if gate is not None:
            for key in self.stage.grad_params:
                gate(params[param_index(key)])
        grads = self.step.grads
        piece = grads.piece(self.stage.index)
        dtype = accumulator_dtype(self.step, self.exchange.n if self.exchange is not None else 1)
        if self.exchange is not None:     # Note [replicas]: the exchange says where a copy accumulates
            self.grad_flat = self.exchange.accumulator(self.replica, self.dev, piece, self._wait_piece_free, dtype)
        else:
            if self.dev.is_cpu:
                self._wait_piece_free()
            if self._grads_stay():     # (every parameter of the piece gated above)
                self.grad_flat = self.step.device_grads.accumulator(self.dev, piece, dtype)
            else:
                self.grad_flat = self.dev.grad_accumulator(piece, dtype=dtype)
        self.grad_acc = grads.views(self.stage.index, self.grad_flat)

    def _grads_stay(self) -> bool:
        """Whether this job's gradients stay on its device for the optimizer (Note [gradients
        stay on the device], grads.py)."""
        kept = self.step.device_grads
        return kept is not None and self.exchange is None and kept.device == self.dev.device

    def _wait_piece_free(self):
        """Before this job writes its piece of the host gradient buffer: the optimizer
        submissions before this step are done with it (Note [one gradient set])."""
        if self.step.grad_need:
            self.span("host", "wait_grad_piece",
                      lambda: self.step.grads.wait_free(self.stage.index, self.step.grad_need))

    # Note [buffers written back]: a job copies back to the host only the buffers the plan
    # found updated in place (running statistics: Plan.mutated_buffers). The copy into the
    # user's (pageable) buffer waits for the device, so the job that read one (the rotary
    # inv_freq of Qwen3 and Llama, in the job computing the rotary embedding) held its worker
    # thread there until the GPU had run all it issued, and only then issued its tail (the
    # replicas' sum, the gradients' download) and told the main process it had ended: the
    # next step's work was queued after the GPU went idle instead of behind the running step
    # (py-spy, 2 H200s, Qwen3-1.7B, replicas: a worker's job thread sat in that copy for 315
    # of 1,176 samples). Without it a job ends while its GPU still computes, before its loss
    # is down, so the loss must not wait for the job's landing (Note [outputs before the
    # landing], worker.py). Measured, both together against neither, one run each side (40th session,
    # delayed): 32,768 tokens/step at M=2 (one microbatch a copy: a 4-GPU run's load per GPU)
    # steady step 0.397 -> 0.378 s, 81,825 -> 83,485 tokens/s, busy 92% -> 97%; the 2-GPU bar's
    # 65,536 at M=4 0.735 -> 0.714 s, 88,040 -> 89,479 tokens/s, idle between steps 12-25 ->
    # 0-7 ms. The copy alone left out was slower (73,261 against 81,943 tokens/s): the loss
    # then waited for the gradients' download.
    def finish(self):
        """End of the job: gradients and updated buffers go to the host."""
        for host, dev in self.write_back:
            with torch.no_grad():
                host.copy_(dev)
        if self.exchange is not None:
            self._finish_replica()
        elif self.grad_got:
            grads = self.step.grads
            split = self._grads_stay() and self.step.device_grads.split(grads.layout, self.stage.index,
                                                                         self.grad_flat, self.grad_got)
            if split:
                self.step.param_grads[self.job_index] = self._grads_kept(*split)
                return
            piece = grads.piece(self.stage.index)
            if not self.dev.is_cpu:
                self._wait_piece_free()
            down = self.span("out", "download_grads", lambda: self.dev.download_into(self.grad_flat, piece),
                             bytes=piece.numel() * piece.element_size())
            views = grads.host_views(self.stage.index)
            # One copy brings every gradient down: they share its completion event.
            self.step.param_grads[self.job_index] = {
                key: Pending(views[key], down.event) if isinstance(down, Pending) else views[key]
                for key in self.stage.grad_params if key in self.grad_got}

    def _grads_kept(self, here: dict, rest: list) -> dict:
        """Note [gradients stay on the device] (grads.py): the gradients of the parameters
        stepped elsewhere (keys `rest`) come down (a copy per run of adjacent ones), the others
        stay in the accumulator (`here`); every entry completes with the last copy (which
        follows the compute), or without one with the compute."""
        views = self.step.grads.host_views(self.stage.index)
        done = None
        for host, dev in zip(*merge_adjacent([views[key] for key in rest], [self.grad_acc[key] for key in rest])):
            down = self.span("out", "download_grads", lambda: self.dev.download_into(dev, host),
                             bytes=host.numel() * host.element_size())
            done = down.event if isinstance(down, Pending) else None
        if done is None and not self.dev.is_cpu:
            done = torch.cuda.Event()
            done.record(self.dev.stream_named("compute"))
        out = {**here, **{key: views[key] for key in rest}}
        return out if done is None else {key: Pending(v, done) for key, v in out.items()}

    def _finish_replica(self):
        """This copy's slice of the gradients, summed over the copies of the job, comes down
        into its slice of the host piece (Note [replicas])."""
        ex, grads = self.exchange, self.step.grads
        # (none in a forward job, and a call without autograd has no gradient set at all)
        here = grads is not None and self.stage.index in grads.layout.stages
        piece = grads.piece(self.stage.index) if here else None
        if piece is not None:
            self._wait_piece_free()     # (before the copies meet: Note [replicas in worker processes])
        got = self.span("host", "wait_replicas", lambda: ex.share(self.replica, self.grad_flat, self.grad_got,
                                                                 self.dev, self.step,
                                                                 0 if piece is None else piece.numel()))
        if got is None:
            raise Aborted()
        if not got:
            return
        lo, hi = ex.bounds(self.replica, piece.numel())
        total = self.span(ex.stream_name, "sum_replicas", lambda: ex.reduce(self.replica, self.dev, piece.numel()),
                          bytes=ex.received_bytes(self.replica, piece.numel()), kept=ex.kept is not None)
        down = self.span("out", "download_grads",
                         lambda: self.dev.download_into(total, piece[lo:hi], after=ex.stream_name),
                         bytes=(hi - lo) * piece.element_size())
        done = ex.landed(down, self.dev)
        if done is False:
            return
        views = grads.host_views(self.stage.index)
        # the last copy's event follows every copy's download: they share it
        self.step.param_grads[self.job_index] = {key: views[key] if done is None else Pending(views[key], done)
                                                 for key in self.stage.grad_params if key in got}


# Note [row weights prefetched]: a job reads an LM head shard's rows of the head's weight
# (Stage.param_slices), and a prefetch took only whole parameters (Stage.params), so the rows
# went up as the job read them, with its compute waiting: on 2 H200s (Llama-3.1-8B, 32,768
# tokens, M=2) two 525 MB copies of 10-37 ms at the start of every fused job, in the M=8 plan
# before its first compute. So a job's weights are its parameters and the rows it reads of
# others, each keyed as the job asks for it ((index, start, stop) for rows). Checked on one H200
# (52nd session, benchmarks/runs/row_prefetch/check.py: a tiny Qwen3 in 4 jobs, the head in 2
# shards, fp32 exact mode): as eager PyTorch, and the last step's weights all went up in its 4
# prefetches, where main (f3a5dfb) read the 2 shards' rows with the compute waiting; the speed
# at Llama-3.1-8B's size is not measured.
def _at_start(index: int) -> str:
    """The activation name of buffer `index`'s value at a microbatch's start (Note [buffer values
    a recompute starts from]); a space keeps it apart from every graph value's name."""
    return f"buffer {index} at start"


def job_params(params, stage) -> list:
    """[(key, parameter)] of the weights a stage reads: whole parameters, then rows of them."""
    rows = sorted(set(stage.param_slices.values()))
    return [(i, params[i]) for i in stage.params] + [(key, params[key[0]]) for key in rows]


def _prefetch(step: StepState, dev, job_index: int, stage, limit=None) -> None:
    """Queue a job's weights (Note [row weights prefetched]); with `limit`, only its first
    weights of at most that many bytes (in the dtype they go up in): the others go up when the
    job reads them."""
    params = job_params(step.params, stage)
    if limit is not None:
        kept, total = [], 0
        for i, p in params:
            total += key_numel(p.shape, i) * (step.dtype or p.dtype).itemsize
            if total > limit:
                break
            kept.append((i, p))
        params = kept
    dev.prefetch((id(step), job_index), params, step.dtype,
                 step.host_weights, step.ready, step.tracer, {"stage": stage.index, "job": job_index})


def run_job(step: StepState, job_index: int, prev_job, stage, role: str, dev, program,
            links: Optional[JobLinks] = None, microbatches=None, replica: int = 0) -> None:
    """Run one stage job over every microbatch (or, for a copy of it, `microbatches`: Note
    [replicas]); failures are recorded on the step."""
    ctx = None
    try:
        # This job's weights, unless the job before it on this device already queued them.
        _prefetch(step, dev, job_index, stage)
        ctx = JobContext(step, job_index, prev_job, stage, role, dev, links, replica,
                         pieces=getattr(program, "weights_arrive", False))
        with torch.enable_grad() if role != "fwd" else torch.no_grad():
            for mb in (range(len(step.micro)) if microbatches is None else microbatches):
                program.forward(ctx.handle, mb)   # not program(...): see ops.compute
            ctx.finish()
    except Aborted:
        pass
    except BaseException as exc:  # reported in the caller's thread by the executor
        mb = ctx.microbatch if ctx is not None else None
        err = StageError(f"stage {stage.index} ({role}) on {dev.label}, microbatch {mb}: {type(exc).__name__}: {exc}",
                         stage=stage.index, microbatch=mb, device=dev.label, job=job_index, worker=dev.worker_index)
        err.__cause__ = exc
        step.fail(err)
    finally:
        if ctx is not None:
            ctx.close()
        timeline.mark_early("job", "job {} ({}) on {} ended", job_index, role, dev.label)
