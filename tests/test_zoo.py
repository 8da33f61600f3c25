"""The zoo: every family of tests/zoo.py trains 3 steps, pipelined over CPU devices with uneven
microbatches, with the loss, the gradients and the parameters (SGD with momentum) and buffers
equal to eager PyTorch's; LoRA through peft on a decoder and on an MoE. The families take the
two layouts in turn (2 devices and 5 rows over 3 microbatches, 3 devices and 4 microbatches), so
each layout runs on half of them."""
import pytest
import torch

import rpcompile

from parity import TIGHT, train_both
from zoo import CASES, LoopMoELM, _hf_eager, lm_batch, plain_eager, qwen2, qwen3_moe

LAYOUTS = [(2, 3), (3, 4)]    # (devices, microbatches) of 5 rows: 2+2+1 and 2+1+1+1


@pytest.mark.parametrize("case,devices,microbatches", [(c, *LAYOUTS[i % 2]) for i, c in enumerate(CASES)],
                         ids=[f"{c.name}-{LAYOUTS[i % 2][0]}-{LAYOUTS[i % 2][1]}" for i, c in enumerate(CASES)])
def test_zoo_trains_like_eager(case, devices, microbatches):
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, loss_fn=case.loss_fn,
                           memory_budget=TIGHT if case.tight else None)
    eager = case.eager or _hf_eager
    cm = train_both(case.build(), [case.batch(s) for s in range(3)], cfg, call=case.call,
                    eager_step=lambda m, b: eager(m, b, microbatches))
    assert len(cm.last_placements) >= 2 and len({d for *_, d in cm.last_placements}) == devices


def _lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kwargs))


@pytest.mark.parametrize("make,targets", [
    (qwen2, {"target_modules": ["q_proj", "v_proj", "down_proj"]}),
    (LoopMoELM, {"target_modules": ["gate", "w1", "w2", "w3"]}),      # the router and every expert
    (qwen3_moe, {"target_modules": ["q_proj", "v_proj"],    # + the experts' 3-D parameters, the router's
                 "target_parameters": ["experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"]}),
], ids=["decoder", "moe", "transformers_moe"])
def test_lora_through_peft(make, targets):
    """Only the adapters train: the base weights stay frozen, and the adapters' gradients and
    steps equal eager peft's (init_lora_weights=False: B is not zero, so every adapter weight
    gets a gradient from the first step). The MoE's adapters sit on its router and on every
    expert, whose tokens are picked by data-dependent routing. On transformers' Qwen3-MoE, the
    experts' stacked 3-D parameters and the router's weight are adapted through peft's
    target_parameters (what target_modules="all-linear" picks there since peft 0.21), whose
    parametrization is applied functionally while capturing (Note [LoRA on parameters]; a
    CaptureError before)."""
    torch.manual_seed(0)
    model = _lora(make(), **targets)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if make is qwen3_moe:
        assert any(".experts." in n for n in trainable) and any(".mlp.gate." in n for n in trainable)
    # (the tiny MoE's plan may be one job: a tight budget pipelines it whatever peft's graph costs)
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=3, memory_budget=TIGHT if make is qwen3_moe else None)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cm = train_both(model, [lm_batch(s) for s in range(3)], cfg, eager_step=lambda m, b: plain_eager(m, b, 3))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert len(cm.plan.stages) >= 2
