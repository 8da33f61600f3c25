"""Note [layers traced once] (rpcompile/layers_once.py): the capture traces a repeated layer once
and inlines the stamped-out copies; the graph the passes see is the one a plain capture gives."""
import contextlib
from unittest import mock

import pytest
import torch

import rpcompile
from rpcompile import layers_once
from rpcompile.capture import capture_call
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from models import llama, lm_batch, qwen3
from parity import TIGHT, train_both
from zoo import LoopMoELM
from zoo import lm_batch as zoo_batch


def _capture(model, batch, plain=False):
    unmarked = mock.patch.object(layers_once, "marked", lambda model: contextlib.nullcontext(False))
    with unmarked if plain else contextlib.nullcontext():
        return capture_call(model, (), batch, dtype=torch.float32)


def _counting(monkeypatch) -> list:
    """The number of regions each capture inlined, as it inlines them."""
    counts, real = [], layers_once.inline_regions
    monkeypatch.setattr(layers_once, "inline_regions", lambda gm: counts.append(real(gm)) or counts[-1])
    return counts


def _calls(cap):
    """Each call node: what it calls, its module path, and its inputs by position."""
    names, out = {}, []
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = ("in", n.meta.get("rp_kind"), n.meta.get("rp_name") or n.meta.get("rp_leaf_name"))
            continue
        stack = n.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else None
        names[n] = len(out)
        args = tuple(names.get(a, a) if isinstance(a, torch.fx.Node) else a for a in n.args)
        out.append((n.op, str(n.target), path, str(args)))
    return out


@pytest.mark.parametrize("make", [qwen3, llama])
def test_a_capture_with_layers_traced_once_equals_a_plain_capture(make, monkeypatch):
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    model = make(layers=3)
    batch = lm_batch()
    calls = _counting(monkeypatch)
    once = _capture(model, batch)
    assert calls == [3], "each of the 3 layers was one stamped-out region, inlined"
    plain = _capture(model, batch, plain=True)
    assert not any("invoke_subgraph" in str(n.target) for n in once.gm.graph.nodes)
    assert _calls(once) == _calls(plain)
    paths = {c[2] for c in _calls(once) if c[2]}
    assert {f"L['model'].model.layers.{i}" for i in range(3)} <= paths


def test_only_the_outermost_repeated_layers_are_marked(monkeypatch):
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    model = qwen3(layers=2)
    marked = layers_once.repeated_classes(model)
    assert [c.__name__ for c in marked] == ["Qwen3DecoderLayer"]
    assert layers_once.repeated_classes(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == {}


def test_the_classes_are_as_they_were_after_a_capture(monkeypatch):
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    model = qwen3(layers=2)
    cls = type(model.model.layers[0])
    before = cls.__dict__.get("forward")
    with layers_once.marked(model) as any_marked:
        assert any_marked and cls.__dict__["forward"] is not before
    assert cls.__dict__.get("forward") is before
    assert not hasattr(before, "__marked_compile_region_config__")


def test_layers_with_data_dependent_sizes_are_captured_plain(monkeypatch):
    """An MoE layer's torch.where makes unbacked sizes: stamped-out copies would share the first
    layer's symbols, so the capture runs unmarked and each layer has its own."""
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    calls = _counting(monkeypatch)
    cap = _capture(LoopMoELM(layers=2), zoo_batch(0))
    assert calls == []     # the marked capture stopped at the first region
    symbols = set()
    for n in cap.gm.graph.nodes:
        symbols |= set(free_unbacked_symbols(n.meta.get("example_value")))
    plain = _capture(LoopMoELM(layers=2), zoo_batch(0), plain=True)
    plain_symbols = set()
    for n in plain.gm.graph.nodes:
        plain_symbols |= set(free_unbacked_symbols(n.meta.get("example_value")))
    assert len(symbols) == len(plain_symbols) >= 8     # 4 experts a layer, each its own size


def test_training_on_layers_traced_once_matches_eager(monkeypatch):
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    calls = _counting(monkeypatch)
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT)
    train_both(qwen3(layers=3), [lm_batch(seed=s) for s in range(2)], cfg)
    assert calls and calls[0] == 3


def test_nothing_is_marked_where_dynamo_would_trace_each_region_anew(monkeypatch):
    """Torch 2.11's dynamo has no reuse entries: a marked capture was slower than a plain one."""
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    monkeypatch.setattr(layers_once, "_stamps_out", lambda: False)
    model = qwen3(layers=2)
    with layers_once.marked(model) as any_marked:
        assert not any_marked
        assert not hasattr(type(model.model.layers[0]).forward, "__marked_compile_region_fn__")


def test_moe_layers_of_grouped_matmuls_are_traced_once_and_train_like_eager(monkeypatch):
    """transformers' Qwen3-MoE experts sort tokens and run grouped matmuls (no sizes from the
    data): their layers are stamped out, and training equals eager's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    monkeypatch.setattr(layers_once, "MIN_REPEATS", 2)
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32))
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT)
    train_both(model, [zoo_batch(s) for s in range(2)], cfg)
    assert calls and calls[0] == 3
