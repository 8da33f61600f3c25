"""Overlapped host optimizer: steps parameters in a thread while the devices go on.

Note [overlapped optimizer]: after a step's gradients have landed, `train_step` hands them
here and returns. This thread clips them (global norm, if asked), then steps the user's
optimizer chunk by chunk in the order the next forward reads the parameters, refreshes each
chunk's working copies, and marks the chunk ready; the next step's jobs wait only for the
parameters they read. Per-parameter optimizers (SGD, Adam, AdamW, ...) give exactly the results
of `clip; opt.step(); sched.step()`.

Note [hyperparameters per submission]: the thread read `optimizer.param_groups` as it stepped each
chunk, while the caller's thread went on: a learning rate set right after train_step returned (a
user's own schedule, `g["lr"] = ...` as eager sets it after `opt.step()`) reached the later chunks
of the update still running, the earlier ones not (SGD with momentum, 4 steps: parameters 0.25 off
eager's, silently). So the groups' hyperparameters are copied in the caller's thread before
train_step returns (`take_hyperparameters`: at the submission, or for a step whose backward jobs
run on, delayed mode's Note [overlapped steps], when it returns), and its update is stepped by
that copy (FlatStepper.step's `groups`): a change made after train_step returns reaches the next
update, as eager's does. The attached LR scheduler steps there too, right after the copy (it only
writes the groups' rates, which no update reads any more): where it stepped in this thread after
the update, `get_last_lr()` read after train_step was the step before's until the update ended,
and its write raced the user's. A step that fails after that takes the scheduler's step back
(`take_back`), as a failed step leaves the optimizer's state.

Note [few calls per step]: this thread shares the interpreter lock with the worker threads
that launch the devices' kernels. Every torch call from Python gives the lock up and takes it
back, and taking it back while a worker runs Python costs up to the switch interval (5 ms).
So a step here makes a few calls over lists of tensors (one wait per job's downloads, one
`_foreach_norm`, one `optimizer.step()` per chunk, one `_foreach_copy_` per chunk's
refresh), never a call per parameter: on 4 GPUs a per-parameter loop made the host AdamW of
Qwen3-1.7B take 1.5-2.3 s a step, and every delayed-mode step waited for it (38.9K tokens/s,
against 87.3K with the optimizer step left out).

Note [optimizer spans]: where a share of the update steps on the devices (Note [optimizer state
on the devices], runtime/flat.py), this thread's work there runs beside the jobs' (on its own
streams; with worker processes in another CUDA context, which the GPU time-slices with the
worker's). Each submission records it as spans, as a step's tracer does a job's: per slice the
gradient's upload and the twin's step ("step_on_device"), the stepped masters' copy down
("masters_down") and, per refresh, the working copies' ("copies_down"); `device_spans` keeps the
last submissions' and `GraphRunner.recent_traces` puts them on the steps' clock, so a trace shows
what of the update ran beside which microbatch. Off unless `trace` is set (the benchmark
harness sets it with a trace directory): a few events and reads per slice, some hundreds of
calls a step for Llama-3.1-8B, each of which may wait for the interpreter lock (Note [few calls
per step]).
"""
from __future__ import annotations

import copy
import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass

try:
    import resource
except ImportError:             # not a Unix: _switched says 0
    resource = None

import torch

from ..errors import StepAbandoned
from . import timeline
from .flat import FlatMasters, FlatStepper
from .grads import settled
from .trace import Tracer


class OverlappedOptimizer:
    def __init__(self, optimizer, *, lr_scheduler=None, max_grad_norm=None, chunks: int = 32,
                 state_devices=(), on_devices: float = 0.0):
        self.optimizer, self.lr_scheduler, self.max_grad_norm = optimizer, lr_scheduler, max_grad_norm
        self.chunks = chunks
        # Note [flat host optimizer]; Note [optimizer state on the devices] (runtime/flat.py)
        self.masters = FlatMasters(state_devices, on_devices)
        self.stepper = FlatStepper(optimizer, self.masters)
        self._ready: dict = {}                  # id(param) -> threading.Event
        # (a SimpleQueue: the finalizer puts the end here from any thread: Note [an optimizer
        # thread that lets its optimizer go])
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._completed = 0                     # submissions stepped (or failed)
        self._completed_cond = threading.Condition()
        self._error = None
        self._failed = None                     # the Hyperparameters of _error's submission (None: not a submission's)
        self.abandoned: dict = {}               # submission number -> parameters stepped before its step failed
        self.timings: list = []                 # per submission: seconds in grads / clip / step / refresh
        self.trace = False                      # record device_spans (Note [optimizer spans])
        self.device_spans: list = []            # the last submissions' (tracer.t0, spans)
        self.trace_error = None                 # why a submission's spans could not be read
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._queue),
                                        name="rpcompile-optimizer", daemon=True)
        self._thread.start()
        # Ended when this goes, or joined at exit while the interpreter is whole (see executor._stop).
        weakref.finalize(self, _stop_thread, self._queue, self._thread)

    def flatten(self, params, share: float = 0.0) -> None:
        """Move the trainable host parameters, in this order, into flat buffers (Note [flat host
        optimizer]), the first ones with `share` of them on the devices (Note [optimizer state on
        the devices]); the caller's thread, with no submission in flight."""
        if not self.masters.covers([p for p in params if p.requires_grad]):
            self.synchronize()
            self.masters.choose(share)
            self.masters.flatten(params)

    def bring_home(self) -> None:
        """The optimizer state on the devices back on the host (FlatStepper.bring_home)."""
        self.synchronize()
        self.stepper.bring_home()

    def _event(self, p):
        ev = self._ready.get(id(p))
        if ev is None:
            ev = self._ready[id(p)] = threading.Event()
            ev.set()
        return ev

    def prepare(self, params, host_buffers=()) -> None:
        """Queue FlatStepper.prepare (Note [ready before the first step] in runtime/flat.py): this
        thread does it before the next submission; not a submission (wait_completed does not
        count it), and a failure is raised by the next call as a step's would be."""
        params, host_buffers = list(params), list(host_buffers)
        self._queue.put(("ready for the first step", lambda: self.stepper.prepare(params, host_buffers)))

    def wait_param(self, p):
        """Block until the pending optimizer step of `p` is done."""
        self._event(p).wait()
        if self._error is not None:
            raise RuntimeError(f"the overlapped optimizer step failed: {self._error}") from self._error

    def is_ready(self, p) -> bool:
        """True when `p` has no pending optimizer step (never blocks)."""
        return self._event(p).is_set()

    def submit(self, params: list, grads, refresh=None, others=(), chunks=None, on_done=None, masters="each",
               hyper=None):
        """Step `params` (in use order) with `grads()`, a callable run in this thread that
        returns their gradients (a list aligned with params, in their dtypes), or, where it has
        `grads.chunk(k)` (runtime/submission.py), chunk k's gradients one chunk at a time (which
        may raise StepAbandoned: the submission then stops, the chunks stepped before kept, and
        `abandoned[its number]` lists their parameters). refresh(list of
        params) after each chunk is stepped (an empty chunk too), and for `others` (parameters
        without a gradient). chunks: how many optimizer steps the parameters are cut into
        (default: self.chunks), or the list of their lengths. on_done(): after the submission,
        whether it succeeded or failed. masters: when the masters stepped on the devices come
        down (FlatStepper.step): "each" before each chunk is ready, "last" after the last chunk's
        refresh (Note [masters down after the copies], runtime/flat.py), "kept" when something
        reads them (`synchronize`, a failure: Note [masters kept on the devices]). hyper: the
        hyperparameters it steps by (take_hyperparameters; taken now by default)."""
        self.raise_if_failed()
        for p in params:
            self._event(p).clear()
        hyper = hyper or self.take_hyperparameters()
        self._queue.put((list(params), grads, refresh, list(others), chunks or self.chunks, on_done, masters, hyper))

    def take_hyperparameters(self) -> "Hyperparameters":
        """The param groups as they are now, for a step's update, and the attached scheduler's
        step after it (Note [hyperparameters per submission]); the caller's thread."""
        hyper = Hyperparameters(_groups_now(self.optimizer))
        sched = self.lr_scheduler
        if sched is not None:
            before = (copy.deepcopy(sched.state_dict()), _groups_now(self.optimizer, params=False))
            # (what optimizer.step() sets for the scheduler, which warns of a step before it: the
            # update this step follows is taken, and is stepped by twins, not optimizer.step())
            self.optimizer._opt_called = True
            sched.step()
            hyper.schedule = (*before, _groups_now(self.optimizer, params=False))
        return hyper

    def take_back(self, hyper) -> None:
        """A step whose update failed or never came: the scheduler's step taken with `hyper` is
        taken back, and the rates it wrote where nothing wrote them since (the caller's thread)."""
        if hyper is None or hyper.schedule is None or self.lr_scheduler is None:
            return
        (state, rates, stepped), hyper.schedule = hyper.schedule, None
        self.lr_scheduler.load_state_dict(state)
        for group, was, set_ in zip(self.optimizer.param_groups, rates, stepped):
            for key, v in was.items():
                now, then = group.get(key), set_.get(key)
                if isinstance(now, torch.Tensor) and isinstance(then, torch.Tensor):
                    if torch.equal(now, then):
                        now.copy_(v)        # (a scheduler fills a tensor rate in place)
                elif key in set_ and now == then:
                    group[key] = v

    def wait_completed(self, count: int, raise_errors: bool = True):
        """Block until at least `count` submissions have been stepped (and raise a failure of
        theirs here, unless raise_errors is False: it is then left for the caller's thread)."""
        with self._completed_cond:
            self._completed_cond.wait_for(lambda: self._completed >= count)
        if raise_errors:
            self.raise_if_failed()

    def synchronize(self):
        """Wait until every submitted step is done and the host's masters are current (before
        reading parameters or optimizer state: Note [masters kept on the devices])."""
        if threading.current_thread() is self._thread:
            return      # (a state_dict pre-hook reached from a step of this thread: waiting would hang)
        self.drain()
        if self.stepper.masters_away:        # (brought down by this thread, whose streams stepped them)
            self._queue.put(("masters down", self.stepper.masters_down))
            self.drain()
        self.raise_if_failed()

    def drain(self) -> None:
        """Wait until this thread has done everything queued so far (it takes them in order)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    @property
    def masters_away(self) -> bool:
        """Whether host masters are stale: stepped on a device, kept there (synchronize brings them)."""
        return self.stepper.masters_away

    def raise_if_failed(self):
        if self._error is not None:
            err, self._error = self._error, None
            self.take_back(self._failed)
            raise RuntimeError(f"the overlapped optimizer step failed: {err}") from err

    def _take(self, item) -> bool:
        """This thread's work on one queued item (_serve); whether it was a submission."""
        if isinstance(item, threading.Event):   # (drain)
            item.set()
            return False
        if len(item) == 2:          # (prepare, or the kept masters' way down: not a submission)
            what, call = item
            t0 = time.perf_counter()
            said, marked = _NOT_A_STEP[what]
            try:
                call()
                if marked:
                    timeline.mark(what, time.perf_counter() - t0)
            except BaseException as exc:     # (raised by the next call: say what it was)
                self._error, self._failed = RuntimeError(said.format(exc)), None
                self._error.__cause__ = exc
            return False
        self._run(*item)
        return True

    def _count_completed(self) -> None:
        with self._completed_cond:
            self._completed += 1
            self._completed_cond.notify_all()

    def _tracer(self):
        """A Tracer of this submission's work on the devices, or None without a share there."""
        devices = list(dict.fromkeys(self.masters.state_devices)) if self.trace and self.masters.on_devices else []
        if not devices:
            return None
        try:   # (the start events on this thread's own streams: idle between submissions, each waited for)
            return Tracer(devices, clock_stream=self.stepper._stream)
        except Exception as exc:  # noqa: BLE001 - an instrument: the step goes on untraced
            self.trace_error = f"{type(exc).__name__}: {exc}"
            return None

    def _keep_spans(self, tracer) -> None:
        """The submission's spans into device_spans; an instrument's failure fails no step (it
        is kept in trace_error)."""
        try:
            self.device_spans = (self.device_spans + [(tracer.t0, tracer.spans())])[-4:]
        except Exception as exc:  # noqa: BLE001 - the step itself is done
            self.trace_error = f"{type(exc).__name__}: {exc}"

    def _run(self, params, grads, refresh, others, chunks, on_done, masters, hyper):
        stepped: list = []
        tracer = self.stepper.tracer = self._tracer()
        failed = True
        try:
            self._step(params, grads, refresh, chunks, stepped, masters, hyper.groups)
            if refresh is not None and others:
                refresh(others)
            failed = False
            if tracer is not None:     # (every span's work is done: the steps waited for their streams)
                self._keep_spans(tracer)
        except StepAbandoned:         # the step failed: its error is raised by the runner
            self.abandoned[self._completed + 1] = stepped
        except BaseException as exc:  # surfaced in the caller's thread by the next call
            self._error, self._failed = exc, hyper
        finally:
            try:
                # the working copies land before the submission is done (Note [chunks within a
                # piece], runtime/submission.py); where it failed, the masters kept on the devices
                # come down (Note [masters kept on the devices])
                self.stepper.copies_landed()
                if failed:
                    self.stepper.masters_down()
            except BaseException as exc:  # noqa: BLE001 - the step's own failure is the one to raise
                if self._error is None:
                    self._error, self._failed = exc, hyper
            self.stepper.tracer = None
            for p in params:
                self._event(p).set()
            if on_done is not None:
                on_done()

    def _step(self, params, grads, refresh, chunks, stepped, masters, groups):
        t0, cpu0, switched0 = time.perf_counter(), time.process_time(), _switched()
        by_chunk = getattr(grads, "chunk", None) if self.max_grad_norm is None else None
        if by_chunk is None:      # (the global norm needs every gradient first)
            grads = grads()
        t1 = time.perf_counter()
        if self.max_grad_norm is not None and grads:
            # in fp32 whatever the gradients' dtype (Note [working-dtype gradients])
            scale = min(1.0, float(self.max_grad_norm) / (_global_norm(grads) + 1e-6))
            if scale < 1.0:
                torch._foreach_mul_(grads, scale)
                settled(grads)    # (before the steps' own streams read them: Note [gradients stay on the device])
        t2 = time.perf_counter()
        step_s = refresh_s = 0.0
        if isinstance(chunks, int):
            size = max(1, -(-len(params) // max(1, chunks)))
            chunks = [min(size, len(params) - start) for start in range(0, len(params), size)]
        start, grads_s = 0, t1 - t0
        try:
            for k, n in enumerate(chunks):
                chunk = params[start:start + n]
                if by_chunk is None:
                    chunk_grads = grads[start:start + n]
                else:
                    w = time.perf_counter()
                    chunk_grads = by_chunk(k)
                    grads_s += time.perf_counter() - w
                start += n
                a = time.perf_counter()
                if chunk:
                    # Note [masters down after the copies]; Note [hyperparameters per submission]
                    self.stepper.step(chunk, chunk_grads, masters, groups)
                    stepped.extend(chunk)
                b = time.perf_counter()
                if refresh is not None:
                    refresh(chunk)
                for p in chunk:
                    self._event(p).set()
                step_s += b - a
                refresh_s += time.perf_counter() - b
        finally:      # (a failed submission too: the chunks it stepped keep their step, masters included)
            if masters != "kept":     # (kept ones come down where it failed: _run)
                a = time.perf_counter()
                self.stepper.masters_down()
                step_s += time.perf_counter() - a
        # cpu_s and switched: the process's CPU seconds and involuntary context switches over the
        # update (all its threads, its intra-op pool's above all): a core lost to another process
        # lowers the first and raises the second, a slower memory does neither (RESULTS.md, 45th session)
        self.timings = (self.timings + [{"grads_s": grads_s, "clip_s": t2 - t1, "step_s": step_s,
                                         "refresh_s": refresh_s, "total_s": time.perf_counter() - t0,
                                         "cpu_s": time.process_time() - cpu0,
                                         "switched": _switched() - switched0}])[-16:]
        timeline.mark_early("optimizer", "optimizer step done", seconds=self.timings[-1]["total_s"])


# what the optimizer thread does that is no submission: (what its failure says, whether the setup
# timeline marks it: once, not at every synchronize)
_NOT_A_STEP = {
    "ready for the first step": ("preparing its first step (the masters on the devices, page-locked host "
                                 "buffers), before any parameter was stepped: {}", True),
    "masters down": ("bringing the masters stepped on the devices down to the host (Note [masters kept on the "
                     "devices]); the steps were done: {}", False),
}


@dataclass
class Hyperparameters:
    """What one step's update steps by (Note [hyperparameters per submission])."""
    groups: list                  # the param groups as they were: dicts of their own
    schedule: tuple = None        # (the scheduler's state, the rates) before its step, the rates after


def _groups_now(optimizer, params: bool = True) -> list:
    """The param groups as they are now: each a dict of its own, its parameter list and tensor
    values (a tensor lr) copied; params=False: without the parameters (what an LR scheduler
    writes)."""
    return [{k: (list(v) if k == "params" else v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in g.items() if params or k != "params"} for g in optimizer.param_groups]


def _global_norm(grads) -> float:
    """The 2-norm of all `grads`, in fp32 whatever their dtype, summed over the devices they lie
    on (the host and, Note [gradients stay on the device], one GPU)."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = [float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32))))
             for gs in by_device.values()]
    return norms[0] if len(norms) == 1 else math.sqrt(sum(n * n for n in norms))


def _switched() -> int:
    """Involuntary context switches of this process's threads so far (0 where not known)."""
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    except (AttributeError, OSError):     # (no resource module: not a Unix)
        return 0


# Note [an optimizer thread that lets its optimizer go]: the optimizer thread ran a bound method of
# its OverlappedOptimizer, so the thread held it, and with it the user's optimizer, its state and
# every parameter, for the life of the process: a compiled model dropped (`del cm, model, opt`, a
# notebook's second run) kept them all, and its thread, whose finalizer never ran (two such
# threads after two models, parameters and optimizer alive after `del` and a collection). The
# thread holds it only while it works on an item (_serve), so it goes with the compiled model; its
# finalizer then ends the thread. That finalizer may run in any thread in the middle of anything
# (Note [finalizers take no lock] in shared.py), so the queue is a SimpleQueue, and synchronize
# waits for a marker put behind what is queued (drain) in place of Queue.join.
def _serve(ref, q) -> None:
    """The optimizer thread: each queued item done by the OverlappedOptimizer `ref` refers to, held
    only meanwhile (see the Note); ends at None or once it is gone."""
    while True:
        item = q.get()
        this = ref() if item is not None else None
        if this is None:
            return
        submission = this._take(item)
        # The item (a submission's gradients, and the step they come from) is dropped before the
        # submission counts as done, and the optimizer before waiting for the next.
        item = None
        if submission:
            this._count_completed()
        this = None


def _stop_thread(q, thread):
    q.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=10)
