"""The suite's kept captures (tests/capture_cache.py): a hit trains its own model, and what the
graph could depend on makes a new capture."""
import copy

import pytest
import torch

import rpcompile
from rpcompile.errors import CaptureError
from capture_cache import kept
from models import lm_batch, qwen3


@pytest.fixture(scope="module")
def _kept_here():
    """Captures kept for this file's tests (whether or not the suite keeps them): each test's
    first model is the same one, captured once (captured in every test, it took 17 s of the
    file's 39 in a run of the suite)."""
    import rpcompile.capture
    return kept(rpcompile.capture.capture_call)


@pytest.fixture
def captures(monkeypatch, _kept_here):
    import rpcompile.compiled
    monkeypatch.setattr(rpcompile.compiled, "capture_call", _kept_here)
    return _kept_here


def _loss(model):
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    return float(cm.train_step(**lm_batch(seed=3)))


def test_a_kept_capture_trains_the_model_it_is_bound_to(captures):
    first = qwen3(layers=1, seed=11)
    _loss(first)
    hits = captures.hits
    second = qwen3(layers=1, seed=12)
    eager = copy.deepcopy(second)
    loss = _loss(second)
    assert captures.hits == hits + 1
    assert loss == pytest.approx(float(eager(**lm_batch(seed=3)).loss), rel=1e-5)
    eager(**lm_batch(seed=3)).loss.backward()
    for (name, p), q in zip(second.named_parameters(), eager.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("change", ["config", "frozen", "eval", "hook", "global backward hook", "shape"])
def test_what_the_graph_could_depend_on_makes_a_new_capture(captures, change):
    _loss(qwen3(layers=1, seed=11))
    model = qwen3(layers=1, seed=11)
    if change == "config":
        model.config.rms_norm_eps = 1e-3
    elif change == "frozen":
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    elif change == "eval":
        model.model.layers[0].eval()
    elif change == "hook":
        model.model.norm.register_forward_hook(lambda m, a, out: out)
    hits = captures.hits
    handle = None
    if change == "global backward hook":
        handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
        if handle is None:
            cm.train_step(**lm_batch(seed=3, seq=10 if change == "shape" else 12))
        else:   # a fresh capture says it cannot keep a module backward hook; a kept one would drop it
            with pytest.raises(CaptureError, match="backwards hooks"):
                cm.train_step(**lm_batch(seed=3))
    finally:
        if handle is not None:
            handle.remove()
    assert captures.hits == hits


def test_a_model_transformers_output_recorders_hook_is_served(captures):
    """transformers' output recorders (forward hooks that every capture installs, as a first
    eager call asking for outputs does) are no reason to capture again: a model captured before
    is served, and the kept capture trains it as eager."""
    from rpcompile.capture import _install_output_recorders
    _loss(qwen3(layers=1, seed=11))
    model = qwen3(layers=1, seed=12)
    eager = copy.deepcopy(model)
    _install_output_recorders(model)
    assert any(m._forward_hooks for m in model.modules())
    hits = captures.hits
    assert _loss(model) == pytest.approx(float(eager(**lm_batch(seed=3)).loss), rel=1e-5)
    assert captures.hits == hits + 1


def _scaled_loss(c):
    return lambda out, target: c * torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def test_a_loss_fn_is_served_by_what_it_computes(captures):
    """A call with a loss_fn is kept by its code and closure values: a new closure over an equal
    value is served, one over another value captures again and trains with its own."""
    def loss(model, loss_fn):
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
        batch = lm_batch(seed=3)
        return float(cm.train_step(input_ids=batch["input_ids"], target=batch["labels"], loss_fn=loss_fn))

    base = loss(qwen3(layers=1, seed=11), _scaled_loss(2.0))
    hits = captures.hits
    assert loss(qwen3(layers=1, seed=11), _scaled_loss(2.0)) == pytest.approx(base, rel=1e-6)
    assert captures.hits == hits + 1
    assert loss(qwen3(layers=1, seed=11), _scaled_loss(3.0)) == pytest.approx(1.5 * base, rel=1e-5)
    assert captures.hits == hits + 1


def test_a_peft_model_is_served_unless_its_adapter_state_changed(captures):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    def lora(seed):
        return get_peft_model(qwen3(layers=1, seed=seed), LoraConfig(r=2, target_modules=["q_proj"],
                                                                     init_lora_weights=False))
    _loss(lora(11))
    hits = captures.hits
    model = lora(12)
    eager = copy.deepcopy(model)
    assert _loss(model) == pytest.approx(float(eager(**lm_batch(seed=3)).loss), rel=1e-5)
    assert captures.hits == hits + 1
    scaled = lora(11)
    for m in scaled.modules():
        if hasattr(m, "set_scale") and "default" in getattr(m, "scaling", {}):
            m.set_scale("default", 0.5)
    _loss(scaled)
    assert captures.hits == hits + 1
