"""peft models as users change them between calls: the adapter state a capture followed (Note
[adapter state in the key] in rpcompile/adapter_state.py)."""
import copy

import pytest
import torch

import rpcompile

from models import lm_batch, qwen3

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
