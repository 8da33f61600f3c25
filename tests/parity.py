"""Side-by-side training of a model with rpcompile and with eager PyTorch."""
import copy

import torch

import rpcompile


def close(a, b, rtol, atol, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs error {err:.3g}"


TIGHT = 1  # Config(memory_budget=TIGHT): a budget just above the smallest that fits


def tight_budget(model, batch, config, call, slack=1.15):
    """A memory budget 15% above the smallest one any plan fits (read off the PlanningError)."""
    probe = copy.deepcopy(model)
    cfg = copy.copy(config)
    cfg.memory_budget = 1
    try:
        call(rpcompile.compile(probe, config=cfg), batch)
    except rpcompile.PlanningError as e:
        return int(e.min_budget * slack)
    raise AssertionError("a 1-byte memory budget should not fit any plan")


def train_both(model, batches, config, *, call=None, eager_step=None, steps=3, lr=1e-3,
               loss_rtol=1e-5, param_rtol=1e-4, param_atol=1e-6, min_stages=2):
    """Train a copy with rpcompile and one eagerly; check loss, grads and parameters agree.

    batches: list of kwargs dicts, one per step. call(cm, batch) -> loss runs rpcompile
    (default: cm.train_step(**batch)); eager_step(model, batch) -> loss runs eager forward +
    backward (default: model(**batch).loss.backward()). Returns the compiled model.
    """
    ref = copy.deepcopy(model)
    call = call or (lambda cm, b: cm.train_step(**b))
    if config.memory_budget == TIGHT:
        config.memory_budget = tight_budget(model, batches[0], config, call)
    cm = rpcompile.compile(model, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)

    def default_eager(m, b):
        loss = m(**b).loss
        loss.backward()
        return loss

    eager_step = eager_step or default_eager
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = call(cm, batch)
        loss_ref = eager_step(ref, batch)
        close(loss.detach().float(), loss_ref.detach().float(), loss_rtol, 1e-6, f"loss at step {step}")
        if step == 0:
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if q.grad is None:
                    assert p.grad is None or not p.grad.any(), f"{name}: gradient where eager has none"
                    continue
                close(p.grad, q.grad, param_rtol, 1e-5, f"grad of {name}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), param_rtol, param_atol, f"{name} after {steps} AdamW steps")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        close(b.float(), c.float(), param_rtol, param_atol, f"buffer {name} after {steps} steps")
    if min_stages and cm.plan is not None:
        assert len(cm.plan.stages) >= min_stages, f"expected a pipelined plan, got\n{cm.plan}"
    return cm
