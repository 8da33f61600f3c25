"""The setup timeline: when each process of a compiled model finished each part of its first
steps (capture, plan, worker start, working copies, plan and weights in the workers, programs
built, calls that compiled, jobs ended), on one wall clock.

Note [setup timeline]: the first four steps at 4 GPUs took 108-145 s (Qwen3-1.7B on 4 H200s,
cold Inductor cache; the issue's bar is 60 s), yet py-spy found the main process busy for 57 s
of them and each worker process for 37-47 s (28th session): most of the time is waiting, which
a profile of busy samples does not place. So each process marks what it finished and how long
it took; worker processes send their marks with their landed jobs, and `setup_timeline()` lists
them all in time order. Only the first marks are kept (LIMIT): steady steps add none after the
first steps, since what every step repeats is marked for the first steps only (`mark_early`).
"""
from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Optional

LIMIT = 4000           # marks kept per process
RECEIVED = 8 * LIMIT   # marks kept from worker processes (as many as eight workers' own)
EARLY = 40             # marks per kind for what repeats every step (jobs, steps): the first steps'

_marks: list = []      # (wall time, where, what, seconds or None)
_sent = 0              # marks a worker process has sent so far
_where = ["main"]
_counts: dict = {}     # kind -> marks made by mark_early
_lock = threading.Lock()


def set_where(where: str) -> None:
    """Name this process's marks (a worker process: its index and device)."""
    _where[0] = where


def mark(what: str, seconds: Optional[float] = None) -> None:
    """`what` ended now (after `seconds`, if given)."""
    if len(_marks) < LIMIT:
        with _lock:
            _marks.append((time.time(), _where[0], what, None if seconds is None else round(seconds, 3)))


# Note [long collections]: one timed step in eight 2-GPU runs took 1.13 s against a median of
# 0.74 s (Qwen3-1.7B, 39th session), the third step after the compiling first one; a full
# collection of the cyclic garbage collector in a process that compiled walks every object the
# compile left alive (the thirtieth session counted 5 full collections, 1.9-2.5 s, in a first
# step). So each process marks the collections that take LONG_COLLECTION_S or more. The next run
# (2 H200s, 40 timed steps, none slow) marked 12 full collections, all in the first step: the
# main process 2 (0.31, 0.35 s), each worker 5 (0.11-0.30 s); none in the timed steps.
LONG_COLLECTION_S = 0.05
_gc_start = [0.0]


def mark_long_collections() -> None:
    """From now on, mark this process's garbage collections of LONG_COLLECTION_S or more."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


# Note [frozen after compiling]: with the collections marked, the 40th session caught them in
# the timed steps: five full collections in two worker processes (0.20-0.41 s each, 2 H200s,
# Qwen3-1.7B, 120 and 200 timed steps), each in a slow step (0.52-0.71 s against a median of
# 0.39 s). A full collection walks every object the process tracks, and a worker's are mostly
# what compiling its programs left alive (graphs, guards, Inductor's modules), which live as long
# as the process. So a worker collects once after a job whose calls compiled, and freezes what
# survives (gc.freeze: later collections skip it); the steps' own objects are collected as ever.
# A/B, one run each side, 150 timed steps (41st session, same workload): without the freeze two
# full collections in the timed steps (0.41, 0.25 s) made the two slowest steps (0.75, 0.58 s
# against a median of 0.38 s); with it none, and no step above 0.42 s but the last (the drain).
def freeze_survivors() -> None:
    """Collect, then exempt every surviving object from later collections (Note [frozen after
    compiling])."""
    collect()
    gc.freeze()


# Note [a collection of its own]: gc.collect() called while another thread's collection is under
# way (it runs finalizers, which can hand the interpreter lock over) returns 0 at once and collects
# nothing (CPython's `gcstate->collecting`). freeze_survivors would then freeze the garbage it
# meant to free, and the suite's tests of collections failed once in CI (a first run at 325164b;
# a worker thread of an earlier test was collecting). So a collection that must happen is asked
# again until a full one has run in this thread.
def collect() -> None:
    """A full garbage collection in this thread, waiting out one that another thread runs."""
    me = threading.get_ident()
    ran = []

    def seen(phase, info):
        if phase == "stop" and info["generation"] == 2 and threading.get_ident() == me:
            ran.append(True)
    gc.callbacks.append(seen)
    try:
        for _ in range(1000):
            gc.collect()
            if ran:
                return
            time.sleep(0.001)     # (the other thread's collection ends meanwhile)
    finally:
        gc.callbacks.remove(seen)


def _on_gc(phase, info) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    seconds = time.perf_counter() - _gc_start[0]
    if seconds >= LONG_COLLECTION_S and len(_marks) < LIMIT:
        # (not under _lock: a collection can start while this thread holds it)
        _marks.append((time.time(), _where[0], f"garbage collection: generation {info['generation']}, "
                       f"{info['collected']} collected", round(seconds, 3)))


# Note [compile seconds by phase]: a dry run's mark (Note [dry runs], dry_run.py) says how long
# a program took to compile, not where: Qwen3-1.7B's first program took 36 s on 2 H200s (45th
# session), its three pieces' forwards 7-14 s each, and nothing said how much of that was
# TorchDynamo's tracing, AOTAutograd, Inductor's lowering and code generation, the Triton compiles
# it waits for, or the autotuning at a kernel's first launch. TorchDynamo times each of those
# (`dynamo_timed`: torch._dynamo.utils.compilation_time_metrics, which compile_times() prints), so
# after each dry run a worker marks those totals so far of at least COMPILE_PHASE_S, named
# "compile seconds so far: <what> (<calls> calls)", and so does the main process after a capture
# (its TorchDynamo trace). The phases nest: a frame's compile holds its AOTAutograd's, which holds
# Inductor's. (The first reading found 7 s of autotuning at first launches in that program, most
# of it written arguments copied to the host and back: Note [autotune's clones on the device],
# autotune.py.) Worker threads compile in their first calls (warmup.py), unmarked so.
COMPILE_PHASE_S = 0.1


def mark_compile_seconds() -> None:
    """Mark this process's compile seconds so far by phase (Note [compile seconds by phase])."""
    utils = sys.modules.get("torch._dynamo.utils")          # not imported: nothing compiled
    metrics = dict(getattr(utils, "compilation_time_metrics", None) or {})
    for what, values in sorted(metrics.items(), key=lambda kv: -sum(kv[1])):
        total = sum(values)
        if total >= COMPILE_PHASE_S:
            mark(f"compile seconds so far: {what} ({len(values)} calls)", total)


def mark_early(kind: str, what: str, *args, seconds: Optional[float] = None) -> None:
    """As mark, for something every step repeats (a job, a step): only the first EARLY of a kind;
    `what` is formatted with args only then (a job's end is on every step's path)."""
    n = _counts.get(kind, 0)
    if n < EARLY:
        _counts[kind] = n + 1
        mark(what.format(*args) if args else what, seconds)


def take_new() -> list:
    """The marks made since the last call (a worker process sends them with a landed job)."""
    global _sent
    with _lock:
        new, _sent = _marks[_sent:], len(_marks)
    return new


def extend(marks: list) -> None:
    """Marks another process sent."""
    with _lock:
        _marks.extend(marks[:max(0, LIMIT + RECEIVED - len(_marks))])


def reset() -> None:
    """Forget every mark and count (a process that starts over, such as a test)."""
    global _sent
    with _lock:
        _marks.clear()
        _counts.clear()
        _sent = 0


def setup_timeline() -> list:
    """Every mark so far, in time order: [{"t": seconds after the first, "where", "what",
    "seconds"}]."""
    with _lock:
        marks = sorted(_marks)
    t0 = marks[0][0] if marks else 0.0
    return [{"t": round(t - t0, 3), "where": where, "what": what, "seconds": sec} for t, where, what, sec in marks]
