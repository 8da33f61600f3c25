"""The executed schedule: rotation, prefetch order and event order, read off cm.last_trace."""
import json

import torch

import pytest

import rpcompile

from models import lm_batch, qwen3
from rpcompile.runtime.trace import Tracer

N = 3   # devices


@pytest.fixture(scope="module")
def ran():
    """qwen3 on 3 CPU devices, 2 microbatches, trained 2 steps: (cm, placements of each step,
    trace of each step). The tests only read it."""
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * N, num_microbatches=2,
                                                   memory_budget="250KiB"))
    placements, traces = [], []
    for _ in range(2):
        cm.train_step(**lm_batch())
        placements.append(cm.last_placements)
        traces.append(cm.last_trace)
    return cm, placements, traces


def test_jobs_run_on_the_devices_the_rotation_names(ran):
    cm, placements, traces = ran
    J = len(cm.plan.stages)
    assert J >= 4
    offset = 0
    for step_places in placements:
        for k, (job, stage, role, device) in enumerate(step_places):
            assert device == (offset + k) % N
        offset = (offset + J) % N
    trace = traces[-1]
    for job, stage, role, device in placements[-1]:
        spans = [s for s in trace if s.get("job") == job and s["name"] in ("forward", "forward+backward",
                                                                        "recompute+backward")]
        assert spans and all(s["worker"] == device for s in spans)


def test_prefetch_issued_before_previous_job_on_device_finished(ran):
    cm, placements, traces = ran
    trace = traces[-1]
    jobs = placements[-1]
    for k in range(N, len(jobs)):
        job = jobs[k][0]
        issue = [s for s in trace if s["name"] == "prefetch_issue" and s["job"] == job]
        if not cm.plan.stages[jobs[k][1]].params:
            continue
        prev_job = jobs[k - N][0]
        prev_end = max(s["end_s"] for s in trace if s.get("job") == prev_job and s["stream"] != "host")
        assert issue and issue[0]["start_s"] <= prev_end, f"job {job}: weights not prefetched during job {prev_job}"


def test_each_microbatchs_gradient_addition_is_compute(ran):
    """Note [gradients added per microbatch]: a job with gradients adds each microbatch's into its
    accumulator on the compute stream, traced there (so a device's busy time counts it) after the
    microbatch's compute; a forward job adds none."""
    cm, placements, traces = ran
    trace = traces[-1]
    for job, stage, role, device in placements[-1]:
        adds = sorted(s["microbatch"] for s in trace if s.get("job") == job and s["name"] == "add_gradients")
        if role == "fwd" or not cm.plan.stages[stage].params:
            assert adds == []
            continue
        assert adds == [0, 1] and all(s["stream"] == "compute" for s in trace if s["name"] == "add_gradients")
        for mb in (0, 1):
            add = next(s for s in trace if s.get("job") == job and s["name"] == "add_gradients" and s["microbatch"] == mb)
            compute = next(s for s in trace if s.get("job") == job and s["stream"] == "compute"
                           and s["name"] != "add_gradients" and s["microbatch"] == mb)
            assert compute["end_s"] <= add["start_s"]


def test_no_value_read_before_it_was_written(ran):
    trace = ran[2][-1]
    written = {(s["value"], s["microbatch"]): s["end_s"] for s in trace if s["name"] == "offload"}
    fetched = [s for s in trace if s["name"] == "fetch"]
    assert fetched
    for s in fetched:
        key = (s["value"], s["microbatch"])
        assert key in written and written[key] <= s["start_s"], f"{key} read before its offload finished"


def test_dump_writes_perfetto_trace(tmp_path, ran):
    cm = ran[0]
    cm.dump(str(tmp_path))
    data = json.loads((tmp_path / "schedule.trace.json").read_text())
    names = {e["name"] for e in data["traceEvents"]}
    assert {"forward", "recompute+backward", "fetch", "offload"} <= names
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in data["traceEvents"])


def test_trace_counts_bytes_moved(ran):
    cm, _, traces = ran
    trace = traces[0]       # the first step
    weights = sum(s["bytes"] for s in trace if s["name"] == "upload_weight")
    acts = sum(s["bytes"] for s in trace if s["name"] in ("fetch", "offload"))
    assert acts > 0
    # every parameter is read by at least one job of the step (no prefetch on CPU devices)
    assert weights >= sum(p.numel() * p.element_size() for p in cm.model.parameters())


def test_a_long_garbage_collection_is_marked(monkeypatch):
    """Note [long collections] (runtime/timeline.py): a collection at least LONG_COLLECTION_S long
    is a mark of its process, with its generation and seconds."""
    import gc

    from rpcompile.runtime import timeline
    timeline.reset()
    monkeypatch.setattr(timeline, "LONG_COLLECTION_S", 0.0)
    had = timeline._on_gc in gc.callbacks
    timeline.mark_long_collections()
    timeline.mark_long_collections()     # once per process
    try:
        assert gc.callbacks.count(timeline._on_gc) == 1
        timeline.collect()       # (Note [a collection of its own])
    finally:
        if not had:
            gc.callbacks.remove(timeline._on_gc)
    full = [r for r in timeline.setup_timeline() if r["what"].startswith("garbage collection: generation 2")]
    assert full and full[0]["where"] == "main" and full[0]["seconds"] >= 0.0


def test_survivors_of_a_compile_are_frozen_and_garbage_is_not():
    """Note [frozen after compiling]: a collection first (cyclic garbage is freed, not frozen), then
    what survives leaves the collector's generations."""
    import gc
    import weakref
    from rpcompile.runtime import timeline

    class Node:
        pass
    alive, dead = Node(), Node()
    dead.me = dead                 # a cycle nobody reaches
    gone = weakref.ref(dead)
    del dead
    before = gc.get_freeze_count()
    try:
        timeline.freeze_survivors()
        assert gone() is None and gc.get_freeze_count() > before and alive is not None
    finally:
        gc.unfreeze()


_ANOTHER_THREADS_COLLECTION = """
import gc, threading, time, weakref
from rpcompile.runtime import timeline

finalizing = threading.Event()


class Slow:
    def __del__(self):
        finalizing.set()
        time.sleep(0.3)        # (a finalizer that lets another thread run)


class Node:
    pass


def collecting():
    slow = Slow()
    slow.me = slow
    del slow
    gc.collect()


for collect in (gc.collect, timeline.collect, timeline.freeze_survivors):
    finalizing.clear()
    other = threading.Thread(target=collecting)
    other.start()
    finalizing.wait()
    dead = Node()
    dead.me = dead
    gone = weakref.ref(dead)
    del dead
    collect()
    assert (gone() is None) == (collect is not gc.collect), collect
    other.join()
print("ok")
"""


def test_a_collection_waits_out_another_threads():
    """Note [a collection of its own]: while another thread's collection runs a finalizer that
    lets go of the interpreter lock, gc.collect() here returns at once; timeline.collect() and
    freeze_survivors collect this thread's garbage all the same. In a process of its own: in a
    test worker each collection walked what the file's earlier tests left (12.7 s in a suite run,
    against about 2 s here), and freeze_survivors froze it."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", _ANOTHER_THREADS_COLLECTION], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stderr[-2000:]


def test_a_capture_marks_its_compile_seconds_by_phase(monkeypatch):
    """Note [compile seconds by phase] (runtime/timeline.py): after the capture the main process
    marks TorchDynamo's totals by phase, the trace of the model's frame among them."""
    import rpcompile.capture
    import rpcompile.compiled
    from rpcompile.runtime import timeline
    # a capture of its own: the suite's kept one (tests/capture_cache.py), where an earlier test
    # of this process captured the same model, would trace nothing
    monkeypatch.setattr(rpcompile.compiled, "capture_call", rpcompile.capture.capture_call)
    timeline.reset()
    cm = rpcompile.compile(qwen3(layers=1), rpcompile.Config(devices=["cpu"]))
    cm.train_step(**lm_batch(seed=0))
    marks = timeline.setup_timeline()
    whats = [r["what"] for r in marks]
    phases = [r for r in marks if r["what"].startswith("compile seconds so far: ")]
    assert any("compile_inner" in r["what"] and r["seconds"] > 0 for r in phases), whats
    assert all(r["where"] == "main" for r in phases) and whats.index(phases[0]["what"]) > whats.index("captured")


class _Event:
    """Stands for a CUDA event (none on CPU), put in torch.cuda.Event's place (a subclass cannot
    be made without a GPU on a CUDA build of torch): elapsed_time needs both events waited for, as
    torch's does ("Both events must be completed"), or it raises."""

    def __init__(self, ms):
        self.ms, self.done = ms, False

    def synchronize(self):
        self.done = True

    def elapsed_time(self, other):
        if not (self.done and other.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return other.ms - self.ms


def test_gpu_spans_wait_for_every_event_they_read(monkeypatch):
    """A GPU span's times are read against the device's start event, recorded on an idle stream:
    the span's end done does not make that event done (a stream can share a hardware queue with a
    busy one), and reading it unfinished raised (one H200, a small model's two worker processes,
    once in three runs: a worker's notifier printed it, and its landing carried the error)."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    tracer = Tracer([])
    tracer._cuda_t0["cuda:0"] = _Event(5.0)
    tracer.add("cuda:0", "compute", "forward", _Event(1005.0), _Event(3005.0), job=0)
    [span] = tracer.spans()
    assert (span["start_s"], span["end_s"]) == (1.0, 3.0)
