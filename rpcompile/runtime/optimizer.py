"""Overlapped host optimizer: steps parameters in a thread while the devices go on.

Note [overlapped optimizer]: after a step's gradients have landed, `train_step` hands them
here and returns. This thread clips them (global norm, if asked), then steps the user's
optimizer chunk by chunk in the order the next forward reads the parameters, refreshes each
chunk's pinned working copies, and marks the chunk ready; the next step's jobs wait only for
the parameters they read. Then it steps the LR scheduler. Per-parameter optimizers
(SGD, Adam, AdamW, ...) give exactly the results of `clip; opt.step(); sched.step()`.

Without clipping, a parameter's step does not depend on other gradients, so the runner can
hand over each parameter as soon as the last job that makes its gradient has finished (`early`
submissions; GraphRunner.early_hand_over, off by default: its undo copies cost more than it
saves), while later backward jobs still run. A step that then fails must leave
parameters and optimizer state as they were: early submissions keep an undo copy of each
parameter and its optimizer state, restored by `rollback()` and dropped by the step's final
submission.
"""
from __future__ import annotations

import queue
import threading
import weakref

import torch


class OverlappedOptimizer:
    def __init__(self, optimizer, *, lr_scheduler=None, max_grad_norm=None, chunks: int = 32):
        self.optimizer, self.lr_scheduler, self.max_grad_norm = optimizer, lr_scheduler, max_grad_norm
        self.chunks = chunks
        self._ready: dict = {}                  # id(param) -> threading.Event
        self._queue: queue.Queue = queue.Queue()
        self._completed = 0                     # submissions stepped (or failed)
        self._undo: list = []                   # (param, its values, its optimizer state) of early steps
        self._completed_cond = threading.Condition()
        self._error = None
        self._thread = threading.Thread(target=self._loop, name="rpcompile-optimizer", daemon=True)
        self._thread.start()
        # Ended and joined at exit while the interpreter is whole (see executor._stop).
        weakref.finalize(self, _stop_thread, self._queue, self._thread)

    def _event(self, p):
        ev = self._ready.get(id(p))
        if ev is None:
            ev = self._ready[id(p)] = threading.Event()
            ev.set()
        return ev

    def wait_param(self, p):
        """Block until the pending optimizer step of `p` is done."""
        self._event(p).wait()
        if self._error is not None:
            raise RuntimeError(f"the overlapped optimizer step failed: {self._error}") from self._error

    def is_ready(self, p) -> bool:
        """True when `p` has no pending optimizer step (never blocks)."""
        return self._event(p).is_set()

    def submit(self, grads: list, refresh=None, others=(), *, early=False):
        """Step [(param, grad), ...] (grads in use order) in the background; refresh(p) after
        each parameter is stepped, and for each of `others` (parameters without a gradient).
        A grad may be a callable that returns it (resolved in the optimizer thread).
        early: part of a step still running (no clipping, no scheduler step, undo copies kept);
        the step's last submission is not early."""
        if not early:
            self.raise_if_failed()
        for p, _ in grads:
            self._event(p).clear()
        self._queue.put((grads, refresh, list(others), early))

    @property
    def splits_steps(self) -> bool:
        """Whether a step may be handed over in parts (no clipping needs all gradients first)."""
        return self.max_grad_norm is None

    def rollback(self):
        """After a failed step: wait for its early submissions, then put back the parameters
        and optimizer state they changed."""
        self._queue.join()
        with torch.no_grad():
            for p, value, state in reversed(self._undo):
                p.copy_(value)
                if state is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = state
        self._undo = []

    def wait_completed(self, count: int, raise_errors: bool = True):
        """Block until at least `count` submissions have been stepped (and raise a failure of
        theirs here, unless raise_errors is False: it is then left for the caller's thread)."""
        with self._completed_cond:
            self._completed_cond.wait_for(lambda: self._completed >= count)
        if raise_errors:
            self.raise_if_failed()

    def synchronize(self):
        """Wait until every submitted step is done (before reading parameters or optimizer state)."""
        self._queue.join()
        self.raise_if_failed()

    def raise_if_failed(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the overlapped optimizer step failed: {err}") from err

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._run(*item)
            # The submission (its gradients, and the step they come from) is dropped before waiting.
            item = None
            with self._completed_cond:
                self._completed += 1
                self._completed_cond.notify_all()
            self._queue.task_done()

    def _run(self, grads, refresh, others, early):
        try:
            self._step(grads, refresh, early)
            if refresh is not None:
                for p in others:
                    refresh(p)
        except BaseException as exc:  # surfaced in the caller's thread by the next call
            self._error = exc
        finally:
            for p, _ in grads:
                self._event(p).set()

    def _keep_undo(self, chunk):
        for p, _ in chunk:
            state = self.optimizer.state.get(p)
            saved = None if state is None else {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            self._undo.append((p, p.detach().clone(), saved))

    def _step(self, grads, refresh, early=False):
        grads = [(p, g() if callable(g) else g) for p, g in grads]
        scale = 1.0
        if self.max_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in grads]))
            scale = min(1.0, float(self.max_grad_norm) / (float(norm) + 1e-6))
        size = max(1, -(-len(grads) // self.chunks))
        for start in range(0, len(grads), size):
            chunk = grads[start:start + size]
            if early:
                self._keep_undo(chunk)
            for p, g in chunk:
                p.grad = g if scale == 1.0 else g * scale
            self.optimizer.step()
            for p, _ in chunk:
                p.grad = None
                if refresh is not None:
                    refresh(p)
                self._event(p).set()
        if early:
            return
        self._undo = []        # the step succeeded: its early parts stay
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()


def _stop_thread(q, thread):
    q.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=10)
