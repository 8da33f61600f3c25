"""LoRA on parameters (peft's target_parameters) in a capture.

Note [LoRA on parameters]: peft adapts a module's layers by wrapping them (lora.Linear: traced as
any module), but a parameter that is not a layer's weight (a transformers MoE's experts, stored as
one 3-D `gate_up_proj` and `down_proj`; a router's `weight`) by a ParamWrapper, whose forward
registers a parametrization on the module (`W + scale * B @ A`, peft's proxy), calls it, and
removes the parametrization again. TorchDynamo cannot trace that (the removal `set_`s the
parameter, "Getting an inplace view on a graph input is not supported"): with peft 0.21, LoRA on
`target_modules="all-linear"` of a transformers 5 Qwen3-MoE, which peft turns into
target_parameters for the experts and the router, was a CaptureError. While rpcompile captures a
model, ParamWrapper.forward computes the same adapted weight with the same proxy (peft's own
choice of `_activate_lora`: the low-rank factors folded in one baddbmm for one adapter on
experts, else the summed delta) and calls the wrapped module with it in place of the parameter
(torch.func.functional_call, which dynamo traces); nested wrappers (two parameters of one
module) each substitute their own. The graph reads lora_A and lora_B as parameters, so they get
gradients as eagerly. Outside a capture nothing changes. The patch is on the class for the time
of a capture, so peft models another thread runs eagerly meanwhile take this path too (same
values). A peft without these parts is left alone (its capture fails as before).
"""
from __future__ import annotations

import contextlib
import sys

import torch


def _adapted_weight(layer, wrapper, adapters):
    """The parameter as peft's parametrization gives it while `adapters` are active."""
    param = wrapper.get_param()
    low = any(getattr(torch, n, None) == param.dtype for n in getattr(layer, "UPCAST_DTYPES", ()))
    factors = getattr(layer, "_LoraFactorsProxy", None)
    if factors is not None and len(adapters) == 1 and getattr(wrapper, "num_experts", 1) > 1 and not low:
        return factors(*wrapper.get_delta_factors(adapters[0]))(param)
    delta = None
    for name in adapters:
        d = wrapper.get_delta_weight(name)
        delta = d if delta is None else delta + d
    return layer._LoraParameterProxy(delta)(param)


def _traceable_forward(layer, original):
    def forward(self, x, *args, **kwargs):
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if self.disable_adapters or self.merged or not adapters or kwargs.get("adapter_names") is not None:
            return original(self, x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        path, inner = [], self.base_layer        # the parameter's place below self.base_layer
        while inner is not self.get_base_layer():
            path.append("base_layer")
            inner = inner.base_layer
        key = ".".join(path + [self.parameter_name])
        weight = _adapted_weight(layer, self, adapters)
        return torch.func.functional_call(self.base_layer, {key: weight}, (x, *args), kwargs)
    return forward


@contextlib.contextmanager
def traceable_lora_params(model=None):
    """peft's ParamWrapper traceable for the duration (Note [LoRA on parameters]), and DoRA's
    weight reads (Note [DoRA's base weight])."""
    with _traceable_dora(model):
        layer = sys.modules.get("peft.tuners.lora.layer")   # (peft is not imported if the model has none)
        wrapper = getattr(layer, "ParamWrapper", None)
        needs = ("get_param", "get_delta_weight", "get_base_layer", "_check_forward_args")
        if (wrapper is None or not hasattr(layer, "_LoraParameterProxy")
                or not all(hasattr(wrapper, n) for n in needs)):
            yield
            return
        original = wrapper.forward
        wrapper.forward = _traceable_forward(layer, original)
        try:
            yield
        finally:
            wrapper.forward = original


# Note [DoRA's base weight]: DoRA (LoraConfig(use_dora=True)) reads the base layer's weight through
# peft's dequantize_module_weight, which tests `type(module.weight).__module__.startswith("torchao.")`:
# dynamo cannot trace that (a CaptureError at peft/utils/integrations.py). For a model with no
# quantized weight (no HQQ `W_q`, no torchao tensor: checked on the host tensors before the
# capture) the function returns the weight itself, which is what it returns for one; the modules
# that imported it by name read this one for the time of a capture.
_DORA_READERS = ("peft.utils.integrations", "peft.tuners.lora.dora", "peft.tuners.lora.layer",
                 "peft.tuners.lora.variants")


@contextlib.contextmanager
def _traceable_dora(model):
    readers = [m for m in (sys.modules.get(n) for n in _DORA_READERS) if hasattr(m, "dequantize_module_weight")]
    if model is None or not readers or any(
            hasattr(m, "W_q") or type(getattr(m, "weight", None)).__module__.startswith("torchao.")
            for m in model.modules()):
        yield
        return
    originals = [(m, m.dequantize_module_weight) for m in readers]

    def plain_weight(module):
        return module.weight
    for m, _ in originals:
        m.dequantize_module_weight = plain_weight
    try:
        yield
    finally:
        for m, f in originals:
            m.dequantize_module_weight = f
