"""Worker processes forked from a launcher that imported them once (Note [worker launcher]).

Note [worker launcher]: a worker process (runtime/worker.py) began as a fresh interpreter that
imported torch and rpcompile before it connected: 2.7 s of a core each (67th session, the CI's
kind of 2-core sandbox), for every worker of every compiled model; the test suite started 59
of them. So the first worker a process needs starts a launcher: an interpreter that imports
the worker's modules once and forks each worker from itself. It holds no thread and has touched
no GPU, so a fork is safe there (never of the main process, whose threads and CUDA context a
fork would break), and a child sets its own environment (CUDA_VISIBLE_DEVICES among it) before
anything reads it. What an interpreter reads as it starts (PYTHONPATH, a sitecustomize, torch's
import-time settings) is the launcher's, so a launcher serves one environment, less the
variables each worker gets of its own (_OWN); another environment gets a launcher of its own,
and the last one's is closed (it ends once its children have). A sitecustomize that looks for a
worker's own variables at start finds the launcher's RPCOMPILE_LAUNCHER_FDS there instead
(tests/aot_eager_workers).

The launcher reaps its children and reports their ends; the main process holds a Popen-like
handle (`Forked`: poll, wait, kill, returncode, pid). A handle is given at once: its worker is
forked once the launcher has imported (the first model's workers import while it captures, as
Note [early workers] wants). A reader thread takes the launcher's reports, so a handle's poll
takes no lock (a finalizer polls: Note [finalizers take no lock] in shared.py). The launcher
ignores Ctrl-C, as the workers do (the main process decides, then stops them), and ends once
the main process has gone and its children have ended.

Note [workers of a main process that died]: a main process that ends without stopping its
workers (os._exit, SIGKILL, a SIGTERM to it alone: no exit handler runs) closes its connections,
but a worker waiting inside a job (a delayed-mode backward job waiting for a gradient piece
the optimizer holds) never reads them, and it lived on, with the launcher that waits for it,
holding the caller's stdout (`python train.py | tail` never returned). The launcher polls its
parent as it reaps: once it is another process (reparented), it kills its children and, once
they have ended, removes the run directories whose owner has gone (Note [stale shared files],
shared.py), as it does when its parent went while idle workers ended on their own (the
directory stayed until the next run: seen with CUDA workers, on one H200). A child dies with the launcher (PR_SET_PDEATHSIG, Linux), should that be killed
first (a SIGTERM to the process group).

Measured (67th session), on the 2-core sandbox, runs alternating: tests/test_processes.py and
test_replicas.py 152.6 and 154.0 s a run before, 128.6 and 131.5 s with the launcher; on one
H200 (Qwen3-1.7B, delayed mode, worker processes) the same throughput, setup and host peak as
before within the runs' swing, and GPU parity as before (benchmarks/runs/launcher/).
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as wait_connections
from typing import Optional

# each worker's own variables: set in the child, not part of the launcher's environment.
# PYTEST_CURRENT_TEST: pytest names the running test in os.environ, so a user's test suite (and
# ours) started a launcher per test, each importing torch again. _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR:
# an address in this process that Inductor writes into os.environ before it loads each CPU kernel
# module (and so again in a worker before that worker loads one): after the first such kernel here,
# the next worker started a launcher of its own (one more torch import, 3 s in a suite run)
_OWN = ("RPCOMPILE_WORKER_DIR", "RPCOMPILE_WORKER_INDEX", "RPCOMPILE_WORKER_TOKEN", "RPCOMPILE_WORKER_IMPORTS",
        "RPCOMPILE_WORKER_COMPILES", "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_COMPILE_THREADS", "PYTEST_CURRENT_TEST",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
_FDS = "RPCOMPILE_LAUNCHER_FDS"
# TorchDynamo too: every worker runs the transfer ops (torch.library custom ops), whose kernels
# torch wraps to disable TorchDynamo, and that wrapper imports it at its first call: 0.7 s a
# worker, each forked worker of the suite's (74 in one run) importing it again.
_IMPORTS = ("rpcompile.runtime.worker", "torch._dynamo")
_REAP_S = 0.05


class Forked:
    """A worker process the launcher forked, as subprocess.Popen shows one."""

    def __init__(self, launcher: "Launcher", seq: int):
        self._launcher, self._seq = launcher, seq

    @property
    def pid(self) -> int:
        """(waits until the launcher has forked it)"""
        pid = self._launcher.pid_of(self._seq)
        if pid is None:
            raise ProcessLookupError(f"the worker launcher ended before it forked this worker "
                                     f"(exit code {self._launcher.proc.poll()})")
        return pid

    @property
    def returncode(self) -> Optional[int]:
        return self._launcher.returncode_of(self._seq)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("rpcompile worker", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        self._launcher.kill(self._seq)


class Launcher:
    """One launcher process (see the Note) and the reports it sent."""

    def __init__(self, env: dict):
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", "from rpcompile.runtime.launcher import serve; serve()"],
                                     env={**env, _FDS: f"{req_r},{rep_w}"}, pass_fds=(req_r, rep_w))
        os.close(req_r)
        os.close(rep_w)
        self._req = Connection(self._req_w, readable=False)
        self._send = threading.Lock()
        self._seqs = 0
        self.pids: dict = {}             # seq -> pid, once forked
        self.ended: dict = {}            # seq -> exit code (as Popen's: -N for signal N); by seq: pids are reused
        self.to_kill: set = set()        # seqs killed before they were forked
        self._forked = threading.Condition()
        self.gone = False                # the launcher's reports ended
        self.owner = os.getpid()         # (a process forked from this one starts a launcher of its own)
        threading.Thread(target=self._read, name="rpcompile-launcher-reports", daemon=True).start()

    def start(self, env: dict) -> Forked:
        with self._send:
            self._seqs += 1
            seq = self._seqs
            self._req.send(("fork", env, os.getcwd()))
        return Forked(self, seq)

    def close(self) -> None:
        """No more forks: the launcher ends once its children have."""
        with self._send:
            self._req.close()

    def _read(self):
        rep = Connection(self._rep_r, writable=False)
        seq = 0
        try:
            while True:
                msg = rep.recv()
                if msg[0] == "forked":
                    seq += 1
                    with self._forked:
                        self.pids[seq] = msg[1]
                        self._forked.notify_all()
                    if seq in self.to_kill:
                        _kill(msg[1])
                elif msg[0] == "ended":
                    self.ended[msg[1]] = msg[2]
        except (EOFError, OSError):
            pass
        finally:
            rep.close()
            with self._forked:
                self.gone = True
                self._forked.notify_all()

    def pid_of(self, seq: int) -> Optional[int]:
        with self._forked:
            self._forked.wait_for(lambda: seq in self.pids or self.gone)
            return self.pids.get(seq)

    def returncode_of(self, seq: int) -> Optional[int]:
        # (no lock: a finalizer may ask)
        pid = self.pids.get(seq)
        if pid is None:         # never forked (yet): the launcher's end says why
            code = self.proc.poll()
            return code if code is not None or not self.gone else -signal.SIGKILL
        code = self.ended.get(seq)
        if code is None and self.gone:        # its end unreported: the launcher died first
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGKILL
        return code

    def kill(self, seq: int) -> None:
        self.to_kill.add(seq)
        pid = self.pids.get(seq)
        if pid is not None and seq not in self.ended:
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_launchers: dict = {}       # the environment's key -> its Launcher (the last one)
_lock = threading.Lock()


def start_worker(env: dict) -> Forked:
    """A worker process (`from rpcompile.runtime.worker import main; main()`) in environment
    `env`, forked by the launcher of that environment (started here if there is none)."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _OWN))
    with _lock:
        launcher = _launchers.get(key)
        if launcher is None or launcher.owner != os.getpid() or launcher.gone or launcher.proc.poll() is not None:
            for old in _launchers.values():       # (it ends once its workers have)
                old.close()
            _launchers.clear()
            launcher = _launchers[key] = Launcher({k: v for k, v in env.items() if k not in _OWN})
    return launcher.start(env)


def serve() -> None:
    """The launcher process: import the worker, then fork one a request until the main process
    has gone, reaping the children and reporting their ends; end once they all have."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    req_fd, rep_fd = map(int, os.environ.pop(_FDS).split(","))
    req, rep = Connection(req_fd, writable=False), Connection(rep_fd, readable=False)
    for name in _IMPORTS:                   # what every child would import
        importlib.import_module(name)
    children, forks, open_ = {}, 0, True      # children: pid -> the request's number (from 1)
    main, orphaned, launcher_pid = os.getppid(), False, os.getpid()
    while open_ or children:
        if not orphaned and os.getppid() != main:    # Note [workers of a main process that died]
            orphaned, open_ = True, False
            for pid in children:
                _kill(pid)
        if open_ and wait_connections([req], timeout=_REAP_S):
            try:
                _, env, cwd = req.recv()
            except (EOFError, OSError):
                open_ = False
                req.close()
            else:
                pid = os.fork()
                if pid == 0:
                    _child(req_fd, rep_fd, env, cwd, launcher_pid)
                forks += 1
                children[pid] = forks
                _report(rep, ("forked", pid))
        elif not open_:
            time.sleep(_REAP_S)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            if pid in children:
                _report(rep, ("ended", children.pop(pid), os.waitstatus_to_exitcode(status)))
    if orphaned or os.getppid() != main:     # (its workers may have ended on their own, idle)
        from .shared import remove_stale_directories
        remove_stale_directories()


def _report(rep, msg) -> None:
    try:
        rep.send(msg)
    except OSError:       # the main process has gone
        pass


def _die_with_parent(parent: int) -> None:
    """Note [workers of a main process that died]: SIGKILL this process when the launcher (the
    forking thread: it has no other) ends, where Linux offers it."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):     # not Linux
        return
    if os.getppid() != parent:            # it ended before the call
        os._exit(1)


def _child(req_fd, rep_fd, env, cwd, parent) -> None:
    _die_with_parent(parent)
    os.close(req_fd)
    os.close(rep_fd)
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from .worker import main
        main()
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:      # noqa: BLE001 - printed as a fresh interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
