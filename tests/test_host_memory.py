"""cm.plan states the host memory a step needs, by kind (passes/host_memory.py)."""
import pytest

import rpcompile

from models import lm_batch, qwen3


@pytest.fixture(scope="module")
def frozen_qwen3():
    """qwen3 with layer 0's MLP frozen, and the compiled model of its exact-mode step (2 CPU
    devices, 2 microbatches) whose capture the delayed-mode plan reuses (nothing changes either)."""
    model = qwen3()
    model.model.layers[0].mlp.requires_grad_(False)       # frozen parameters: no gradient, no state
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    cm.train_step(**lm_batch())
    return model, cm


@pytest.mark.parametrize("mode", ["exact", "delayed"])
def test_plan_states_host_bytes_by_kind(mode, frozen_qwen3):
    model, cm = frozen_qwen3
    if mode == "exact":
        plan = cm.plan
    else:   # the plan a delayed-mode model makes of the same capture (its first call's)
        from rpcompile import passes
        config = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, optimizer_mode=mode)
        plan = passes.compile_graph(cm.plan.captured, config, "train")
    hm = plan.host_memory
    n = sum(p.numel() for p in model.parameters())
    t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert t < n
    tied = model.lm_head.weight.numel()     # the tied embedding gets a gradient piece in two jobs
    assert hm.masters == 4 * n and hm.grads == 4 * (t + tied) and hm.optimizer_state == 8 * t
    if mode == "exact":        # CPU devices read the parameters themselves; param.grad is the user's
        assert hm.working_copies == 0 and hm.param_grads == 4 * t
    else:   # two fp32 copies of trainable parameters; frozen ones (fp32) are their own (Note [frozen weights in place])
        assert hm.working_copies == 4 * 2 * t              # one gradient set: Note [one gradient set]
        assert hm.param_grads == 0
    assert hm.activations > 0
    assert "host memory" in str(plan) and "B/param" in str(plan)
    assert plan.to_json()["host_memory"]["gradients"] == 4 * (t + tied)
