"""peft models as users change them between calls: the adapter state a capture followed (Note
[adapter state in the key] in rpcompile/adapter_state.py)."""
import copy

import pytest
import torch

import rpcompile

from models import checkpointing_on, lm_batch, qwen3
from parity import train_both

pytest.importorskip("peft")


def _two_adapters(inference=False):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(qwen3(tied=False, layers=2), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                   target_modules=["q_proj", "v_proj", "down_proj"]))
    model.add_adapter("b", LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "q_proj"], init_lora_weights=False))
    if inference:
        model.set_adapter("default", inference_mode=True)
    return model


def _scale_half(model):
    for m in model.modules():
        if hasattr(m, "set_scale") and "default" in getattr(m, "scaling", {}):
            m.set_scale("default", 0.5)


CHANGES = {
    "merge_adapter": (False, lambda m: m.merge_adapter()),
    "merge_then_unmerge": (False, lambda m: (m.merge_adapter(), m.unmerge_adapter())),
    "disable_adapter_layers": (True, lambda m: m.base_model.disable_adapter_layers()),
    "set_adapter_b": (True, lambda m: m.set_adapter("b", inference_mode=True)),
    "set_scale": (True, _scale_half),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_call_after_an_adapter_state_change_equals_eager_peft(change):
    """Changes that leave every parameter's requires_grad as it was: the old capture went on
    (after merge_adapter() the update was added twice: logits 0.166 off eager peft's)."""
    inference, apply = CHANGES[change]
    model = _two_adapters(inference)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    batch = lm_batch()
    with torch.no_grad():
        torch.testing.assert_close(cm(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)
        apply(model)
        apply(ref)
        want = ref(**batch).logits
        torch.testing.assert_close(cm(**batch).logits, want, rtol=1e-5, atol=1e-5)


def test_lora_with_gradient_checkpointing_trains_as_eager_peft():
    """peft with the model's gradient checkpointing on (enable_input_require_grads: a hook on the
    input embeddings that makes their output require grad) was a CaptureError naming neither
    (Note [model's own checkpointing] in rpcompile/capture.py); it trains as eager peft, and the
    hook is back on the model after the capture."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    base = qwen3(tied=False, layers=2)
    checkpointing_on(base)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    embed = model.get_input_embeddings()
    hooks = dict(embed._forward_hooks)
    assert any(h.__name__ == "make_inputs_require_grads" for h in hooks.values())
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    train_both(model, [lm_batch(seed=s) for s in range(3)], cfg, min_stages=0)
    assert dict(embed._forward_hooks) == hooks


def test_a_train_step_with_nothing_to_train_says_so_and_the_next_one_trains():
    """Under disable_adapter() no trainable parameter reaches the loss (eager's backward raises):
    the train plan had no loss output, a KeyError at that step and at every later one."""
    model = _two_adapters()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    batch = lm_batch()
    with model.disable_adapter(), pytest.raises(rpcompile.InputError, match="nothing to train"):
        cm.train_step(**batch)
    assert all(p.grad is None for p in model.parameters())
    cm.train_step(**batch)
    ref(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_dora_trains_as_eager_peft():
    """DoRA reads its base weight through peft's dequantize_module_weight, which dynamo cannot
    trace (a CaptureError); with no quantized weight it is the weight itself (Note [DoRA's base
    weight] in rpcompile/lora_params.py)."""
    from peft import LoraConfig, get_peft_model
    import peft.tuners.lora.dora as dora
    torch.manual_seed(0)
    model = get_peft_model(qwen3(tied=False, layers=2), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]))
    reader = dora.dequantize_module_weight
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    train_both(model, [lm_batch(seed=s) for s in range(3)], cfg, min_stages=0)
    assert dora.dequantize_module_weight is reader
