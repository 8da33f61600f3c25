"""The dispatcher with one worker process per device (Config(workers="processes")).

The main process keeps what the user holds (parameters, optimizer, gradients) and the plans;
the worker processes (runtime/worker.py, Note [worker processes]) run the stage jobs. This
executor has the interface of runtime/executor.py's: `run(step, schedule, ...)` sends the
run's schedule and inputs, waits until every job has ended, puts the gradients, outputs and
updated buffers where the runner expects them, and raises the first failure here.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import pickle
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait as wait_connections
from typing import Optional

import torch

from ..errors import RPCompileError, StageError, StepAbandoned
from . import portable, timeline, warmup
from .device import Pending
from .launcher import start_worker
from .programs import compiles_stages
from .schedule import Schedule
from .shared import SharedMemory, SlotSets, drained
from .weights import working_dtype
from .worker import accept, decode, micro_desc, recv, send, serve_socket

START_TIMEOUT_S = 300
RESTART = "compile the model again (rpcompile.compile) to start new worker processes"


class WorkerDied(RPCompileError):
    """A worker process ended while the main process needed it."""


class _RemoteDevice:
    """What the modes may ask of a device that lives in a worker process. A job's weights are
    uploaded by the worker itself; only the next step's first job's weights are asked for ahead
    (delayed mode, as with worker threads): the worker gets a "prefetch" message."""

    is_cpu = True

    def __init__(self, device, executor, index):
        self.device, self.index = device, index
        self._executor = weakref.ref(executor)
        self.prefetched: dict = {}

    def prefetch(self, key, params, dtype, host_weights, ready=None, tracer=None, attrs=None, before=None):
        executor = self._executor()
        if executor is not None and key not in self.prefetched:
            self.prefetched[key] = executor.send_prefetch(self.index, params, dtype, host_weights, before)


class _Slot:
    def __init__(self, dev):
        self.dev = dev


def _visible(index: int) -> str:
    """The physical GPU behind cuda:index of this process (CUDA_VISIBLE_DEVICES may remap)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    return visible.split(",")[index].strip()


def _kill_unconnected(procs, server, path):
    """Worker processes started early that never got their part (Note [early workers])."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    server.close()
    if os.path.exists(path):
        os.unlink(path)


def _stop(hub, memory):
    """Note [stopped with a step in flight]: a step still running when the executor goes (an
    exit without cm.synchronize() in delayed mode) cannot end: a worker reads no message after
    "stop", so a job waiting for a hand-over, or for a gradient piece the optimizer thread
    holds while it waits for a job to land, waits for ever. The workers got 10 s each and the
    optimizer thread 10 more: such an exit took 21 s more than one after synchronize (2 CPU
    workers). With a run in flight the workers get 1 s, and every landing still waited for is
    marked failed, so the optimizer thread abandons its submission and ends."""
    hub.stopping = True
    busy = bool(hub.runs)
    for conn, lock in zip(hub.conns, hub.locks):
        # A finalizer, so its thread may be the one holding `lock`, halfway through a message (Note
        # [finalizers take no lock] in shared.py): then no "stop"; the worker ends as well when its
        # connection closes below.
        if not lock.acquire(timeout=1.0):
            continue
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
        finally:
            lock.release()
    deadline = time.monotonic() + (1 if busy else 10)
    for p in hub.procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    if busy:
        hub.die("the worker processes were stopped (the compiled model went, or the interpreter exited) "
                "while a step's jobs ran", lock=False)
    for conn in hub.conns:
        conn.close()
    memory.close()


class ProcessExecutor:
    """Worker processes for the devices of a Config, and the round-robin offset."""

    def __init__(self, config):
        self.config = config
        self.memory = SharedMemory()
        self.slot_sets = SlotSets()        # Note [slot sets] (runtime/shared.py)
        self.workers = [_Slot(_RemoteDevice(d, self, i)) for i, d in enumerate(config.devices)]
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="rpcompile-prefetch")   # send_prefetch
        self.offset = 0
        self.last_schedule: Optional[Schedule] = None
        self._ids = itertools.count(1)
        self._plans: dict = {}         # id(plan) -> (plan key, plan): sent to the workers
        self._tables: dict = {}        # tuple of Refs -> table key
        self._grad_sets: dict = {}     # id(GradSet) -> (key, GradSet, the names of its files)
        self.hub: Optional[_Hub] = None    # started at the first run: a model that never runs costs no process
        self._early = None                 # (server, path, token, procs, finalizer): processes started by `prestart`
        self.counters: Optional[torch.Tensor] = None   # the workers' hand-over counters (runtime/handover.py)

    @property
    def broken(self) -> Optional[str]:
        return None if self.hub is None else self.hub.broken

    def worker_pinned(self) -> dict:
        """Bytes torch's caching host allocator (pin_memory=True) holds in each worker process,
        as each last reported with a landed job: {"<index>:<device>": bytes}."""
        return {} if self.hub is None else {f"{i}:{label}": n for i, (label, n) in sorted(self.hub.pinned.items())}

    def worker_device_peaks(self) -> dict:
        """Each worker's peak device memory, as it last reported with a landed job: {"<index>:<device>":
        [bytes allocated, bytes reserved]} (torch's caching allocator in that process, since it started)."""
        return {} if self.hub is None else {f"{i}:{label}": [a, r] for i, (label, a, r) in sorted(self.hub.device_peaks.items())}

    def prestart(self, modules=()) -> None:
        """Note [early workers]: the first call captures and plans the model in this process
        (seconds: Qwen3-1.7B's capture took 11 s on an H200 host) before its first run starts
        the worker processes, and the first workers of a process wait for their launcher to
        import torch and rpcompile (2.5 s on a 2-core sandbox; Note [worker launcher]). So the first call
        starts them before it captures; they connect and wait for their part, which the first
        run sends (`_start`). Processes never given a part are killed with this executor.
        A plan names none of the model's classes (runtime/portable.py), so a worker imports
        none of the model's modules (transformers: 4.5 s a worker on an H200 host). It is told
        `modules` (the model's, by name) for a plan that does not load without them: one whose
        graphs call an operator a model's module registers (torch.library); then it imports
        them and loads the plan again."""
        if self.hub is None and self._early is None:
            self._early = self._spawn(modules)

    def _spawn(self, modules=()):
        config = self.config
        token = secrets.token_bytes(16)
        path = os.path.join(self.memory.directory, "main.sock")
        server = serve_socket(path)
        procs = []
        for i, d in enumerate(config.devices):
            env = {**os.environ, "RPCOMPILE_WORKER_DIR": self.memory.directory, "RPCOMPILE_WORKER_INDEX": str(i),
                   "RPCOMPILE_WORKER_TOKEN": token.hex(), "RPCOMPILE_WORKER_IMPORTS": ",".join(modules)}
            if d.type == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = _visible(d.index)
            if compiles_stages(config.compile_stages, d.type == "cuda"):
                env["RPCOMPILE_WORKER_COMPILES"] = d.type      # Note [compile stack imported early] (worker.py)
            # Inductor's compile pool is per process: share the cores instead of 32 pools of 32
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // len(config.devices))))
            procs.append(start_worker(env))      # Note [worker launcher] (launcher.py)
        timeline.mark("workers spawned")
        return server, path, token, procs, weakref.finalize(self, _kill_unconnected, procs, server, path)

    def _start(self):
        early, self._early = self._early, None
        t0 = time.perf_counter()
        server, path, token, procs, unconnected = early or self._spawn()
        unconnected.detach()           # from here the hub's finalizer (or the failure below) ends them
        try:
            hub = self._connect(server, token, procs)
        except BaseException as exc:     # nothing half-started stays behind
            for p in procs:
                p.kill()
            if isinstance(exc, (OSError, EOFError)):
                raise WorkerDied(f"the worker processes did not start ({type(exc).__name__}: {exc}); "
                                 "their errors are printed above") from exc
            raise
        finally:
            server.close()
            os.unlink(path)
        # The receiver thread and the finalizer hold the hub, never this executor.
        threading.Thread(target=hub.receive, name="rpcompile-receiver", daemon=True).start()
        weakref.finalize(self, _stop, hub, self.memory)
        self.hub = hub
        timeline.mark("workers ready", time.perf_counter() - t0)

    def _connect(self, server, token, procs) -> "_Hub":
        """Accept the workers' connections, send each its part, wait until all are ready."""
        config, conns = self.config, {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(conns) < len(config.devices):
            for p in procs:
                if p.poll() is not None:
                    raise WorkerDied(f"a worker process ended while starting (exit code {p.returncode}); "
                                     "its error is printed above")
            if time.monotonic() > deadline:
                raise WorkerDied(f"the worker processes did not connect in {START_TIMEOUT_S} s")
            try:
                conn = accept(server, token, timeout=1.0)
            except TimeoutError:
                continue
            _, i = recv(conn)
            conns[i] = conn
        hub = _Hub(config.devices, procs, [conns[i] for i in range(len(config.devices))], self.slot_sets,
                   self.memory)
        self.slot_sets.gather = hub.release_gone      # Note [finalizers take no lock] (shared.py)
        # one hand-over counter per worker (Note [hand-over flags], runtime/handover.py)
        self.counters = self.memory.empty((len(config.devices),), torch.int32).zero_()
        counters = self.memory.ref(self.counters)
        for i, d in enumerate(config.devices):
            send(hub.conns[i], hub.locks[i], ("init", {
                "device": "cpu" if d.type == "cpu" else "cuda:0", "label": str(d), "directory": self.memory.directory,
                "workers": len(config.devices), "compile_stages": config.compile_stages,
                "inductor_options": config.inductor_options,
                "float32_matmul_precision": torch.get_float32_matmul_precision(), "sys_path": list(sys.path),
                "counters": counters}))
        for i, conn in enumerate(hub.conns):
            if not conn.poll(max(1.0, deadline - time.monotonic())):
                raise WorkerDied(f"worker {i} ({config.devices[i]}) did not start in {START_TIMEOUT_S} s")
            msg = recv(conn)
            if msg[0] != "ready":
                raise WorkerDied(f"worker {i} answered {msg[0]!r} while starting")
        return hub

    def _to_all(self, msg):
        self.hub.to_all(msg)

    def warm(self, plan, run, micro) -> None:
        """Before the first run (Note [first programs compiled beside the setup], dry_run.py):
        start the workers, send the plan, and have each dry-run the program of its first job in
        the run's schedule (with replicas: of every job it runs, in order), while this process
        makes its host copies. run() gives (the schedule, the working dtype); nothing is done,
        and run() not called, once the workers have started."""
        if self.hub is not None:
            return
        schedule, dtype = run()
        self._start()
        programs: dict = {}       # worker -> [(stage, role)] to dry-run, in the order it runs them
        for a in schedule.actions:
            mine = programs.setdefault(a.device, [])
            if (a.stage, a.role) not in mine and (schedule.replicas > 1 or not mine):
                mine.append((a.stage, a.role))
        cap = plan.captured
        self._to_all(("warm", self._plan_key(plan), {
            "programs": programs, "micro": micro_desc(micro), "dtype": dtype,
            "buffers": list(cap.buffers), "params": [(tuple(p.shape), p.dtype) for p in cap.params]}))

    def next_device(self):
        """The device the next run's first job goes to."""
        return self.workers[self.offset % len(self.workers)].dev

    @property
    def placements(self) -> list:
        s = self.last_schedule
        return [] if s is None else [(a.job, a.stage, a.role, a.device) for a in s.actions]

    # --- what the workers keep ------------------------------------------------------------
    def _plan_key(self, plan) -> int:
        known = self._plans.get(id(plan))
        if known is not None and known[1] is plan:
            return known[0]
        key = next(self._ids)
        cap = plan.captured
        bundle = {
            # (the programs hold the compute graphs the workers run, forward parts included)
            "stages": [dataclasses.replace(st, forward=None, backward=None, forward_parts=[]) for st in plan.stages],
            "param_index": {n: i for i, n in enumerate(cap.param_names)},
            "buffer_index": {n: i for i, n in enumerate(cap.buffer_names)},
            "param_shapes": [p.shape for p in cap.params],
            "capture_device": cap.capture_device, "capture_key": id(cap),
            "mutated_buffers": sorted(plan.mutated_buffers), "buffers_at_start": sorted(plan.buffers_at_start),
            "prefetch_bytes": plan.prefetch_bytes}
        self._to_all(("plan", key, portable.dumps(bundle)))
        self._plans[id(plan)] = (key, plan)
        return key

    def forget_plans(self, plans) -> None:
        """Plans dropped with their capture (Note [captures kept] in plan_cache.py): the workers
        let go of them, their programs and their capture's pieces."""
        keys = [self._plans.pop(id(p))[0] for p in plans if self._plans.get(id(p), (None, None))[1] is p]
        if keys and self.hub is not None:
            self.hub.forget([], keys)

    def _weights_key(self, step) -> int:
        """The table of shared working copies the step's jobs read, sent once per table."""
        refs = tuple(self.memory.ref(t) for t in weight_table(step))
        if any(r is None for r in refs):
            raise RuntimeError("a working copy is not in shared memory")
        key = self._tables.get(refs)
        if key is None:
            key = self._tables[refs] = next(self._ids)
            self._to_all(("table", key, list(refs)))
        return key

    def forget_shared(self, tensors) -> None:
        """Remove the shared files of host tensors let go (working copies: GraphRunner.release_call_copies;
        spare call gradient sets: Note [call gradient sets]), once no run reads them: every process
        forgets them and the workers drop the weight tables that view them, so that no mapping
        keeps their memory (Note [shared host memory])."""
        names = {r.file for r in map(self.memory.ref, tensors) if r is not None}
        if not names:
            return
        stale = [refs for refs in self._tables if any(r.file in names for r in refs)]
        keys = [self._tables.pop(refs) for refs in stale]
        sets = [i for i, (_, _, files) in self._grad_sets.items() if files & names]   # (HostGrads.renew)
        keys += [self._grad_sets.pop(i)[0] for i in sets]
        if self.hub is not None:
            self.hub.forget(sorted(names), keys)
        else:
            self.memory.forget(sorted(names))

    def send_prefetch(self, worker: int, params: list, dtype, host_weights, before=None):
        """Have a worker upload the working copies of params [(index, parameter)] from the view
        host_weights now (the next step's first job's weights), once before() returned (it may
        wait for an optimizer step); a Future of the token a run's "first_upload" names."""
        def send_it():
            if before is not None:
                before()
            token = next(self._ids)
            refs = [(i, self.memory.ref(working_copy(host_weights, p, dtype))) for i, p in params]
            send(self.hub.conns[worker], self.hub.locks[worker], ("prefetch", token, refs, dtype))
            return token
        return self._sender.submit(send_it)

    def _grads_key(self, grads, record) -> Optional[int]:
        """The key of the gradient set the step's jobs write, sent once per set (None: the step
        has none). The workers drop a step's own set (a differentiable call's) with the step's
        record (_Hub.maybe_release); its files stay mapped for the next call's set, lent the same
        memory (Note [call gradient sets]), until the runner lets them go (forget_shared)."""
        if grads is None:
            return None
        known = self._grad_sets.get(id(grads))
        if known is not None and known[1] is grads:
            return known[0]
        key = next(self._ids)
        flat, consumed = self.memory.ref(grads.flat()), self.memory.ref(grads.consumed)
        self._to_all(("grads", key, grads.layout, flat, consumed))
        if grads.per_step:
            record.own_grads = key
        else:
            self._grad_sets[id(grads)] = (key, grads, {flat.file, consumed.file})
        return key

    # --- runs ---------------------------------------------------------------------------------
    def run(self, step, schedule: Schedule, programs_for=None) -> None:
        """Run a schedule on the workers; return once every job has ended (issued its work: the
        caller goes on while the devices compute, as with worker threads); raise the first
        failure here (a StageError with the schedule's line, the failing job marked).
        programs_for is unused: workers build their own programs."""
        self.issue(step, schedule, programs_for).wait()

    def issue(self, step, schedule: Schedule, programs_for=None) -> "_ProcessRun":
        """Send a run to the workers and return at once: the _ProcessRun waits for its jobs. A
        worker runs its jobs in the order the runs came (Note [overlapped steps])."""
        if self.broken is not None:
            raise WorkerDied(self.broken)
        if self.hub is None:
            self._start()
        if schedule.num_devices != len(self.workers):
            raise ValueError(f"a schedule for {schedule.num_devices} devices given to an executor of "
                             f"{len(self.workers)}")
        if schedule.replicas not in (1, len(self.workers)):    # (the copies' process group is all workers)
            raise ValueError(f"a schedule of {schedule.replicas} replicas given to {len(self.workers)} worker "
                             "processes: replicas in worker processes take every worker")
        plan = step.plan
        record = getattr(step, "remote", None)
        desc = {"plan": self._plan_key(plan), "actions": list(schedule.actions), "replicas": schedule.replicas,
                "trace": step.tracer is not None, "t0": step.tracer.t0 if step.tracer is not None else 0.0}
        if record is None:
            record = step.remote = self.hub.record(next(self._ids), self.slot_sets.take())
            weakref.finalize(step, self.hub.step_gone, record)
            desc.update(weights=self._weights_key(step), grads=self._grads_key(step.grads, record),
                        micro=micro_desc(step.micro), rng_base=step.rng_base,
                        dtype=step.dtype, buffers=list(step.buffers), grad_need=step.grad_need)
        running = {a.device for a in schedule.actions}     # workers with a job of this run
        uploads, step.first_upload = step.first_upload, []
        for dev, future in uploads:         # asked for as the last step ended (delayed mode)
            try:
                token = future.result()
            except OSError:                 # a worker is gone: the send below says so
                token = None
            if token is not None and dev.index in running:
                desc.setdefault("first_upload", {})[dev.index] = token
        if record.handed:       # Note [values a later run reads] (worker.py): after their copies landed
            record.handed_landed.synchronize()
            desc["handed"] = {mb: {key: ref for key, (_, ref) in values.items()}
                              for mb, values in record.handed.items()}
            record.handed = {}
        seeds = {mb: dict(m.grads) for mb, m in enumerate(step.micro) if m.grads}
        if seeds:
            desc["seeds"] = seeds
        with self.hub.lock:
            run_no = record.new_run([a.job for a in schedule.actions], step.tracer)
            # (per copy of a job: Note [replicas in worker processes])
            desc["slots"] = {(a.job, a.replica): list(record.slots.get((run_no, a.job, a.replica), ()))
                             for a in schedule.actions}
        desc["run"] = run_no
        self.last_schedule = schedule
        self.offset = schedule.next_offset
        run = _ProcessRun(self, step, schedule, record, run_no)
        self.hub.runs[(record.step_id, run_no)] = run
        try:
            self._to_all(("run", record.step_id, desc))
        except OSError as exc:     # a worker is gone: its receiver may not have said so yet
            self.hub.runs.pop((record.step_id, run_no), None)
            raise WorkerDied(self.broken or f"a worker process is gone ({exc}); {RESTART}") from None
        return run

    def _take(self, step, schedule, job, info, outputs_landed, run_landed):
        """A job's results into the step, as worker threads leave them: gradients and outputs
        as Pending values, complete once their copies landed (updated buffers: _collect)."""
        stage = schedule.stage(job)
        if info["grads"]:
            views = step.grads.host_views(stage.index)
            # the whole run landed: no job of it still reads a working copy the optimizer rewrites
            # (the copies of a job report their keys each: Note [replicas in worker processes])
            step.param_grads.setdefault(job, {}).update({key: Pending(views[key], run_landed) for key in info["grads"]})
        if info.get("handed"):      # Note [values a later run reads] (worker.py): a later job's value wins
            record, pos = step.remote, next(k for k, a in enumerate(schedule.actions) if a.job == job)
            for mb, values in info["handed"].items():
                kept = record.handed.setdefault(mb, {})
                kept.update({key: (pos, ref) for key, ref in values.items() if kept.get(key, (-1,))[0] < pos})
            record.handed_landed = run_landed
        copied = _COPIED if info.get("outputs_copied") else outputs_landed   # Note [outputs before the landing] (worker.py)
        for mb, outs in info["outputs"].items():
            for name, v in outs.items():
                step.micro[mb].outputs[name] = _Output(decode(v, self.memory), copied)
        e = info["error"]
        if e is None:
            return None
        err = StageError(e["message"], stage=e["stage"], microbatch=e["microbatch"], device=e["device"], job=e["job"],
                         worker=e.get("worker"))
        if e["traceback"]:
            err.__cause__ = RemoteError(e["cause"], e["traceback"])
        return err



# Note [runs nobody waits for]: the hub kept each run until the caller waited for it, and a run
# holds its executor, its step and through it every parameter: a compiled model dropped with a
# run not waited for (delayed mode's last step, `del cm` without cm.synchronize()) stayed whole,
# held by the receiver thread through the hub, with its worker processes, their threads and the
# shared files, for the life of the process. The hub's runs are weak: the caller holds a run it
# will wait for; one nobody will is dropped with its step, and its late messages with it.
class _ProcessRun:
    """A run sent to the workers: wait for some of its jobs, or all. Only the caller's thread
    reads the workers' "ended" messages; one for another run still waited for is kept for it
    (runs overlap: Note [overlapped steps]), one for a run that is over or gone is dropped."""

    def __init__(self, executor, step, schedule, record, run_no):
        self.executor, self.step, self.schedule = executor, step, schedule
        self.record, self.run_no = record, run_no
        self.waiting = collections.Counter(a.job for a in schedule.actions)    # job -> copies not ended
        self.over = False
        self.inbox: list = []
        self.first_error, self.aborted, self.updated = None, False, []
        self.run_landed = _RunLanded(executor.hub, [record.landed[(run_no, j)] for j in self.waiting])
        self.landed = _landing(executor.hub, record, run_no)

    def wait(self, jobs=None) -> None:
        """Block until `jobs` (default: all) have ended; on a failure, until every job has
        ended, then raise it."""
        if self.over:
            return
        hub, key = self.executor.hub, (self.record.step_id, self.run_no)
        want = None if jobs is None else set(jobs)
        try:
            while self.waiting and (want is None or self.first_error is not None or want & self.waiting.keys()):
                if not self.inbox and hub.broken is not None:
                    raise WorkerDied(hub.broken)
                msg = self.inbox.pop(0) if self.inbox else hub.ended.get()
                if msg is None:
                    hub.ended.put(None)    # for any other run's waiter too
                    raise WorkerDied(hub.broken)
                _, step_id, run, job, info = msg
                if (step_id, run) != key:
                    other = hub.runs.get((step_id, run))
                    if other is not None:
                        other.inbox.append(msg)
                    continue          # else a run that failed before: its late messages
                self._take(job, info)
        except WorkerDied:
            hub.runs.pop(key, None)
            raise
        if self.waiting:
            return
        self.over = True
        hub.runs.pop(key, None)
        self._end()

    def _take(self, job, info):
        self.waiting[job] -= 1
        if not self.waiting[job]:
            del self.waiting[job]
        self.aborted = self.aborted or info.get("aborted", False)
        outputs = self.record.outputs_landed(self.run_no, job, info.get("replica", 0))
        err = self.executor._take(self.step, self.schedule, job, info, _Landed(self.executor.hub, outputs),
                                  self.run_landed)
        if err is not None and self.first_error is None:
            self.first_error = err
        self.updated.append((job, info["buffers"]))

    def _end(self):
        step, schedule = self.step, self.schedule
        # updated buffers in chain order (the messages of different workers come in any order)
        position = {a.job: k for k, a in enumerate(schedule.actions)}
        with torch.no_grad():
            for _, buffers in sorted(self.updated, key=lambda u: position[u[0]]):
                for i, value in buffers.items():
                    step.buffers[i].copy_(value)
        err = self.first_error
        if err is None and self.aborted:    # never silently: a stopped job has no results
            err = StageError("stage jobs stopped after another job's failure that no worker reported; "
                             "the workers' errors are printed above")
        if err is not None:
            raise err.with_schedule(schedule.render(failed=err.job, device=err.worker))


def _landing(hub, record, run_no):
    """landed(job): block until `job`'s copies have landed (any thread may ask: the receiver
    thread records them; it holds no step); StepAbandoned if a job of the run failed
    (_ProcessRun.wait raises that failure)."""
    def landed(job: int) -> None:
        event = record.landed[(run_no, job)]
        event.wait()
        if hub.broken is not None or event in hub.failed:
            raise StepAbandoned(hub.broken or f"job {job} failed")
        _Landed(hub, event).synchronize()
    return landed


class _Hub:
    """The connections to the workers and the receiver thread that reads them: "ended" go to
    the caller's thread, "landed" are recorded here; a step's slots are released once its
    StepState is gone and all its jobs landed, and its slot set goes back to `slot_sets`."""

    def __init__(self, devices, procs, conns, slot_sets, memory):
        self.devices, self.procs, self.conns, self.slot_sets = devices, procs, conns, slot_sets
        self.memory = memory
        self.locks = [threading.Lock() for _ in conns]
        self.by_conn = {c: i for i, c in enumerate(conns)}
        self.ended: queue.Queue = queue.Queue()
        # (step id, run) -> _ProcessRun still waited for; held by its caller, not here: a run
        # holds its executor, and the receiver thread holds this hub (Note [runs nobody waits for])
        self.runs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.records: dict = {}          # step id -> _StepRecord
        self.lock = threading.Lock()
        self.broken: Optional[str] = None
        self.stopping = False
        self.landed_errors: dict = {}    # landed event -> why its copies did not land
        self.failed = weakref.WeakSet()  # landed events of jobs that failed or were stopped
        self.pinned: dict = {}           # worker index -> (its device, its caching host allocator's bytes), last reported
        self.device_peaks: dict = {}     # worker index -> (its device, peak bytes allocated, reserved), last reported
        self.gone: queue.SimpleQueue = queue.SimpleQueue()   # records of steps collected, not yet released
        self._wake, self._woken = socket.socketpair()       # a finalizer wakes the receiver thread
        self._wake.setblocking(False)
        self._releasing = threading.Lock()

    def to_all(self, msg):
        for conn, lock in zip(self.conns, self.locks):
            send(conn, lock, msg)

    def record(self, step_id, slots: dict) -> "_StepRecord":
        r = _StepRecord(step_id, slots)
        with self.lock:
            self.records[step_id] = r
        return r

    def receive(self):
        try:
            self._receive()
        finally:
            self._wake.close()
            self._woken.close()

    def _receive(self):
        while True:
            ready = wait_connections(self.conns + [self._woken], timeout=5.0)
            if not ready:
                dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
                if dead and not self.stopping:
                    self.die(f"the worker process of {self.devices[dead[0]]} ended (exit code "
                             f"{self.procs[dead[0]].returncode}); its error is printed above; {RESTART}")
                    return
                continue
            for conn in ready:
                if conn is self._woken:
                    self._woken.recv(1 << 12)
                    self.release_gone()
                    continue
                try:
                    msg = recv(conn)
                except (EOFError, OSError):
                    if not self.stopping:
                        self.die(f"the worker process of {self.devices[self.by_conn[conn]]} ended; its error is "
                                 f"printed above; {RESTART}")
                    return
                if msg[0] == "ended":
                    self.ended.put(msg)
                elif msg[0] == "landed":
                    self.landed(*msg[1:])
                elif msg[0] == "outputs":      # Note [outputs before the landing] (worker.py)
                    self.outputs_landed(*msg[1:])

    def die(self, why, lock: bool = True):
        """lock=False: from a finalizer, whose thread may hold self.lock (Note [finalizers take
        no lock] in shared.py)."""
        self.broken = why
        self.ended.put(None)
        with self.lock if lock else contextlib.nullcontext():
            records = list(self.records.values())
        for r in records:
            for ev in list(r.landed.values()) + list(r.outputs.values()):
                ev.set()

    def outputs_landed(self, step_id, run_no, job, replica):
        with self.lock:
            record = self.records.get(step_id)
        if record is not None:
            record.outputs_landed(run_no, job, replica).set()

    def landed(self, step_id, run_no, job, info):
        warmup.first_calls.extend(info["first_calls"])
        timeline.extend(info.get("marks", ()))
        if "pinned" in info:
            index, label, nbytes = info["pinned"]
            self.pinned[index] = (label, nbytes)
        if "device_peaks" in info:
            index, *peaks = info["device_peaks"]
            self.device_peaks[index] = tuple(peaks)
        with self.lock:
            record = self.records.get(step_id)
        if record is None:
            return
        tracer = record.tracers.get(run_no)
        if tracer is not None and info["spans"]:
            tracer.extend(info["spans"])
        ev = record.landed.get((run_no, job))
        last = record.copy_landed(run_no, job)      # (every copy of the job: Note [replicas])
        if info.get("error") and ev is not None:
            self.landed_errors[ev] = f"the copies of job {job} did not land: {info['error']}"
        if info.get("failed") and ev is not None:
            self.failed.add(ev)
        wake = ev is not None and not ev.is_set() and last
        gone = sorted({r.file for r in info.get("dropped", ())})
        with self.lock:     # before waking a waiter, who may drop the step (and release it)
            if info.get("chunks"):          # the job's slots grew: the set keeps the new chunks
                mine = record.slots.setdefault((run_no, job, info.get("replica", 0)), [])
                mine[:] = [r for r in mine if r.file not in gone] + info["chunks"]   # Note [outgrown slots]
            if wake:
                record.outstanding -= 1
        if gone:
            self.forget(gone)
        # released before waking the waiter too: a next step issued once this landing was seen
        # (delayed mode: after the optimizer step that waited for it) finds the slot set free
        self.release_gone()
        self.maybe_release(record)
        record.outputs_landed(run_no, job, info.get("replica", 0)).set()     # (if no "outputs" came first)
        if wake:
            ev.set()

    def step_gone(self, record):
        """The finalizer of a step's StepState (Note [finalizers take no lock]): it queues the
        record for release_gone and wakes the receiver thread, which calls it."""
        self.gone.put(record)
        try:
            self._wake.send(b"\0")
        except OSError:      # (a wake is pending already, or the hub stopped)
            pass

    def release_gone(self):
        """Release the steps whose StepState was collected (in a thread that may take locks):
        the receiver thread when woken, before a landing wakes its waiter, and before a slot
        set is taken or counted (SlotSets.gather). One thread at a time: a caller returns once
        what was queued before it is released, whichever thread took it."""
        with self._releasing:
            for record in drained(self.gone):
                record.gone = True
                self.maybe_release(record)

    def maybe_release(self, record):
        with self.lock:
            if not (record.gone and record.outstanding == 0) or record.step_id not in self.records:
                return
            del self.records[record.step_id]
        if self.broken is None and not self.stopping:
            try:
                self.to_all(("release", record.step_id))
            except OSError:
                return
            self.slot_sets.give(record.slots)
            if record.own_grads is not None:    # (its files stay, lent to the next call's set)
                self.forget([], [record.own_grads])

    def forget(self, names, keys=()) -> None:
        """Every process lets go of the shared files `names` (the owner removes them), the workers
        also of the weight tables and gradient sets keyed `keys` that view them."""
        if self.broken is None and not self.stopping:
            try:
                self.to_all(("forget", names, list(keys)))
            except OSError:
                pass
        self.memory.forget(names)


class _StepRecord:
    """The main process's account of a step on the workers: per run and job, whether its copies
    landed."""

    def __init__(self, step_id, slots: dict):
        self.step_id = step_id
        self.slots = slots           # its slot set: (run, job, copy) -> chunk Refs (Note [slot sets])
        self.runs = 0
        self.landed: dict = {}       # (run, job) -> threading.Event (set once every copy landed)
        self.copies: dict = {}       # (run, job) -> copies not landed (Note [replicas])
        self.outputs: dict = {}      # (run, job, copy) -> threading.Event (set once its outputs landed)
        self.tracers: dict = {}      # run -> Tracer
        self.outstanding = 0         # jobs dispatched that have not landed
        self.gone = False            # the step's StepState was collected
        self.own_grads = None        # the key of its own gradient set (a call's), dropped with it
        # mb -> {(kind, name): (chain position, Ref)}: the next run's (Note [values a later run reads], worker.py)
        self.handed: dict = {}
        self.handed_landed = None    # the run whose copies they are: landed before they are sent

    def new_run(self, jobs, tracer) -> int:
        """A run of `jobs` (a job named once per copy); its number."""
        self.runs += 1
        for j in jobs:
            self.landed[(self.runs, j)] = threading.Event()
            self.copies[(self.runs, j)] = self.copies.get((self.runs, j), 0) + 1
        self.outstanding += len(set(jobs))
        if tracer is not None:
            self.tracers[self.runs] = tracer
        return self.runs

    def outputs_landed(self, run_no, job, replica) -> threading.Event:
        """Set once copy `replica` of `job` has its outputs down (Note [outputs before the
        landing], worker.py), at the latest when it landed; asked for by either side first."""
        return self.outputs.setdefault((run_no, job, replica), threading.Event())

    def copy_landed(self, run_no, job) -> bool:
        """A copy of `job` landed: whether it was the last."""
        left = self.copies.get((run_no, job), 1) - 1
        self.copies[(run_no, job)] = left
        return left <= 0


class _Landed:
    """A CUDA event's host side for values a worker copied: complete once the job landed."""

    def __init__(self, hub, event):
        self.hub, self.event = hub, event

    def synchronize(self):
        self.event.wait()
        if self.hub.broken is not None:
            raise WorkerDied(self.hub.broken)
        why = self.hub.landed_errors.get(self.event)
        if why is not None:
            raise RPCompileError(why)


class _RunLanded:
    """Complete once every job of a run landed."""

    def __init__(self, hub, events):
        self.hub, self.events = hub, events

    def synchronize(self):
        for ev in self.events:
            _Landed(self.hub, ev).synchronize()


class _Copied:
    """The event of outputs whose copies had completed when their job ended."""

    @staticmethod
    def synchronize():
        pass


_COPIED = _Copied()


class _Output(Pending):
    """An output in a worker's slot: resolved as a copy of its own (the slot is reused)."""

    __slots__ = ()

    def resolve(self):
        return self.landed().clone()


class RemoteError(RuntimeError):
    """An exception raised in a worker process: its type name and traceback."""

    def __init__(self, kind, text):
        super().__init__(f"{kind} in a worker process:\n{text}")
        self.kind = kind


def working_copy(view, p, dtype) -> torch.Tensor:
    """The shared working copy of parameter p in a weight view: the runner's HostWeights,
    refreshed; delayed mode's copies of a step's parity (_SlotView) or a call's newest
    (_CallView), runtime/weights.py."""
    return view.shared_copy(p, working_dtype(p, dtype))


def weight_table(step) -> list:
    """The shared working copy of every parameter, in parameter order, for a step's jobs."""
    if step.gate is not None and not step.host_weights.snapshot:
        for p in step.params:            # a parameter's pending optimizer step first (live parameters only)
            step.gate(p)
    return [working_copy(step.host_weights, p, step.dtype) for p in step.params]
