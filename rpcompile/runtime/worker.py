"""A worker process: runs the stage jobs of one device (Config(workers="processes")).

Note [worker processes]: with worker threads, four GPUs are driven from one interpreter and
their kernel launches take turns under its lock (a launch probe on 4x H100 measured four
threads together 0.71x as fast as one; one process per GPU 3.15x). So each device gets a
process of its own that calls `worker.main()`, forked from a launcher that imported this module
once (Note [worker launcher] in runtime/launcher.py; never a fork of the main process, and
never a re-import of the user's script as multiprocessing's spawn does), seeing only its GPU
(CUDA_VISIBLE_DEVICES), so every process compiles the same code and one on-disk Inductor
cache serves them all. What crosses between processes:

- host buffers are files in shared memory (runtime/shared.py); messages carry Refs;
- the main process sends each plan once (runtime/portable.py), the tables of weight copies
  and gradient buffers once, and per run the schedule and the microbatches' inputs;
- when a job has finished a microbatch, the values it handed on (activations, checkpoints,
  gradients of activations) go to every other worker as Refs once their downloads have
  completed (a notifier thread waits for the download events, so no process reads a slot
  before its copy landed). A worker waits for every earlier job of the chain, not only the
  previous one, since messages from different peers may arrive in any order; a value from a
  later job of the chain wins over one from an earlier job (a summed gradient over a part);
- when a job has ended, the main process gets its gradient keys, outputs, updated buffers,
  trace spans and error (if any), once all its copies completed: the main process starts the
  next step only after every job of this one has ended, so no slot of a step is reused while
  still being read, and no working copy is rewritten while an upload reads it.

Each job's downloads land in slots of its SlotPool, in the chunks of the step's slot set
(Note [slot sets] in runtime/shared.py) that the run message names for the job; chunks the pool
adds go back to the main process with the job's landing.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as wait_connections

import torch
from torch.utils import _pytree as pytree

from . import portable
from .compile_once import compile_locks
from .device import DeviceRuntime, Pending, _map
from .dry_run import DryRuns, StandInStep
from .grads import GradSet, param_index
from .handover import Flagged, HandoverFlags
from .job import JobLinks, Microbatch, StepState, run_job
from .programs import ProgramCache
from .replicas import KeptSum, PeerExchange
from .shared import Ref, SharedMemory, SlotPool, cuda_register, cuda_unregister
from .trace import Tracer
from . import timeline, warmup
from ..errors import StageError
from ..plan import key_numel


def send(conn, lock, msg) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def connect(path: str, token: bytes) -> Connection:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    conn = Connection(s.detach())
    conn.send_bytes(token)
    return conn


def serve_socket(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return s


def accept(server: socket.socket, token: bytes, timeout: float) -> Connection:
    server.settimeout(timeout)
    s, _ = server.accept()
    s.settimeout(None)
    conn = Connection(s.detach())
    if conn.recv_bytes() != token:
        conn.close()
        raise ConnectionError("a process without the run's token connected to a worker socket")
    return conn


def encode(value, memory: SharedMemory, pool):
    """A value for a message: tensors as Refs to shared memory (copied into a slot of `pool`
    when not there yet), other leaves as they are. A Pending download into shared memory is
    named as it is (its reader waits for it: Note [hand-over flags]); one elsewhere is waited for."""
    def enc(v):
        if isinstance(v, Pending):
            ref = memory.ref(v.tensor)
            if ref is not None:
                return ref
            v = v.resolve()
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        ref = memory.ref(v)
        if ref is None:
            slot = pool.empty(tuple(v.shape), v.dtype)
            slot.copy_(v)
            ref = memory.ref(slot)
        return ref
    return _map(enc, value, is_leaf=lambda v: isinstance(v, Pending))


def decode(value, memory: SharedMemory):
    if isinstance(value, Ref):
        return memory.tensor(value)
    if isinstance(value, (list, tuple, dict)):
        return pytree.tree_map(lambda v: memory.tensor(v) if isinstance(v, Ref) else v, value,
                               is_leaf=lambda v: isinstance(v, Ref))
    return value


def events_of(value) -> list:
    leaves = [value] if isinstance(value, Pending) else \
        pytree.tree_leaves(value, is_leaf=lambda v: isinstance(v, Pending))
    return [v.event for v in leaves if isinstance(v, Pending)]


def _failure(message: str, exc: BaseException, **fields) -> StageError:
    """A StageError saying `message` and the exception it comes from."""
    err = StageError(f"{message}: {type(exc).__name__}: {exc}", **fields)
    err.__cause__ = exc
    return err


class RemoteFailure(Exception):
    """Another worker's job of the step failed."""


class _Snapshot:
    """Weights as a worker reads them: the shared working copies are the parameters."""

    snapshot = True

    @contextlib.contextmanager
    def refreshed(self, param, dtype, rows=None):
        yield [None, param if rows is None else param[rows[0]:rows[1]], None, None]

    @contextlib.contextmanager
    def held(self, params):
        yield sorted(((i, [None, p, None, None]) for i, p in params), key=lambda x: x[1][1].data_ptr())

    @staticmethod
    def mark_upload(entry, event, stream=None) -> None:
        pass


def micro_desc(micro) -> list:
    """A step's microbatches as a run (or a warm-up) sends them to the workers."""
    return [(m.leaves, m.syms, m.rows, m.seed, m.scales) for m in micro]


def microbatches(desc) -> list:
    """The Microbatches `micro_desc` sent."""
    return [Microbatch(leaves, syms, rows=rows, seed=seed, scales=scales) for leaves, syms, rows, seed, scales in desc]


class _Warm:
    """A job-queue item: dry-run programs of this worker's jobs of a step to come (Worker.warm)."""

    def __init__(self, plan_key, desc):
        self.plan_key, self.desc = plan_key, desc


class WorkerPlan:
    """What a worker keeps of a plan: its stages (with programs) and parameter facts."""

    def __init__(self, key: int, bundle: dict):
        self.key = key      # the main process's, never reused: what its programs are kept by
        self.stages = bundle["stages"]
        self.param_index = bundle["param_index"]
        self.buffer_index = bundle["buffer_index"]
        self.param_shapes = bundle["param_shapes"]
        self.capture_device = bundle["capture_device"]
        self.capture_key = bundle["capture_key"]
        self.mutated_buffers = frozenset(bundle["mutated_buffers"])
        self.buffers_at_start = frozenset(bundle["buffers_at_start"])
        self.prefetch_bytes = bundle["prefetch_bytes"]     # Note [resident weights]

    def param_numel(self, key) -> int:
        return key_numel(self.param_shapes[param_index(key)], key)


class WorkerStep(StepState):
    """A step as one worker sees it: its own jobs' values and those the other workers sent."""

    def __init__(self, worker, step_id, **kw):
        super().__init__(**kw)
        self.worker, self.step_id = worker, step_id
        self.order: list = []            # job indices of the current run, in chain order
        self.job_stage: dict = {}
        self.run_no = 0
        self.position: dict = {}
        self.owner: list = []            # per microbatch: (kind, name) -> (chain position, value)
        self.sent: dict = {}             # (mb, (kind, name)) -> (value, its encoding) sent to the peers this run
        self.peer_exchanges: dict = {}   # (run, job) -> replicas.PeerExchange
        self.failed_copies: set = set()  # workers whose job of this step failed (their "fail" messages)

    def peer_exchange(self, run_no, job, replicas) -> PeerExchange:
        """This worker's meeting point for the copies of `job` in run run_no (made by whichever
        comes first: the run, or another copy's message)."""
        with self.lock:
            ex = self.peer_exchanges.get((run_no, job))
            if ex is None:
                worker, step_id = self.worker, self.step_id
                ex = self.peer_exchanges[(run_no, job)] = PeerExchange(
                    replicas, lambda keys: worker.to_peers(("replica", step_id, run_no, job, worker.index,
                                                            replicas, keys)),
                    worker.replica_group)
            return ex

    @property
    def replicated(self) -> bool:
        """Whether the run's jobs are copies (Note [replicas in worker processes])."""
        return bool(self.exchanges)

    def start_run(self, run_no, actions, replicas=1, handed=None):
        for mb, values in (handed or {}).items():    # Note [values a later run reads]
            for (kind, name), v in values.items():
                getattr(self.micro[mb], kind)[name] = v
        self.sent = {}
        self.run_no = run_no
        self.exchanges = {a.job: self.peer_exchange(run_no, a.job, replicas) for a in actions} if replicas > 1 else {}
        if len(self.exchanges) == 1:     # a copy of one job keeps its accumulator (Note [copies' sum beside the next step])
            for job, ex in self.exchanges.items():
                ex.kept, ex.kept_key = self.worker.kept_sum, (self.plan.key, job)
        self.order = [a.job for a in actions]
        self.job_stage = {a.job: a.stage for a in actions}
        self.position = {j: k for k, j in enumerate(self.order)}
        self.done_events = {a.job: [threading.Event() for _ in self.micro] for a in actions}
        self.param_grads = {}
        self.error = None
        self.owner = [{} for _ in self.micro]
        for mb, m in enumerate(self.micro):   # what the step holds already counts as known
            for kind in ("acts", "grads"):
                for name, v in getattr(m, kind).items():
                    self.owner[mb][(kind, name)] = (-1, v)

    def wait_done(self, job, mb):
        # Every earlier job of the chain: peers' messages may arrive in any order.
        for j in self.order[:self.position[job] + 1]:
            self.done_events[j][mb].wait()

    def mark_done(self, job, mb):
        if not self.replicated:     # (a copy's values stay with it: its next job runs here)
            self.worker.publish(self, job, mb)
        super().mark_done(job, mb)

    def fail(self, exc):
        first = self.error is None
        super().fail(exc)
        if first and not isinstance(exc, RemoteFailure):
            self.worker.to_peers(("fail", self.step_id, self.worker.index))

    def error_is_remote(self) -> bool:
        return isinstance(self.error, RemoteFailure)

    def receive(self, job, mb, values, stamp=None) -> None:
        """A peer's values of `job` for microbatch mb; with a stamp (producer, number) they are
        complete once the producer's counter reached the number (Note [hand-over flags])."""
        pos = self.position.get(job, -1)
        micro, owner = self.micro[mb], self.owner[mb]
        for (kind, name), enc in values.items():
            if owner.get((kind, name), (-2, None))[0] > pos:
                continue    # a later job's value is here already
            v = decode(enc, self.worker.memory)
            if stamp is not None:
                v = _map(lambda t: Flagged(t, self.worker.flags, *stamp) if isinstance(t, torch.Tensor) else t, v)
            getattr(micro, kind)[name] = v
            owner[(kind, name)] = (pos, v)
        self.done_events[job][mb].set()


class Worker:
    def __init__(self, index: int, init: dict, main: Connection):
        self.index = index
        self.device = torch.device(init["device"])
        self.label = init["label"]
        self.is_cuda = self.device.type == "cuda"
        torch.set_float32_matmul_precision(init["float32_matmul_precision"])   # as the user set it
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        self.memory = SharedMemory(init["directory"], register=cuda_register if self.is_cuda else None,
                                   unregister=cuda_unregister if self.is_cuda else None)
        self.pools: dict = {}          # step id -> {(run, job): SlotPool}
        self.kept_sum = KeptSum()      # Note [copies' sum beside the next step]
        self.dev = DeviceRuntime(self.device, label=self.label)
        self.dev.worker_index = index
        self.programs = ProgramCache(init["compile_stages"], self.is_cuda, init["inductor_options"])
        if self.programs.inductor:
            self.programs.locks = compile_locks(init["directory"])
            warmup.close_idle_compile_pools()
        self.dry_runs = DryRuns(self.programs, self.dev)
        self.plans: dict = {}
        self.tables: dict = {}
        self.grad_sets: dict = {}
        self.steps: dict = {}          # step id -> WorkerStep
        self.early: dict = {}          # step id -> messages that came before the step
        self.main, self.main_lock = main, threading.Lock()
        self.peers: dict = {}          # index -> (conn, lock)
        self.jobs: queue.Queue = queue.Queue()
        self.notices: queue.Queue = queue.Queue()
        self.step_lock = threading.Lock()
        self.first_calls_sent = 0
        self.clock = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.workers = init["workers"]
        self._group = None             # the workers' process group (Note [replicas in worker processes])
        try:
            self.flags = HandoverFlags(self.memory.tensor(init["counters"]), index, self.device)
        except (OSError, RuntimeError) as exc:   # no stream memory operations: hand over landed data
            print(f"rpcompile: {self.label}: hand-overs wait for landed downloads ({exc})", file=sys.stderr)
            self.flags = None

    def replica_group(self):
        """The process group of all workers, made as the first replicated job starts (every
        worker calls this from its job thread at the same point of the same run; later calls
        return it)."""
        if self._group is None:
            import torch.distributed as dist
            kw = {"device_id": self.device} if self.is_cuda else {}
            dist.init_process_group("nccl" if self.is_cuda else "gloo", rank=self.index, world_size=self.workers,
                                    init_method="file://" + os.path.join(self.memory.directory, "replicas.store"),
                                    timeout=datetime.timedelta(seconds=120), **kw)
            self._group = dist.group.WORLD
        return self._group

    # --- messages out ------------------------------------------------------------------
    def to_main(self, msg):
        send(self.main, self.main_lock, msg)

    def to_peers(self, msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn, lock in self.peers.values():
            with lock:
                conn.send_bytes(data)

    def later(self, events, fn, on_error=None):
        """fn() in the notifier thread once `events` completed (in submission order);
        on_error(exc) if that fails, so that nobody waits for what fn would have sent."""
        self.notices.put((events, fn, on_error))

    def notifier(self):
        while True:
            item = self.notices.get()
            if item is None:
                return
            events, fn, on_error = item
            try:
                for e in events:
                    e.synchronize()
                fn()
            except BaseException as exc:
                traceback.print_exc()
                if on_error is not None:
                    try:
                        on_error(exc)
                    except BaseException:   # a broken pipe at shutdown: nothing left to tell
                        traceback.print_exc()

    def pool(self, step, job) -> SlotPool:
        """The slots of `job` in the step's current run (made by start_run)."""
        return self.pools[step.step_id][(step.run_no, job)]

    def publish(self, step: WorkerStep, job, mb):
        """Send the values `job` handed on for microbatch mb to the other workers."""
        micro, owner, pos, run_no = step.micro[mb], step.owner[mb], step.position[job], step.run_no
        new = {}
        for kind in ("acts", "grads"):
            for name, v in getattr(micro, kind).items():
                known = owner.get((kind, name))
                if known is None or known[1] is not v:
                    owner[(kind, name)] = (pos, v)
                    new[(kind, name)] = v
        if not self.peers:
            return
        pool = self.pool(step, job)

        def failed(exc):
            step.fail(_failure(f"{self.label}: its worker process could not hand on microbatch {mb} of job {job}",
                               exc, device=self.label))
        if self.flags is not None:
            # at once: the peers' streams wait for this worker's counter (Note [hand-over flags])
            try:
                values = {k: encode(v, self.memory, pool) for k, v in new.items()}
                step.sent.update({(mb, k): (new[k], enc) for k, enc in values.items()})
                number = self.flags.signal(self.dev.out if self.is_cuda else None)
                self.to_peers(("done", step.step_id, run_no, job, mb, values, (self.index, number)))
            except BaseException as exc:
                failed(exc)
            return
        events = [e for v in new.values() for e in events_of(v)]
        self.later(events, lambda: self.to_peers(
            ("done", step.step_id, run_no, job, mb, {k: encode(v, self.memory, pool) for k, v in new.items()}, None)),
            failed)

    # --- messages in -------------------------------------------------------------------
    def receiver(self):
        conns = {self.main: None, **{c: i for i, (c, _) in self.peers.items()}}
        while conns:
            for conn in wait_connections(list(conns)):
                try:
                    msg = recv(conn)
                except (EOFError, OSError):
                    if conns.pop(conn) is None:      # the main process is gone: end
                        self.jobs.put(None)
                        return
                    continue
                if msg[0] == "stop":
                    self.jobs.put(None)
                    return
                self.handle(msg)

    def handle(self, msg):
        try:
            self._handle(msg)
        except BaseException as exc:
            if msg[0] == "plan":        # said when a run uses it
                self.plans[msg[1]] = exc
            elif msg[0] == "run":
                self.refuse_run(msg[1], msg[2], exc)
            elif msg[0] in ("done", "fail") and msg[1] in self.steps:
                # a hand-over this worker could not take: its jobs must not wait for it forever
                self.steps[msg[1]].fail(_failure(f"{self.label}: its worker process could not take a hand-over",
                                                 exc, device=self.label))
            else:
                traceback.print_exc()

    def forget_plan(self, key) -> None:
        """A plan dropped with its capture (Note [captures kept] in plan_cache.py): its programs
        go, and its capture's pieces where no plan kept here is of that capture."""
        plan = self.plans.pop(key, None)
        if not isinstance(plan, WorkerPlan):
            return
        capture_gone = all(p.capture_key != plan.capture_key for p in self.plans.values() if isinstance(p, WorkerPlan))
        self.programs.release(key, plan.capture_key if capture_gone else None)
        self.dry_runs.seen -= {seen for seen in list(self.dry_runs.seen) if seen[0] == key}   # (the job thread adds)

    def refuse_run(self, step_id, desc, exc):
        """A run this worker cannot start (its plan did not load, ...): its jobs end failed,
        and the other workers' jobs of the run stop."""
        self.to_peers(("fail", step_id, self.index))
        for a in desc["actions"]:
            if a.device != self.index:
                continue
            err = _failure(f"stage {a.stage} ({a.role}) on {self.label}: its worker process could not start the run",
                           exc, stage=a.stage, device=self.label, job=a.job, worker=self.index)
            self.to_main(("ended", step_id, desc["run"], a.job, {"grads": [], "outputs": {}, "buffers": {},
                                                                "error": describe(err)}))
            self.to_main(("landed", step_id, desc["run"], a.job, {"replica": a.replica, "spans": [], "first_calls": [],
                                                                  "failed": True}))

    def _handle(self, msg):
        kind = msg[0]
        t0 = time.perf_counter()
        if kind == "plan":
            self.plans[msg[1]] = WorkerPlan(msg[1], _load_plan(msg[2]))
            timeline.mark("plan loaded", time.perf_counter() - t0)
        elif kind == "table":
            self.tables[msg[1]] = [self.memory.tensor(r) for r in msg[2]]
            timeline.mark("working copies mapped", time.perf_counter() - t0)
        elif kind == "grads":
            _, key, layout, ref, consumed = msg
            flat = self.memory.tensor(ref)
            gs = GradSet(layout, False, {}, "gradients", consumed=self.memory.tensor(consumed), dtype=flat.dtype)
            gs._flat = flat
            self.grad_sets[key] = gs
            timeline.mark("gradients mapped", time.perf_counter() - t0)
        elif kind == "warm":           # Note [first programs compiled beside the setup] (dry_run.py)
            self.jobs.put(_Warm(msg[1], msg[2]))
        elif kind == "prefetch":       # the next step's first job's weights (delayed mode)
            _, token, refs, dtype = msg
            self.dev.prefetch(("first", token), [(i, self.memory.tensor(r)) for i, r in refs], dtype, _Snapshot())
        elif kind == "run":
            self.start_run(*msg[1:])
        elif kind == "release":
            with self.step_lock:
                self.steps.pop(msg[1], None)
                self.early.pop(msg[1], None)
            self.pools.pop(msg[1], None)     # its chunks serve a later step (Note [slot sets])
        elif kind == "forget":         # chunks no slot set holds (Note [outgrown slots]), copies let go,
            for key in msg[2]:                                 # a step's own gradient set, plans dropped
                self.tables.pop(key, None)
                self.grad_sets.pop(key, None)
                self.forget_plan(key)
            self.memory.forget(msg[1])
        elif kind in ("done", "fail", "replica"):
            with self.step_lock:
                step = self.steps.get(msg[1])
                order = 0 if step is None else _run_order(msg, step.run_no)
                if step is None or order > 0:
                    self.early.setdefault(msg[1], []).append(msg)
                    return
            if order == 0:
                self.apply(step, msg)

    def apply(self, step, msg):
        if msg[0] == "done":
            _, _, _, job, mb, values, stamp = msg
            step.receive(job, mb, values, stamp)
        elif msg[0] == "replica":     # another copy is ready to sum (Note [replicas in worker processes])
            _, _, run_no, job, r, replicas, keys = msg
            step.peer_exchange(run_no, job, replicas).arrive(r, keys)
        else:
            if len(msg) > 2:     # (Note [replicas in worker processes]: which copy failed)
                step.failed_copies.add(msg[2])
            step.fail(RemoteFailure())

    def start_run(self, step_id, desc):
        plan = self.plans[desc["plan"]]
        if isinstance(plan, BaseException):
            raise plan
        with self.step_lock:
            step = self.steps.get(step_id)
            if step is None:
                weights = self.tables[desc["weights"]]
                micro = microbatches(desc["micro"])
                step = WorkerStep(self, step_id, plan=plan, params=weights, buffers=desc["buffers"], micro=micro,
                                  rng_base=desc["rng_base"], dtype=desc["dtype"], grads=self.grad_sets.get(desc["grads"]),
                                  grad_need=desc["grad_need"],
                                  host_weights=_Snapshot(), param_index=plan.param_index,
                                  buffer_index=plan.buffer_index)
                self.steps[step_id] = step
            step.start_run(desc["run"], desc["actions"], desc.get("replicas", 1),
                           {mb: {k: decode(v, self.memory) for k, v in values.items()}
                            for mb, values in desc.get("handed", {}).items()})
            for mb, grads in desc.get("seeds", {}).items():      # (after what was handed: seeds say last)
                step.micro[mb].grads.update({name: decode(g, self.memory) for name, g in grads.items()})
            pools = self.pools.setdefault(step_id, {})
            for a in desc["actions"]:
                if a.device == self.index:
                    pools[(desc["run"], a.job)] = SlotPool(
                        self.memory, [self.memory.tensor(r) for r in desc["slots"].get((a.job, a.replica), ())])
            self.claim_first_upload(step, desc)
            if desc["trace"]:
                step.tracer = Tracer([self.device], [self.label], self.clock)
                step.trace_shift = step.tracer.t0 - desc["t0"]
            else:
                step.tracer = None
            early = [(_run_order(m, step.run_no), m) for m in self.early.pop(step_id, [])]
            later = [m for order, m in early if order > 0]
            if later:
                self.early[step_id] = later
        for order, m in early:
            if order == 0:
                self.apply(step, m)
        for a in desc["actions"]:
            if a.device == self.index:
                self.jobs.put((step, a, plan))

    def claim_first_upload(self, step, desc):
        """The weights a "prefetch" sent up for the first job this worker runs in this run (the
        run's first job; with replicas, this worker's copy of it) become that job's; any other
        early upload is dropped (its step started elsewhere)."""
        token = desc.get("first_upload", {}).get(self.index)
        first = next((a for a in desc["actions"] if a.device == self.index), None)
        for key in [k for k in self.dev.prefetched if k[0] == "first"]:
            future = self.dev.prefetched.pop(key)
            if token is not None and key == ("first", token) and first is not None:
                self.dev.prefetched[(id(step), first.job)] = future

    # --- jobs ----------------------------------------------------------------------------
    def run_jobs(self):
        self.dev.enter_thread()
        while True:
            item = self.jobs.get()
            if item is None:
                return
            compiled = len(warmup.first_calls)
            if isinstance(item, _Warm):
                self.warm(item)
            else:
                step, a, plan = item
                ex = step.exchanges.get(a.job)
                if self.kept_sum.key not in (None, ex and ex.kept_key):
                    self.kept_sum.release(self.dev)     # (another job's: its memory is not this job's to hold)
                # outputs too: the main process copies them out (_Output.resolve)
                self.dev.host_slots = self.dev.own_slots = self.pool(step, a.job).empty
                self.dry_runs.before_job(step, plan, plan.stages[a.stage], a.role)   # Note [dry runs]
                self.run_one(step, a, plan)
                step = None
            item = None
            if len(warmup.first_calls) > compiled:   # (after a job or a warm-up that compiled)
                timeline.freeze_survivors()     # Note [frozen after compiling] (timeline.py)

    def warm(self, item) -> None:
        """Dry-run the programs the main process names of this worker's jobs of a step to come
        (Note [first programs compiled beside the setup], dry_run.py); nothing where the plan did
        not load (the run says so). A failure here only leaves them to their jobs' first calls."""
        plan, desc = self.plans.get(item.plan_key), item.desc
        if not isinstance(plan, WorkerPlan):
            return
        try:
            programs = desc["programs"].get(self.index, [])
            micro = microbatches(desc["micro"])
            step = StandInStep(desc["params"], desc["buffers"], micro, desc["dtype"], plan.param_index,
                               plan.buffer_index)
        except Exception:   # noqa: BLE001 - as a failed dry run: the jobs compile at their first calls
            last = traceback.format_exc().strip().splitlines()[-1]
            timeline.mark(f"warm-up on {self.label} failed: {last}")
            return
        for stage, role in programs:
            self.dry_runs.before_job(step, plan, plan.stages[stage], role)

    def run_one(self, step: WorkerStep, a, plan: WorkerPlan):
        stage = plan.stages[a.stage]
        if step.replicated and self._group is None and step.error is None:
            try:     # made here, where every worker's first copy starts (Note [replicas in worker processes])
                self.replica_group()
            except BaseException as exc:
                step.fail(_failure(f"{self.label}: the worker processes' group for summing the replicas' gradients "
                                   "could not be made", exc, stage=stage.index, device=self.label, job=a.job,
                                   worker=self.index))
        links = JobLinks.of(a, lambda job: plan.stages[step.job_stage[job]])
        try:
            program = self.programs.get(plan.key, plan.capture_key, plan.capture_device, stage, a.role, self.device)
        except BaseException as exc:
            step.fail(_failure(f"stage {stage.index} ({a.role}) on {self.label}: building its program failed", exc,
                               stage=stage.index, device=self.label, job=a.job, worker=self.index))
            program = None
        if program is not None:
            before = warmup.compiled_graphs() if self.programs.inductor else None
            run_job(step, a.job, a.prev_job, stage, a.role, self.dev, program, links, a.microbatches, a.replica)
            compiled = 0 if before is None else warmup.compiled_graphs() - before
            if compiled:      # what no dry run compiled (Note [dry runs])
                timeline.mark(f"job {a.job} ({a.role}) on {self.label} compiled {compiled} graph(s)")
        self.finished(step, a)

    # Note [spans of a landing]: every step is traced, and a job's "landed" message carries its
    # spans, turned into times in the notifier thread (Tracer.resolve waits for each span's end
    # event). It took every span recorded until then, the next job's too, which this thread has
    # issued meanwhile: each landing waited for the next job's work on the device. Measured (2
    # H200s, Llama-3.1-8B, 32,768 tokens, M=2, delayed, the whole update on the devices; host clock
    # probes in both processes, benchmarks/runs/whole_share/): the forward job's landing was sent
    # as the fused job's compute ended, the fused job's as the next backward job's compute ended
    # (0.45 s after its gradients were down), and the optimizer's chunks waited so. So finished()
    # detaches the spans recorded up to this job's end, which are all done once the landing's events
    # (recorded after them on every stream) are; the next job's go with its own landing.
    def finished(self, step: WorkerStep, a):
        """Tell the main process the job has ended ("ended": issued; its gradient keys, outputs
        and error), then, in the notifier thread once all its copies completed, "landed" (Note
        [worker processes]): the main process starts the next step at "ended", as worker threads
        do, while this device still computes."""
        grads = step.param_grads.get(a.job, {})
        outputs = {mb: dict(m.outputs) for mb, m in enumerate(step.micro) if m.outputs}
        for m in step.micro:
            m.outputs.clear()
        # this job's failure, or the worker's own (job None); a job stopped by another's failure says so
        err = step.error if isinstance(step.error, StageError) and step.error.job in (a.job, None) else None
        aborted = step.error is not None and err is None
        # Buffers the job updated (running statistics): not found by version counters, which
        # batch norm's kernels do not bump; a recompute ("bwd") updates none.
        stage = step.plan.stages[a.stage]
        buffers = {} if a.role == "bwd" else {i: step.buffers[i].clone() for i in stage.buffers
                                               if i in step.plan.mutated_buffers}
        pool, run_no = self.pool(step, a.job), step.run_no
        pending = _pending_events(outputs)
        handed = {} if err is not None or aborted or not self.peers else handed_later(step, a, self.memory, pool)
        self.to_main(("ended", step.step_id, run_no, a.job, {
            "handed": handed,
            "grads": list(grads), "outputs": {mb: encode(o, self.memory, pool) for mb, o in outputs.items()},
            "outputs_copied": not pending, "replica": a.replica,    # Note [outputs before the landing]
            "buffers": buffers, "error": None if err is None else describe(err), "aborted": aborted}))
        if pending:      # (the notifier takes them in order: these before the job's landing)
            def outputs_landed(*_):
                self.to_main(("outputs", step.step_id, run_no, a.job, a.replica))
            self.later(pending, outputs_landed, outputs_landed)
        # Note [spans of a landing]: this job's spans, not those the next job records meanwhile
        raw = step.tracer.detach() if step.tracer is not None else []
        events = []
        if self.is_cuda:
            for s in (self.dev.compute, self.dev.weights_in, self.dev.acts_in, self.dev.out):
                ev = torch.cuda.Event()
                ev.record(s)
                events.append(ev)
        calls = warmup.first_calls[self.first_calls_sent:]
        self.first_calls_sent += len(calls)

        def landed(error=None):
            spans = []
            if error is None and step.tracer is not None:
                try:
                    spans = step.tracer.resolve(raw, step.trace_shift)
                except Exception as exc:  # noqa: BLE001 - an instrument: the job's copies did land
                    timeline.mark(f"spans of job {a.job} lost: {type(exc).__name__}: {exc}")
            self.to_main(("landed", step.step_id, run_no, a.job,
                          {"replica": a.replica, "spans": spans, "first_calls": [(self.label, sec) for _, sec in calls],
                           "marks": timeline.take_new(),
                           # bytes held by torch's caching host allocator here (pin_memory=True blocks)
                           "pinned": (self.index, self.label, warmup.pinned_bytes(self.device)),
                           # this device's peaks in this process (the main process's allocator sees none of it)
                           "device_peaks": (self.index, self.label, *warmup.device_peaks(self.device)),
                           "error": error, "failed": err is not None or aborted,
                           "chunks": [self.memory.ref(c) for c in pool.created],
                           "dropped": [self.memory.ref(c) for c in pool.dropped()]}))
        # if waiting for the copies failed, the main process hears so (it waits for "landed")
        self.later(events, landed, lambda exc: landed(f"{type(exc).__name__}: {exc}"))


# Note [values a later run reads]: a step's runs (a differentiable call's forward, then its
# backward) hand values on as one run does, each job's to the other workers in "done" messages,
# and a worker drops one of a run that ended before it started the next (Note [hand-overs of a
# run]). Within a run a worker waits for the messages of every job before its own, so it has
# them all; it never waits for those of jobs after its last one, and a later run may read them
# there: the loss's job's gradients of its inputs (Note [the loss's backward ahead] in
# runner.py), or with 3 or more workers a boundary a backward job recomputes from. Such a
# message came after the reader had started the next run, under load: the backward jobs ran
# from no gradient (gradients up to the largest's size off eager's, in 3 of 6 runs on two
# loaded CPU cores). So each job also names those values to the main process ("handed"), which
# sends them with the next run once their copies landed (a later job's value of a name winning,
# as in a run: a gradient summed over parts); the run applies them before its seeds (the main
# process's gradients, which may drop them again).
def handed_later(step, a, memory, pool) -> dict:
    """{mb: {(kind, name): Ref}} of the values job `a` handed on that a later run of the step
    reads (Note [values a later run reads]); {} for a copy's (its values stay with it). Values
    the peers got are named as they were sent."""
    if not a.then_reads or step.replicated:
        return {}
    pos, out = step.position[a.job], {}
    for mb, owner in enumerate(step.owner):
        values = {key: v for key, (at, v) in owner.items() if at == pos
                  and (key[1] if key[0] == "acts" else ("grad", key[1])) in a.then_reads}
        if values:
            sent = [step.sent.get((mb, key), (None, None)) for key in values]
            out[mb] = {key: enc if v is value else encode(value, memory, pool)
                       for (key, value), (v, enc) in zip(values.items(), sent)}
    return out


# Note [hand-overs of a run]: a step's runs (a call's forward, then its backward) reuse its job
# numbers, and a peer's "done" for the next run can reach this worker before the main process's
# "run" message that starts it here (they come on different connections): applied then, it
# marked the old run's job, and start_run's fresh events lost it, so the run's later jobs
# waited for it forever (both workers of a differentiable call's backward, once in CI). A
# "done" names its run: one of a run not started here waits with the step's early messages,
# one of an ended run is dropped.
def _run_order(msg, run_no) -> int:
    """1: a hand-over of a run after `run_no`, -1: of one before it, 0: of it (or not a hand-over)."""
    return (msg[2] > run_no) - (msg[2] < run_no) if msg[0] == "done" else 0


def _pending_events(outputs) -> list:
    """Note [outputs before the landing]: a job's outputs (a loss) come down before the job's
    last copies (its gradients, after the replicas' sum). The main process read them once the
    job landed, so train_step, which returns the loss, returned 50 ms after the jobs had ended
    (2 H200s, Qwen3-1.7B, replicas), and a loop that reads the loss before its next step (a
    progress bar, `float(loss)`) sent that step late by as much. So "ended" says whether every
    output's copy has completed: then the main process reads them at once, and the next step's
    job reaches its worker while the GPU still runs this one's tail. Otherwise the notifier
    says so ("outputs") as their copies complete, ahead of the landing: a job that ends while
    its GPU still computes (Note [buffers written back], job.py) ends before its loss is down.
    Measured (39th session, 2 H200s, Qwen3-1.7B, delayed, with Note [next weights during the
    step] in modes.py), read at "ended" against the landing: the GPU's idle time between the
    steps 66-71 -> 19-37 ms, median step 0.778 -> 0.752 s, 83,233 -> 85,745 tokens/s. Returns
    the events of the copies not complete yet."""
    leaves = pytree.tree_leaves(outputs, is_leaf=lambda v: isinstance(v, Pending))
    return [v.event for v in leaves if isinstance(v, Pending) and not v.event.query()]


def describe(err: StageError) -> dict:
    cause = err.__cause__
    return {"message": err.message, "stage": err.stage, "microbatch": err.microbatch, "device": err.device,
            "job": err.job, "worker": err.worker, "cause": None if cause is None else type(cause).__name__,
            "traceback": "".join(traceback.format_exception(cause)) if cause is not None else ""}


def _load_plan(data: bytes):
    """The plan's bytes loaded; where they name an operator this process lacks, after importing
    the model's modules, one of which may register it (Note [early workers])."""
    try:
        return portable.loads(data)
    except (pickle.UnpicklingError, ImportError, AttributeError):
        modules = list(filter(None, os.environ.get("RPCOMPILE_WORKER_IMPORTS", "").split(",")))
        if not modules or set(modules) <= set(sys.modules):
            raise
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:   # noqa: BLE001 - said with the error of the load below
            failed.append(f"{name} ({type(e).__name__}: {e})")
    timeline.mark("model's modules imported")
    try:
        return portable.loads(data)
    except Exception as e:
        if not failed:
            raise
        raise pickle.UnpicklingError(f"{e}; of the model's modules, this process could not import "
                                     f"{'; '.join(failed)}") from e


# Note [compile stack imported early]: a worker that compiles its stages imported TorchDynamo
# and Inductor (and, for a GPU, their Triton code generation) at its first program build, after
# it was given its part: "program built" took 3.7 s on an H200 host, 0.2 s once they were
# imported. It waits longer than that for its part (the main process captures and plans the
# model meanwhile: 11-15 s for Qwen3-1.7B), so it imports them while it waits, in a thread that
# is joined before anything else runs (no two threads import at once).
_COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx")
_COMPILE_STACK_GPU = ("triton", "torch._inductor.codegen.triton", "torch._inductor.runtime.triton_heuristics")


def _import_compile_stack(device_type):
    if not device_type:
        return None

    def run():
        t0 = time.perf_counter()
        try:
            for name in _COMPILE_STACK + (_COMPILE_STACK_GPU if device_type == "cuda" else ()):
                importlib.import_module(name)
        except Exception:   # noqa: BLE001 - the first build imports what it needs, and reports what fails
            return
        timeline.mark("compile stack imported", time.perf_counter() - t0)
    t = threading.Thread(target=run, name="rpcompile-imports", daemon=True)
    t.start()
    return t


def main():
    # Ctrl-C reaches the whole process group: the main process decides, then stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    directory, index, token = os.environ["RPCOMPILE_WORKER_DIR"], int(os.environ["RPCOMPILE_WORKER_INDEX"]), \
        bytes.fromhex(os.environ["RPCOMPILE_WORKER_TOKEN"])
    timeline.set_where(f"worker {index}")
    timeline.mark_long_collections()
    timeline.mark("imported")
    try:
        server = serve_socket(os.path.join(directory, f"w{index}.sock"))
        main_conn = connect(os.path.join(directory, "main.sock"), token)
    except OSError:
        if os.path.isdir(directory):
            raise
        # Its model went before it started (Note [early workers]: a first call that failed at once,
        # before the launcher forked it, removed the directory), and the kill sent after the fork
        # had not come yet: nobody waits for it (it printed a FileNotFoundError's traceback).
        return
    send(main_conn, threading.Lock(), ("hello", index))
    importing = _import_compile_stack(os.environ.get("RPCOMPILE_WORKER_COMPILES"))
    _, init = recv(main_conn)
    timeline.mark("given its part")
    if importing is not None:
        importing.join()
    # the main process's import path: a model's module found there (a script's folder) unpickles here
    sys.path[:] = init["sys_path"] + [p for p in sys.path if p not in init["sys_path"]]
    if os.environ.get("RPCOMPILE_WORKER_SWITCH_MS"):   # an instrument (benchmarks): the lock's switch interval
        sys.setswitchinterval(float(os.environ["RPCOMPILE_WORKER_SWITCH_MS"]) * 1e-3)
    t0 = time.perf_counter()
    worker = Worker(index, init, main_conn)
    timeline.mark("set up", time.perf_counter() - t0)
    n = init["workers"]
    for j in range(index):                       # connect to the lower indices, accept the higher
        conn = connect(os.path.join(directory, f"w{j}.sock"), token)
        send(conn, threading.Lock(), ("peer", index))
        worker.peers[j] = (conn, threading.Lock())
    for _ in range(index + 1, n):
        conn = accept(server, token, timeout=120)
        _, j = recv(conn)
        worker.peers[j] = (conn, threading.Lock())
    server.close()
    timeline.mark("peers connected")
    notifier = threading.Thread(target=worker.notifier, name="rpcompile-notifier", daemon=True)
    notifier.start()
    threading.Thread(target=worker.receiver, name="rpcompile-receiver", daemon=True).start()
    worker.to_main(("ready", index))
    worker.run_jobs()
    worker.notices.put(None)
    notifier.join(timeout=10)
    worker.dev.close()
    # This process holds nothing of the user's: leave without the interpreter's and C++'s
    # teardown, where threads torch started abort the exit now and then ("terminate called").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

