"""Overlapped optimizer mode: the host step runs beside the next step's jobs, results exact."""
import copy
import math

import pytest
import torch

import rpcompile

from models import lm_batch, qwen3
from parity import close


@pytest.mark.parametrize("devices,microbatches", [(1, 1), (2, 3), (4, 4)])
def test_overlapped_equals_eager_with_clipping_and_scheduler(devices, microbatches):
    model = qwen3(tied=True, layers=1)
    ref = copy.deepcopy(model)
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, memory_budget="300KiB",
                           optimizer_mode="overlapped")
    cm = rpcompile.compile(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cm.attach_optimizer(opt, lr_scheduler=sched, max_grad_norm=0.5, chunks=5)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.5)
    for step in range(4):
        batch = lm_batch(seed=step)
        loss = cm.train_step(**batch)
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt_ref.step(), sched_ref.step(), opt_ref.zero_grad()
        close(loss, loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
    cm.synchronize()
    assert sched.get_last_lr() == sched_ref.get_last_lr()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, name)
        assert p.grad is None


def test_overlapped_mode_needs_an_optimizer():
    cm = rpcompile.compile(qwen3(), rpcompile.Config(optimizer_mode="overlapped"))
    with pytest.raises(rpcompile.InputError, match="attach_optimizer"):
        cm.train_step(**lm_batch())
    exact = rpcompile.compile(qwen3(), rpcompile.Config())
    with pytest.raises(rpcompile.InputError, match="overlapped"):
        exact.attach_optimizer(torch.optim.SGD(exact.model.parameters(), lr=0.1))


def test_next_step_waits_for_the_parameters_it_reads():
    """The optimizer thread is slowed down; the next step must still read updated weights."""
    model = qwen3(layers=1)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode="overlapped"))

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            import time
            time.sleep(0.05)
            return super().step(closure)

    cm.attach_optimizer(SlowSGD(model.parameters(), lr=0.1), chunks=8)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        b = lm_batch(seed=step)
        loss = cm.train_step(**b)
        loss_ref = ref(**b).loss
        loss_ref.backward()
        opt_ref.step(), opt_ref.zero_grad()
        close(loss, loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")


@pytest.mark.parametrize("devices", [1, 2])
def test_weights_go_up_as_the_pieces_read_them(monkeypatch, devices):
    """Note [weights as they arrive]: while the optimizer still steps the last step's later
    layers, the next step's first piece runs, its weights going up as each piece reads them
    once their parameters are stepped; parameters after SGD-with-momentum steps as eager's.
    (benchmarks/runs/weights_arrive/check.py runs it on a GPU.)"""
    late_weights_run(monkeypatch, ["cpu"] * devices)


def late_weights_run(monkeypatch, devices, tol=(1e-5, 1e-7), **config):
    """3 overlapped steps of a 4-layer Qwen3 whose optimizer takes 0.1 s a chunk, against eager."""
    import time

    from rpcompile.runtime import programs
    from rpcompile.runtime.job import JobContext

    model = qwen3(tied=False, layers=4)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=devices, num_microbatches=2,
                                                   memory_budget="300KiB" if len(devices) > 1 else None,
                                                   optimizer_mode="overlapped", **config))
    chunk_ends, piece_starts, late = [], [], []

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.1)
            out = super().step(closure)
            chunk_ends.append(time.perf_counter())
            return out

    arriving, upload = programs.Arriving.forward, JobContext._upload_weight

    def piece(self, *args):
        piece_starts.append(time.perf_counter())
        return arriving(self, *args)

    def upload_late(self, name, key, p, into=None):
        if into is not None:
            late.append(name)
        return upload(self, name, key, p, into)
    monkeypatch.setattr(programs.Arriving, "forward", piece)
    monkeypatch.setattr(JobContext, "_upload_weight", upload_late)
    cm.attach_optimizer(SlowSGD(model.parameters(), lr=0.1, momentum=0.9), chunks=6)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    first_pieces = []
    for step in range(3):
        b = lm_batch(seed=step)
        first_pieces.append(len(piece_starts))
        loss = cm.train_step(**b)
        loss_ref = ref(**b).loss
        loss_ref.backward()
        opt_ref.step(), opt_ref.zero_grad()
        close(loss, loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
    cm.synchronize()
    chunks = len(chunk_ends) // 3
    assert chunks >= 4 and len(chunk_ends) == 3 * chunks
    for step in (1, 2):   # its first piece ran while the update of the step before had chunks to go
        assert piece_starts[first_pieces[step]] < chunk_ends[step * chunks - 1] - 0.15, (step, chunk_ends)
    assert {name.split(".")[2] for name in late if ".layers." in name} >= {"0", "3"}, late
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), *tol, name)
    return cm, late


def _three_layer_overlapped():
    """A model, its eager twin, the compiled model (overlapped, no clipping) and both AdamWs."""
    model = qwen3(tied=False, layers=3)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode="overlapped"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm.attach_optimizer(opt)
    return model, ref, cm, opt, torch.optim.AdamW(ref.parameters(), lr=1e-3)


def _new_steps_alive(before=frozenset()) -> set:
    """ids of the StepStates alive now but not in `before` (what an earlier test left alive, say
    a differentiable call's output whose autograd graph holds its step, is not this test's)."""
    import gc

    from rpcompile.runtime.job import StepState
    return {id(o) for o in gc.get_objects() if type(o) is StepState} - set(before)


def _steps_free_their_state(cm, opt, mode, steps=3):
    """Runs `steps` steps (lm_batch(seed=t)) with the cyclic garbage collector off: every
    finished step is freed all the same. In overlapped mode, also: one submission per step,
    and the optimizer thread refreshes a chunk's copies in one call (Note [few calls per
    step]): its timings are kept per submission."""
    import gc

    gc.collect()
    gc.disable()
    try:
        before = _new_steps_alive()
        for step in range(steps):
            cm.train_step(**lm_batch(seed=step))
            if mode == "exact":
                opt.step(), opt.zero_grad()
        cm.synchronize()
        alive = len(_new_steps_alive(before))
    finally:
        gc.enable()
    assert alive == 0, f"{alive} finished steps are still alive"
    if mode == "overlapped":
        assert len(cm.plan.stages) >= 3 and cm.runner.overlapped._completed == steps
        timings = cm.runner.overlapped.timings
        assert len(timings) == steps and all(t["total_s"] >= t["step_s"] > 0 for t in timings)
        assert all(t["cpu_s"] > 0 and t["switched"] >= 0 for t in timings)    # the host's side of the pace


@pytest.mark.parametrize("mode", ["exact", "delayed"])
def test_finished_steps_are_freed_without_the_garbage_collector(mode):
    """A step's host gradients and activations are freed when it ends, not when the cyclic
    collector runs or the next step starts (on 4 GPUs a reference cycle let host memory grow
    by a step's worth each step). Overlapped mode: test_a_failing_step_changes_nothing's first
    steps (the same model and config)."""
    model = qwen3(tied=False, layers=3)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode != "exact":
        cm.attach_optimizer(opt)
    _steps_free_their_state(cm, opt, mode)


def test_a_failing_step_changes_nothing(monkeypatch):
    """A step whose last job fails leaves parameters, gradients and optimizer state as they
    were, and training then goes on to eager's results. The steps before it are
    test_finished_steps_are_freed_without_the_garbage_collector's for overlapped mode."""
    from rpcompile.runtime.job import JobContext

    model, ref, cm, opt, opt_ref = _three_layer_overlapped()
    _steps_free_their_state(cm, opt, "overlapped", steps=3)
    for step in range(3):
        ref(**lm_batch(seed=step)).loss.backward()
        opt_ref.step(), opt_ref.zero_grad()
    # step 3: the last job fails after the other jobs made their gradients
    batch = lm_batch(seed=3)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    last = len(cm.plan.stages) - 1
    real = JobContext.accumulate_grads

    def faulty(self, grads):
        if self.stage.index == last:
            raise RuntimeError("injected")
        return real(self, grads)
    monkeypatch.setattr(JobContext, "accumulate_grads", faulty)
    with pytest.raises(rpcompile.StageError):
        cm.train_step(**batch)
    monkeypatch.setattr(JobContext, "accumulate_grads", real)
    cm.synchronize()
    for n, p in model.named_parameters():
        assert p.grad is None, n
        assert torch.equal(p.detach(), params[n]), n
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[n].items()), n
    cm.train_step(**batch)
    ref(**batch).loss.backward()
    opt_ref.step(), opt_ref.zero_grad()
    cm.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, name)


@pytest.mark.parametrize("mode", ["overlapped", "delayed"])
def test_the_optimizer_holds_gradients_not_the_step(mode):
    """While the optimizer thread still works on a step's gradients, the step itself (its
    activations, checkpoints and their pinned buffers) is already gone."""
    import gc
    import threading

    release = threading.Event()

    class BlockedSGD(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            BlockedSGD.calls += 1
            # delayed: the first chunk (the loss job's gradient piece) goes through, so the next
            # step's loss job may write its piece (Note [one gradient set])
            if BlockedSGD.calls > (mode == "delayed"):
                release.wait(timeout=60)
            return super().step(closure)

    model = qwen3(tied=True, layers=2)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode=mode))
    cm.attach_optimizer(BlockedSGD(model.parameters(), lr=0.1))
    gc.collect()
    gc.disable()
    try:
        before = _new_steps_alive()
        cm.train_step(**lm_batch(seed=0))
        if mode == "delayed":   # step 0 is handed to the optimizer as step 1 runs (Note [overlapped steps])
            cm.train_step(**lm_batch(seed=1))
        assert cm.runner.overlapped._completed == 0, "the optimizer step should still be blocked"
        running = 1 if cm.runner.pending is not None else 0     # delayed: step 1's backward jobs
        alive = len(_new_steps_alive(before))
    finally:
        release.set()
        gc.enable()
    cm.synchronize()
    assert running == (mode == "delayed")
    assert alive == running, f"{alive - running} steps are held while the optimizer works on their gradients"


@pytest.mark.parametrize("tied, max_grad_norm, share", [(True, None, 1.0), (False, 0.05, 0.5)])
def test_gradients_stay_on_the_device_that_steps_them(tied, max_grad_norm, share, monkeypatch):
    """Note [gradients stay on the device] (runtime/grads.py): with one job with gradients, the
    optimizer steps the parameters stepped on its device from the job's accumulator there (kept
    across steps), not from the host gradient set: their part of the set stays as it was (NaN
    here), the others' comes down, while losses and parameters after SGD-with-momentum steps
    (clipped too) equal eager PyTorch's. A tied head's row pieces add into the embedding's
    gradient, an untied head's shards are its whole gradient in place. A step that fails after
    its first microbatch wrote the kept accumulator changes no parameter, and the next steps go
    on as eager's."""
    from rpcompile.runtime.flat import FlatMasters
    from rpcompile.runtime.job import JobContext
    monkeypatch.setattr(FlatMasters, "BLOCK", 1000)      # blocks that split this small model
    model = qwen3(tied=tied, layers=1)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], num_microbatches=2, optimizer_mode="overlapped",
                                                   optimizer_on_devices=share, lm_head_shards=2))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_grad_norm=max_grad_norm)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    kept = set()
    real = JobContext.accumulate_grads
    for step in range(4):
        batch = lm_batch(seed=step)
        if step == 2:       # a failed step first: its second microbatch's gradients do not come
            calls = []

            def faulty(self, grads):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("injected")
                return real(self, grads)
            monkeypatch.setattr(JobContext, "accumulate_grads", faulty)
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(rpcompile.StageError, match="injected"):
                cm.train_step(**batch)
            monkeypatch.setattr(JobContext, "accumulate_grads", real)
            cm.synchronize()
            assert len(calls) == 2 and all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        loss = cm.train_step(**batch)
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        opt_ref.step(), opt_ref.zero_grad()
        close(loss, loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
        cm.synchronize()
        kept.add(cm.runner.mode.device_grads._flat.data_ptr())
        if step == 0:
            cm.runner.host_grads.flat.fill_(float("nan"))
    layout = cm.plan.host_memory.grad_layout
    assert len(layout.stages) == 1 and bool(layout.whole_rows) == (not tied)
    masters, flat = cm.runner.overlapped.masters, cm.runner.host_grads.flat
    for key, off, shape in layout.keys[0]:
        i = key[0] if isinstance(key, tuple) else key
        stays = masters.place_of(model.get_parameter(cm.plan.captured.param_names[i]))[1] is not None
        assert bool(flat[off:off + math.prod(shape)].isnan().all()) == stays, key
    assert 0 < len(cm.runner.mode.device_grads.params) <= len(cm.plan.captured.params) * share
    assert len(kept) == 1        # one accumulator, kept across the steps
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-5, 1e-6, name)


HELD_OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                   "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}


def held_gradients_run(mode, make_opt, hold, devices=("cpu", "cpu"), **config):
    """(model after 3 train steps, {name: what .grad held before them}) with the attached
    optimizer; hold: a differentiable call's backward first leaves gradients in .grad."""
    model = qwen3(tied=True, layers=1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=list(devices), num_microbatches=2,
                                                   memory_budget="300KiB", optimizer_mode=mode, **config))
    cm.attach_optimizer(make_opt(model.parameters()), chunks=5)
    held = {}
    if hold:
        cm(**lm_batch(seed=9)).loss.backward()
        held = {name: p.grad.clone() for name, p in model.named_parameters()}
    for step in range(3):
        cm.train_step(**lm_batch(seed=step))
    cm.synchronize()
    return model, held


@pytest.mark.parametrize("mode", ["overlapped", "delayed"])
@pytest.mark.parametrize("opt", list(HELD_OPTIMIZERS))
def test_gradients_held_in_grad_are_left_alone_by_the_attached_optimizer(mode, opt):
    """A differentiable call's backward leaves gradients in `.grad`; the attached optimizer steps
    each chunk with the step's own gradients only: the held ones are neither applied (once per
    chunk, by an optimizer that steps every parameter with a `.grad`) nor dropped (Note [held
    gradients], runtime/flat.py; benchmarks/gpu_check.py changes runs it on a GPU)."""
    plain, _ = held_gradients_run(mode, HELD_OPTIMIZERS[opt], False)
    model, held = held_gradients_run(mode, HELD_OPTIMIZERS[opt], True)
    assert held and all(g.abs().max() > 0 for g in held.values())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        close(p.detach(), q.detach(), 1e-6, 1e-7, name)
        assert torch.equal(p.grad, held[name]), name


def dropped_model_run(mode, workers, devices=("cpu", "cpu")):
    """An MLP compiled on `devices` (an AdamW attached, or stepped by hand in exact mode), 2 train
    steps, then `del cm, model, opt` with no synchronize and a collection: (how many of the
    compiled model, the optimizer and the parameters are alive, the optimizer thread, the worker
    processes' exit codes). The test below; benchmarks/runs/dropped_model on CUDA."""
    import weakref

    import torch.nn.functional as F

    from models import MLP
    from rpcompile.runtime import timeline

    model = MLP()
    cm = rpcompile.compile(model, rpcompile.Config(devices=list(devices), num_microbatches=2, loss_fn=F.mse_loss,
                                                   optimizer_mode=mode, workers=workers))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if mode != "exact":
        cm.attach_optimizer(opt)
    for _ in range(2):
        cm.train_step(torch.randn(6, 8), target=torch.randn(6, 4))
        if mode == "exact":
            opt.step()
            opt.zero_grad()
    thread = cm.runner.overlapped._thread if mode != "exact" else None
    procs = list(cm.runner.executor.hub.procs) if workers == "processes" else []
    alive = [weakref.ref(x) for x in (cm, opt, *model.parameters())]
    del cm, model, opt
    timeline.collect()
    if thread is not None:      # (it ends once its optimizer has gone; what that let go is collected again)
        thread.join(timeout=10)
        timeline.collect()
    return sum(r() is not None for r in alive), thread, [p.wait(timeout=30) for p in procs]


@pytest.mark.parametrize("mode,workers", [("exact", "threads"), ("overlapped", "threads"), ("delayed", "threads"),
                                          ("delayed", "processes")])
def test_a_dropped_model_lets_its_optimizer_and_parameters_go(mode, workers):
    """A compiled model dropped (`del cm, model, opt`: a notebook's second run) kept its model, and
    with an attached optimizer that optimizer, its state and the optimizer thread, for the life of
    the process: dynamo keeps every backend it was given, and the capture's closed over the model
    (Note [a backend that lets the model go], capture.py); the optimizer thread held its
    OverlappedOptimizer (Note [an optimizer thread that lets its optimizer go], runtime/optimizer.py);
    with worker processes, the hub held delayed mode's last run, not waited for, and through it
    the executor, its step and the workers (Note [runs nobody waits for], runtime/processes.py).
    Now all of it goes, the thread ends and so do the worker processes."""
    import threading

    alive, thread, exit_codes = dropped_model_run(mode, workers)
    assert alive == 0
    assert thread is None or (not thread.is_alive() and thread not in threading.enumerate())
    assert all(code is not None for code in exit_codes)
