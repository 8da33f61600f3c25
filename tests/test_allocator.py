"""Note [expandable segments] (runtime/allocator.py): the runtime's allocator setting."""
import torch

from rpcompile.runtime import allocator


def _calls(monkeypatch, env):
    calls = []
    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first, second = allocator.use_expandable_segments(), allocator.use_expandable_segments()
    return calls, first, second


def test_expandable_segments_are_turned_on_once(monkeypatch):
    calls, first, second = _calls(monkeypatch, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert calls == ["expandable_segments:True"] and first and not second


def test_a_setting_the_process_names_stands(monkeypatch):
    for env in ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
                {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}):
        calls, first, _ = _calls(monkeypatch, env)
        assert calls == [] and not first
