"""What a capture depends on beyond the plan key's arguments: the values the forward read (Note
[what the forward read] in reads.py), the microbatch count (Note [microbatches fixed] in
compiled.py) and the loss_fn's closure values (Note [loss_fn in the key] in compiled.py). Each
change gives what eager PyTorch gives, and a steady step captures nothing."""
import copy
import dataclasses
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
import rpcompile.capture
from rpcompile.errors import InputError

from models import WithDropout, lm_batch, qwen3
from parity import check_grads, close, make_optimizer

SHIFT = 0.0     # a global of this module that Scaled's forward reads


class Scaled(nn.Module):
    """Reads a float, a flag and a global as constants; a step counter it never reads, and one
    its forward increments."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.scale = 1.0
        self.residual = False
        self.step_count = 0     # (a training loop's counter: never read by forward)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.inp(x)) * self.scale + SHIFT
        m = torch.tanh(self.mid(h))
        return self.out(h + m if self.residual else m)


def _compiled(model, loss_fn=F.mse_loss, microbatches=2):
    return rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=microbatches,
                                                     loss_fn=loss_fn))


def _after_a_step(model):
    """(an eager copy of `model`, its compiled model, x, y) after one train step, .grad cleared."""
    ref = copy.deepcopy(model)
    cm = _compiled(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    cm.train_step(x, target=y)
    model.zero_grad()
    return ref, cm, x, y


def _step_both(cm, model, ref, x, y, loss_fn=F.mse_loss, what=""):
    """One train step of cm and of eager `ref`: losses and gradients agree."""
    loss = cm.train_step(x, target=y)
    loss_ref = loss_fn(ref(x), y)
    loss_ref.backward()
    close(loss.detach(), loss_ref.detach(), 1e-5, 1e-6, f"loss {what}")
    check_grads(model, ref)


def test_annealed_dropout_captures_again():
    """Dropout.p set to 0 after the first step: the old capture went on dropping 0.3 of the values
    (loss 0.7642 against eager's 0.7838, gradients off by 0.37 of the largest)."""
    torch.manual_seed(0)
    model = WithDropout()
    ref, cm, x, y = _after_a_step(model)
    model.drop.p = ref.drop.p = 0.0
    with pytest.warns(UserWarning, match=r"model\.drop\.p is 0\.0 where the model was captured with 0\.3"):
        _step_both(cm, model, ref, x, y, what="at p=0")
    assert cm._plans.captures() == 2


def test_values_the_forward_reads_train_like_eager():
    """A float, a flag and a module global changed between steps: SGD with momentum over five steps
    follows eager's, each change a new capture and no other step capturing; a value set back
    reuses its capture. (The old capture kept scale 1.0: loss 0.122 off eager's at step 1.)"""
    global SHIFT
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    cm = _compiled(model)
    opt, opt_ref = make_optimizer(model.parameters(), "sgd", 0.05), make_optimizer(ref.parameters(), "sgd", 0.05)
    changes = [lambda m: None, lambda m: setattr(m, "scale", 2.5), lambda m: setattr(m, "residual", True),
               lambda m: globals().update(SHIFT=0.5), lambda m: globals().update(SHIFT=0.0)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for step, change in enumerate(changes):
                change(model), change(ref)
                x, y = torch.randn(6, 8), torch.randn(6, 4)
                _step_both(cm, model, ref, x, y, what=f"at step {step}")
                opt.step(), opt_ref.step()
                opt.zero_grad(), opt_ref.zero_grad()
    finally:
        SHIFT = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, f"{name} after 5 sgd steps")
    assert cm._plans.captures() == 4     # (step 4's values are step 2's: its capture serves)


def test_a_hook_registered_after_the_first_step_runs():
    """A forward hook registered after the first step: the old capture never ran it (loss 1.5063
    against eager's 1.6560)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    cm = _compiled(net, F.cross_entropy)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    cm.train_step(x, target=y)
    net.zero_grad()
    for m in (net, ref):
        m[0].register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.warns(UserWarning, match=r"len\(model\.0\._forward_hooks\) is 1 where the model was captured with 0"):
        _step_both(cm, net, ref, x, y, F.cross_entropy, what="with the hook")


def test_a_steady_step_does_not_capture_again():
    """Five steps with a counter the forward never reads changed at each, and one the forward
    increments itself: one capture, no warning."""
    torch.manual_seed(0)
    model = Scaled()
    cm = _compiled(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(5):
            model.step_count = step
            cm.train_step(torch.randn(6, 8), target=torch.randn(6, 4))
    assert cm._plans.captures() == 1
    assert not [w for w in said if "captures the model again" in str(w.message)]
    reads = [c.captured.reads for caps in cm._plans._groups.values() for c in caps]
    assert reads[0].source == "dynamo guards" and "model.scale" in reads[0].names
    assert "model.calls" not in reads[0].names      # (incremented by the forward: no call could match it)


def test_without_dynamo_guards_every_module_attribute_is_compared(monkeypatch):
    """Where Dynamo's guards cannot be read, the capture keeps every module's plain attributes: a
    changed value still captures anew, and a counter the forward never reads captures anew too,
    with a warning that names it."""
    def unreadable(*a, **k):
        raise AttributeError("no guards here")
    monkeypatch.setattr(rpcompile.capture, "guard_reads", unreadable)
    torch.manual_seed(0)
    model = Scaled()
    ref, cm, x, y = _after_a_step(model)
    assert [c.captured.reads.source for caps in cm._plans._groups.values() for c in caps] == ["module attributes"]
    model.scale = ref.scale = 3.0
    with pytest.warns(UserWarning, match=r"model\.scale is 3\.0"):
        _step_both(cm, model, ref, x, y, what="at scale 3")
    model.zero_grad()
    model.step_count = 7
    with pytest.warns(UserWarning, match=r"model\.step_count is 7 where the model was captured with 0"):
        cm.train_step(x, target=y)
    assert cm._plans.captures() == 3


def test_a_loss_objects_attribute_changed_in_place():
    """A loss_fn closing over an object (the same object each step) whose attribute changes: the
    capture read it as a constant and is not reused (it kept alpha 1.0: loss 3.01 off eager's)."""
    torch.manual_seed(0)

    class Weights:
        alpha = None
    w = Weights()
    w.alpha = 1.0

    def loss_fn(out, target):
        return w.alpha * F.cross_entropy(out, target)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    cm = _compiled(net, loss_fn)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    cm.train_step(x, target=y)
    net.zero_grad()
    w.alpha = 3.0
    with pytest.warns(UserWarning, match=r"loss_fn\.<closure 0>\.alpha is 3\.0"):
        _step_both(cm, net, ref, x, y, loss_fn, what="at alpha 3")


def test_a_transformers_config_flag_and_module_constants():
    """A transformers model: config.output_hidden_states set after a first call returns the hidden
    states (the old capture returned None), and every RMSNorm's variance_epsilon changed trains
    with the new epsilon (the old capture kept 1e-6: loss 4.85128 against eager's 4.85194)."""
    model = qwen3(layers=2, seed=3)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    batch = lm_batch(seed=4)
    with torch.no_grad():
        assert cm(**batch).hidden_states is None
        model.config.output_hidden_states = ref.config.output_hidden_states = True
        with pytest.warns(UserWarning, match="output_hidden_states"):
            out = cm(**batch)
        expected = ref(**batch, use_cache=False).hidden_states
    assert out.hidden_states is not None and len(out.hidden_states) == len(expected)
    close(out.hidden_states[-1], expected[-1], 1e-5, 1e-5, "last hidden state")
    model.config.output_hidden_states = ref.config.output_hidden_states = False
    cm.train_step(**batch)
    model.zero_grad()
    for m in (model, ref):
        for mod in m.modules():
            if hasattr(mod, "variance_epsilon"):
                mod.variance_epsilon = 0.5
    with pytest.warns(UserWarning, match="variance_epsilon is 0.5 where the model was captured with 1e-06"):
        loss = cm.train_step(**batch)
    loss_ref = ref(**batch, use_cache=False).loss
    loss_ref.backward()
    close(loss.detach(), loss_ref.detach(), 1e-5, 1e-6, "loss at epsilon 0.5")
    check_grads(model, ref)


def test_num_microbatches_changed_after_the_first_train_step_is_refused():
    """Config.num_microbatches changed after the first train plan went unheard (2 microbatches
    went on); now it is an InputError that says to compile again, and nothing changed: set back,
    training goes on as eager's. Changed before any train step, the train plan takes it."""
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    cm = _compiled(model, microbatches=2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with torch.no_grad():
        cm(x)
    cm.config.num_microbatches = 3     # (before any train step: the train plan splits by it)
    _step_both(cm, model, ref, x, y, what="at the first step")
    assert cm.plan.num_microbatches == 3
    model.zero_grad(), ref.zero_grad()
    cm.config.num_microbatches = 6
    with pytest.raises(InputError, match=r"num_microbatches was changed from 3 to 6 .*compile the model again"):
        cm.train_step(x, target=y)
    with pytest.raises(InputError, match="num_microbatches"):
        cm(x)
    assert all(p.grad is None for p in model.parameters())
    cm.config.num_microbatches = 3
    _step_both(cm, model, ref, x, y, what="set back")
    assert cm.plan.num_microbatches == 3


@dataclasses.dataclass
class LossWeights:
    ce: float
    extra: list


def test_a_closure_over_equal_values_each_step_is_captured_once():
    """A loss_fn made each step over a new dict, a list, a dataclass, a partial and a loss module
    with equal values: one capture, trained as eager with SGD; new values another capture. (Keyed
    by the unhashable dict's id, each step captured anew and kept the capture.)"""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    cm = rpcompile.compile(net, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    opt, opt_ref = make_optimizer(net.parameters(), "sgd", 0.05), make_optimizer(ref.parameters(), "sgd", 0.05)

    def make_loss(ce):
        weights = {"ce": ce, "terms": [0.5, 0.25]}
        shape = LossWeights(ce=1.0, extra=[2.0])
        smooth = nn.CrossEntropyLoss(label_smoothing=0.1)
        scaled_mse = functools.partial(torch.mul, other=weights["terms"][1])

        def loss_fn(out, target):
            return (weights["ce"] * shape.ce * smooth(out, target) * shape.extra[0]
                    + scaled_mse(out.pow(2).mean()) * weights["terms"][0])
        return loss_fn
    for step, ce in enumerate([1.0, 1.0, 1.0, 2.0]):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss_fn = make_loss(ce)
        loss = cm.train_step(x, target=y, loss_fn=loss_fn)
        loss_ref = loss_fn(ref(x), y)
        loss_ref.backward()
        close(loss.detach(), loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
        check_grads(net, ref)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        assert cm._plans.captures() == (1 if step < 3 else 2), step
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, f"{name} after 4 sgd steps")
    assert len(cm._kept_loss_fns) == 0


class Opaque:
    """Unhashable, with no structure rpcompile compares by."""
    __hash__ = None

    def __init__(self, c):
        self.c = c

    def __eq__(self, other):
        return isinstance(other, Opaque) and self.c == other.c


def test_loss_fn_values_told_apart_by_identity_are_bounded():
    """A value keyed by identity alone: one object passed each step is one capture; a new object
    each step is a new capture each step, kept with the object, and past the bound the call is
    refused with what to pass instead. (Before, the one object in a new closure each step was a
    capture each step, and every capture was kept, without end.)"""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cm = rpcompile.compile(net, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def make_loss(opaque):
        return lambda out, target: opaque.c * F.cross_entropy(out, target)
    same = Opaque(2.0)
    for _ in range(3):
        cm.train_step(x, target=y, loss_fn=make_loss(same))
    assert cm._plans.captures() == 1
    from rpcompile.compiled import _KEPT_BY_IDENTITY
    for step in range(_KEPT_BY_IDENTITY - 1):
        loss = cm.train_step(x, target=y, loss_fn=make_loss(Opaque(1.0 + step)))
        assert loss.item() == pytest.approx((1.0 + step) * F.cross_entropy(net(x), y).item(), rel=1e-6)
    assert cm._plans.captures() == _KEPT_BY_IDENTITY
    with pytest.raises(InputError, match="loss_fn's 'opaque' is a Opaque, which rpcompile can neither hash"):
        cm.train_step(x, target=y, loss_fn=make_loss(Opaque(99.0)))
    cm.train_step(x, target=y, loss_fn=make_loss(same))     # (one kept still serves)
    assert cm._plans.captures() == _KEPT_BY_IDENTITY


def test_torch_2_11s_names_of_a_configs_attributes_are_read():
    """torch 2.11 names an attribute of an object with a __getattribute__ of its own (a transformers
    config) as object.__getattribute__(obj, 'name'): those guards were left out there, so a config
    flag changed after the first call kept the capture (the test above, on the GPU machine's torch)."""
    from rpcompile.reads import _parse_path
    nested = "object.__getattribute__(object.__getattribute__(L['model']._modules['model'], 'config'), 'use_cache')"
    assert _parse_path("object.__getattribute__(L['model'].config, 'output_hidden_states')", None, {}) == \
        ("model", (".config", ".output_hidden_states"))
    assert _parse_path(nested, None, {}) == ("model", ("._modules", "['model']", ".config", ".use_cache"))
