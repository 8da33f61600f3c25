"""Inductor's autotuning at first calls on devices (rpcompile/runtime/autotune.py)."""
from types import SimpleNamespace

import torch
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from rpcompile.runtime import autotune


def test_autotune_clones_written_arguments_on_a_device_with_room(monkeypatch):
    """Note [autotune's clones on the device]: a kernel's written arguments are cloned on their device
    when it has room for them, else Inductor's host copies stand; kernels Inductor clones anyway
    (optimize_mem off) and host tensors are left to it."""
    grad, x = torch.empty(1000, dtype=torch.bfloat16, device="meta"), torch.empty(10, 300, device="meta")
    kernel = SimpleNamespace(optimize_mem=True, fn=SimpleNamespace(arg_names=["in_out_ptr0", "in_ptr0"]),
                             mutated_arg_names=["in_out_ptr0"])
    assert autotune.written_bytes(kernel.fn.arg_names, kernel.mutated_arg_names, (grad, x), {}) == \
        (torch.device("meta"), 2000)
    # a view spans its storage from the start up to its last element
    assert autotune.written_bytes(["a"], ["a"], (x[:, ::2],), {})[1] == (9 * 300 + 298 + 1) * 4
    monkeypatch.setattr(autotune, "device_room", lambda device: 2000)
    assert autotune.device_clones(kernel, (grad, x), {})
    monkeypatch.setattr(autotune, "device_room", lambda device: 1999)
    assert not autotune.device_clones(kernel, (grad, x), {})
    monkeypatch.setattr(autotune, "device_room", lambda device: 10**12)
    assert not autotune.device_clones(SimpleNamespace(**{**vars(kernel), "optimize_mem": False}), (grad, x), {})
    assert not autotune.device_clones(kernel, (torch.empty(1000, dtype=torch.bfloat16), x), {})
    # installed once: Inductor's autotuner asks us first
    original = CachingAutotuner.copy_args_to_cpu_if_needed
    monkeypatch.setattr(autotune, "_installed", [False])
    monkeypatch.setattr(CachingAutotuner, "copy_args_to_cpu_if_needed", original)
    assert autotune.clones_on_device() and autotune.clones_on_device()
    assert CachingAutotuner.copy_args_to_cpu_if_needed is not original
    asked = []
    monkeypatch.setattr(autotune, "device_clones", lambda *a: asked.append(a) or True)
    assert CachingAutotuner.copy_args_to_cpu_if_needed(kernel, grad, x) == {} and asked == [(kernel, (grad, x), {})]
