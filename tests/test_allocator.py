"""Note [expandable segments] (runtime/allocator.py): the runtime's allocator setting; Note
[compute streams outlive their model]: compute streams a dropped model gave back."""
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


def test_a_model_that_goes_gives_its_compute_streams_to_the_next(monkeypatch):
    """The free list on its own (CPU: a stand-in for torch.cuda.Stream); the GPU check, that the
    allocated memory stops growing over compiled models dropped, is
    benchmarks/runs/dropped_model/check.py."""
    made = []
    monkeypatch.setattr(allocator, "_free_compute_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(object()) or made[-1])
    dev = torch.device("cuda", 0)
    a, b = allocator.take_compute_stream(dev), allocator.take_compute_stream(dev)
    assert a is not b                          # models alive at once: streams of their own
    allocator.give_back_compute_stream(dev, a)
    allocator.give_back_compute_stream(dev, b)
    assert {id(allocator.take_compute_stream(dev)) for _ in range(2)} == {id(a), id(b)}
    assert allocator.take_compute_stream(torch.device("cuda", 1)) not in (a, b)   # per device
    assert len(made) == 3
