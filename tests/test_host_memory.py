"""cm.plan states the host memory a step needs, by kind (passes/host_memory.py)."""
import pytest
import torch

import rpcompile

from models import lm_batch, qwen3


@pytest.mark.parametrize("mode", ["exact", "delayed"])
def test_plan_states_host_bytes_by_kind(mode):
    model = qwen3()
    model.model.layers[0].mlp.requires_grad_(False)       # frozen parameters: no gradient, no state
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, optimizer_mode=mode))
    if mode != "exact":
        cm.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    cm.train_step(**lm_batch())
    hm = cm.plan.host_memory
    n = sum(p.numel() for p in model.parameters())
    t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert t < n
    tied = model.lm_head.weight.numel()     # the tied embedding gets a gradient piece in two jobs
    assert hm.masters == 4 * n and hm.grads == 4 * (t + tied) and hm.optimizer_state == 8 * t
    if mode == "exact":        # CPU devices read the parameters themselves; param.grad is the user's
        assert hm.working_copies == 0 and hm.param_grads == 4 * t
    else:                      # two fp32 copies of trainable parameters, one of frozen ones
        assert hm.working_copies == 4 * (2 * t + (n - t))   # one gradient set: Note [one gradient set]
        assert hm.param_grads == 0
    assert hm.activations > 0
    assert "host memory" in str(cm.plan) and "B/param" in str(cm.plan)
    assert cm.plan.to_json()["host_memory"]["gradients"] == 4 * (t + tied)
