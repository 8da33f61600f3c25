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
