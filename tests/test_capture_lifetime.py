"""How long captures live (Note [captures kept] in plan_cache.py): a call group keeps at most
Config.captures_kept captures, the least recently used dropped with its plans and everything the
runner kept for them; the warning that a value changed says how many are kept, says a drop once,
and points at the caller's line."""
import copy
import os
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.runtime import timeline

from parity import check_grads, close, make_optimizer

AGAIN = "captures the model again"


class Scaled(nn.Module):
    """Reads `scale`, a Python float, as a constant of its graph."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)) * self.scale)


def _compiled(model, kept, **kw):
    return rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, loss_fn=F.mse_loss,
                                                     captures_kept=kept, **kw))


def _said(record) -> list:
    return [str(w.message) for w in record if AGAIN in str(w.message)]


def _train_changing_scale(cm, model, steps, kept):
    """`steps` SGD steps of cm and eager, scale changed at each: losses, gradients and parameters
    agree; returns weak references to each step's plan and capture, and what was said."""
    ref = copy.deepcopy(model)
    opt, opt_ref = make_optimizer(model.parameters(), "sgd", 0.05), make_optimizer(ref.parameters(), "sgd", 0.05)
    plans, captures = [], []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(steps):
            model.scale = ref.scale = 1.0 + 0.25 * step
            x, y = torch.randn(6, 8), torch.randn(6, 4)
            loss = cm.train_step(x, target=y)
            loss_ref = F.mse_loss(ref(x), y)
            loss_ref.backward()
            close(loss.detach(), loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
            check_grads(model, ref)
            opt.step(), opt_ref.step()
            opt.zero_grad(), opt_ref.zero_grad()
            plans.append(weakref.ref(cm.plan))
            captures.append(weakref.ref(cm.plan.captured))
            assert cm._plans.captures() == min(step + 1, kept), step
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, f"{name} after {steps} sgd steps")
    timeline.collect()       # (Note [a collection of its own])
    dropped = steps - kept
    assert [p() is None for p in plans] == [True] * dropped + [False] * kept
    assert [c() is None for c in captures] == [True] * dropped + [False] * kept
    return plans[dropped:], captures[dropped:], _said(record)


def test_a_value_changed_every_step_keeps_the_bound():
    """scale changed at each of 6 steps with 3 captures kept: SGD follows eager's, 3 captures stay,
    the dropped ones' plans and captures are freed and no program, counter or finalizer of theirs
    is left in the runner; two warnings say a capture is made, one that the bound drops (before,
    6 captures were kept with all their plans and programs, a warning at every step)."""
    model = Scaled()
    cm = _compiled(model, kept=3)
    plans, captures, said = _train_changing_scale(cm, model, steps=6, kept=3)
    assert len(said) == 3, said
    assert "2 captures kept for calls like it, of at most 3" in said[0]
    assert "3 captures are kept" in said[2] and "dropped" in said[2] and "tensor" in said[2]
    kept = {id(p()) for p in plans}
    runner = cm.runner
    assert runner._programs and {key[0] for key in runner._programs} <= kept
    assert {key[0] for key in runner._counters} <= kept
    assert set(runner._finalizers) <= kept
    assert {key[0] for key in runner.programs._pieces} <= {id(c()) for c in captures}


class ScaledBy(nn.Module):
    """Takes `scale`, a Python float, as an argument: a constant of its capture."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, scale):
        return self.out(torch.tanh(self.inp(x)) * scale)


def test_an_argument_changed_every_step_is_said_once_and_keeps_the_bound():
    """Note [constant arguments]: train_step(x, scale=s) with a float changed at each of 6 steps and
    3 captures kept: SGD follows eager's, one warning (at the caller's line) names the argument
    and what to pass instead, 3 captures stay and no program of a dropped one is left in the
    runner (before: a capture and plan each step, all kept, nothing said)."""
    model = ScaledBy()
    ref = copy.deepcopy(model)
    cm = _compiled(model, kept=3)
    opt, opt_ref = make_optimizer(model.parameters(), "sgd", 0.05), make_optimizer(ref.parameters(), "sgd", 0.05)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(6):
            x, y, scale = torch.randn(6, 8), torch.randn(6, 4), 1.0 + 0.25 * step
            loss = cm.train_step(x, target=y, scale=scale)
            loss_ref = F.mse_loss(ref(x, scale), y)
            loss_ref.backward()
            close(loss.detach(), loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
            check_grads(model, ref)
            opt.step(), opt_ref.step()
            opt.zero_grad(), opt_ref.zero_grad()
            assert cm._plans.captures() == min(step + 1, 3), step
    said = [w for w in record if "argument that is not a tensor" in str(w.message)]
    assert len(said) == 1 and "scale is 1.25, where an earlier call passed 1.0" in str(said[0].message)
    assert "torch.tensor(value)" in str(said[0].message) and os.path.abspath(said[0].filename) == os.path.abspath(__file__)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, f"{name} after 6 sgd steps")
    kept = {id(p) for p in cm._plans.plans()}
    assert len(kept) == 3 and {key[0] for key in cm.runner._programs} <= kept


def test_worker_processes_let_go_of_dropped_plans():
    """With worker processes, the plans sent to the workers are the kept ones only (the workers
    forget the others: runtime/worker.py Worker.forget_plan)."""
    model = Scaled()
    cm = _compiled(model, kept=2, workers="processes")
    plans, _, _ = _train_changing_scale(cm, model, steps=4, kept=2)
    assert {id(plan) for _, plan in cm.runner.executor._plans.values()} == {id(p()) for p in plans}


def test_a_value_alternating_between_two_settings_reuses_its_captures():
    """Two dropout rates in turn with 2 captures kept: two captures, then each step reuses one; a
    third rate drops the least recently used capture, not the one just used (before, no bound:
    the third rate was a third capture kept)."""
    model = Scaled()
    cm = _compiled(model, kept=2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    made = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step, scale in enumerate([1.0, 2.0, 1.0, 2.0, 1.0, 2.0]):
            model.scale = scale
            cm.train_step(x, target=y)
            assert made.setdefault(scale, cm.plan.captured) is cm.plan.captured, step
            assert cm._plans.captures() == min(step + 1, 2)
        assert len(_said(record)) == 1
        model.scale = 1.0
        cm.train_step(x, target=y)      # (1.0 used last: 2.0's capture is the one dropped)
        model.scale = 3.0
        cm.train_step(x, target=y)
        model.scale = 1.0
        cm.train_step(x, target=y)
    assert cm.plan.captured is made[1.0]
    assert cm._plans.captures() == 2
    assert len(_said(record)) == 2


def _warning_of(call):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    [w] = [w for w in record if AGAIN in str(w.message)]
    return os.path.abspath(w.filename), w.lineno


def test_the_warning_points_at_the_callers_line():
    """For cm.train_step(...) and cm(...) alike (before, cm(...)'s warning pointed into torch's
    nn.Module.__call__)."""
    model = Scaled()
    cm = _compiled(model, kept=8)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    cm.train_step(x, target=y)
    model.scale = 2.0
    train = lambda: cm.train_step(x, target=y)      # noqa: E731
    assert _warning_of(train) == (os.path.abspath(__file__), train.__code__.co_firstlineno)
    with torch.no_grad():
        cm(x)
        model.scale = 3.0
        call = lambda: cm(x)       # noqa: E731
        assert _warning_of(call) == (os.path.abspath(__file__), call.__code__.co_firstlineno)
