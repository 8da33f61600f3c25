"""What a plan key holds of a peft model's adapter state.

Note [adapter state in the key]: a capture follows the Python branches and reads the constants
of the call it traced. peft's layers branch on state that is no tensor: which adapters are
merged into the base weights (`merge_adapter`), whether the adapters are disabled
(`disable_adapter_layers`, the `disable_adapter()` context), which are active (`set_adapter`)
and their scaling (`set_scale`). A plan key held only which parameters train, so where such a
change left requires_grad alone (a merge of trainable adapters, anything on adapters loaded
for inference) the old capture went on: after `merge_adapter()` the LoRA update was added twice
(logits 0.166 off eager peft's), a disabled inference adapter still applied (0.557). So the key
holds each adapter layer's state, found by the attributes peft's BaseTunerLayer has (peft is
no dependency); a change captures again.
"""
from __future__ import annotations


def adapter_layers(model) -> list:
    """The model's peft adapter layers (BaseTunerLayer, by its attributes)."""
    return [m for m in model.modules() if hasattr(m, "merged_adapters") and hasattr(m, "active_adapters")
            and hasattr(m, "disable_adapters")]


def adapter_state(layers) -> tuple:
    """Each layer's merged, disabled and active adapters and their scaling, as a key."""
    state = []
    for m in layers:
        scaling = getattr(m, "scaling", None)
        scales = tuple(sorted((k, repr(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else None
        state.append((tuple(m.merged_adapters), bool(m.disable_adapters), tuple(m.active_adapters), scales))
    return tuple(state)
