"""Side-by-side training of a model with rpcompile and with eager PyTorch.

Tolerances measure rpcompile, not the optimizer: gradients are compared relative to the
largest gradient of the model (a near-zero gradient's summation-order noise is not an error),
and parameters after steps of SGD with momentum, a linear optimizer. AdamW would turn that
noise into an lr-sized step (`optimizer="adamw"` keeps one such check, with a tolerance of a
fraction of lr).
"""
import copy

import torch

import rpcompile

from models import lm_batch, qwen3


def aot_eager_compile(compile_, backend="aot_eager"):
    """torch.compile with aot_eager standing in for Inductor (the stage pieces only; a call that
    names its backend, the capture's, keeps it). Tests that count which pieces compile, and check
    no values, pass backend="eager": dynamo compiles the same pieces, as often (the backend sees
    each graph dynamo hands it), in half the time or less."""
    return lambda gm, **kw: compile_(gm, **{**kw, "backend": kw.get("backend", backend)})


def close(a, b, rtol, atol, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs error {err:.3g}"


def check_grads(model, ref, rtol=1e-4):
    """Every gradient of `model` equals `ref`'s to rtol times the largest gradient of `ref`."""
    scale = max((q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None and q.grad.numel()),
                default=0.0)
    atol = rtol * max(scale, 1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), f"{name}: gradient where eager has none"
            continue
        assert p.grad is not None, f"{name}: no gradient where eager has one"
        close(p.grad, q.grad, 0.0, atol, f"grad of {name} (relative to the largest gradient {scale:.3g})")


def make_optimizer(params, kind, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(kind)


TIGHT = 1  # Config(memory_budget=TIGHT): a budget just above the smallest that fits


def tight_budget(cm, batch, call, slack=1.15):
    """A memory budget 15% above the smallest one any plan fits (read off the PlanningError of a
    first call planned at a 1-byte budget).

    The probe is a call of `cm` itself, and its capture is kept for the call after it: the model
    is captured once, as a model planned at a given budget is (a PlanningError is raised while
    planning, before any job runs, so the probe changes nothing else).
    """
    plans = cm._plans
    kept = {}

    def lookup(key, leaves, capture, compile, family=None):
        def capture_once():
            if "cap" not in kept:
                kept["cap"] = capture()
                return kept["cap"]
            del plans.lookup               # the kept capture serves one call: the next captures anew
            return kept.pop("cap")
        return type(plans).lookup(plans, key, leaves, capture_once, compile, family)

    cm.config.memory_budget = 1
    plans.lookup = lookup
    try:
        call(cm, batch)
    except rpcompile.PlanningError as e:
        return int(e.min_budget * slack)
    raise AssertionError("a 1-byte memory budget should not fit any plan")


def plan_kept_capture(cm, kept: dict):
    """cm plans the capture kept in `kept` (the first call's that finds none there), as a re-plan
    does: the passes read cm's Config when they plan it. For tests that plan one model several
    ways and read only the plans (a capture is most of their time)."""
    plans = cm._plans

    def capture_once(capture):
        if "cap" not in kept:
            kept["cap"] = capture()
        return kept["cap"]
    plans.lookup = lambda key, leaves, capture, compile, family=None: type(plans).lookup(
        plans, key, leaves, lambda: capture_once(capture), compile, family)
    return cm


def train_both(model, batches, config, *, call=None, eager_step=None, steps=3, lr=1e-2, optimizer="sgd",
               loss_rtol=1e-5, grad_rtol=1e-4, param_rtol=1e-4, param_atol=1e-6, min_stages=2,
               check_every_step=False, slack=1.15):
    """Train a copy with rpcompile and one eagerly; check loss, grads and parameters agree.

    batches: list of kwargs dicts, one per step. call(cm, batch) -> loss runs rpcompile
    (default: cm.train_step(**batch)); eager_step(model, batch) -> loss runs eager forward +
    backward (default: model(**batch).loss.backward()). optimizer: "sgd" (momentum 0.9, the
    default) or "adamw" (then param_atol should allow for its lr-sized steps of noise).
    Gradients are checked at the first step (every step with check_every_step). With
    Config(memory_budget=TIGHT) the budget is `slack` times the smallest that fits (tight_budget).
    Returns the compiled model.
    """
    ref = copy.deepcopy(model)
    call = call or (lambda cm, b: cm.train_step(**b))
    cm = rpcompile.compile(model, config=config)
    if config.memory_budget == TIGHT:
        config.memory_budget = tight_budget(cm, batches[0], call, slack)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    opt_ref = make_optimizer(ref.parameters(), optimizer, lr)

    def default_eager(m, b):
        loss = m(**b).loss
        loss.backward()
        return loss

    eager_step = eager_step or default_eager
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = call(cm, batch)
        loss_ref = eager_step(ref, batch)
        close(loss.detach().float(), loss_ref.detach().float(), loss_rtol, 1e-6, f"loss at step {step}")
        if step == 0 or check_every_step:
            check_grads(model, ref, grad_rtol)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), param_rtol, param_atol, f"{name} after {steps} {optimizer} steps")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        close(b.float(), c.float(), param_rtol, param_atol, f"buffer {name} after {steps} steps")
    if min_stages and cm.plan is not None:
        assert len(cm.plan.stages) >= min_stages, f"expected a pipelined plan, got\n{cm.plan}"
    return cm


def scalar_loss_step(m, b):
    """The eager step of a model whose forward returns its loss: forward, backward, the loss."""
    loss = m(**b)
    loss.backward()
    return loss


def xy_batches(rows, width, steps=3, seed=0):
    """`steps` batches of {"x", "y"}: random rows of `width` features and targets."""
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, width, generator=g), "y": torch.randn(rows, width, generator=g)}
            for _ in range(steps)]


def inject_fault(monkeypatch, stage, microbatch=None):
    """Stage `stage`'s jobs fail when they add up their gradients (at `microbatch`, or always)."""
    from rpcompile.runtime.job import JobContext
    real = JobContext.accumulate_grads

    def faulty(job, grads):
        if job.stage.index == stage and microbatch in (None, job.microbatch):
            raise RuntimeError("injected fault")
        return real(job, grads)

    monkeypatch.setattr(JobContext, "accumulate_grads", faulty)


class FakeEvent:
    """A CUDA event's host side for CPU tests: counts its synchronize() calls."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def delayed_run(workers="threads", fail_at=None, fail=None, devices=2, memory_budget="300KiB", **config):
    """Three delayed-mode AdamW steps (lr 1e-3) of qwen3(seed=3) on 2 CPU devices (or
    `devices`), as many microbatches, a 300KiB budget, lm_batch(seed=t) at step t. Before step `fail_at`,
    fail(cm, model, t) runs a step that fails; `config`: more Config fields. Returns the losses and the parameters after
    cm.synchronize(). Without a failure (worker threads) this is the `delayed_reference`
    fixture (conftest.py) that test_delayed.py and test_processes.py compare against."""
    model = qwen3(seed=3)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * devices, num_microbatches=devices,
                                                   memory_budget=memory_budget, optimizer_mode="delayed",
                                                   workers=workers, **config))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for t in range(3):
        if t == fail_at:
            fail(cm, model, t)
        losses.append(cm.train_step(**lm_batch(seed=t)))
    cm.synchronize()
    return losses, [p.detach().clone() for p in model.parameters()]
