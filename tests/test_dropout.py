"""Dropout: the backward's recompute replays the forward's random masks (Note [RNG replay])."""
import torch
import torch.nn.functional as F

import rpcompile

from models import WithDropout


def _compiled(model, devices=2, microbatches=3):
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, loss_fn=F.mse_loss,
                           memory_budget=9000)
    return rpcompile.compile(model, config=cfg)


def test_dropout_is_active_and_seeded():
    model = WithDropout().double()
    x, y = torch.randn(7, 8, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    cm = _compiled(model)
    torch.manual_seed(5)
    a = cm.train_step(x, target=y)
    torch.manual_seed(5)
    b = cm.train_step(x, target=y)
    c = cm.train_step(x, target=y)
    assert len(cm.plan.stages) >= 3 and any(st.random for st in cm.plan.stages)
    assert torch.equal(a, b), "the same seed gives the same masks"
    assert not torch.equal(b, c), "a new step draws new masks"
    model.eval()
    assert not torch.allclose(a, F.mse_loss(model(x), y)), "dropout must be active in train mode"


def test_dropout_gradient_matches_finite_differences():
    """With the masks fixed by the seed, the loss is a smooth function of the parameters; the
    gradient rpcompile computes (recompute in other stages than the forward) must be its
    derivative, which fails if a recompute drew other masks than the forward."""
    model = WithDropout().double()
    x, y = torch.randn(7, 8, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    cm = _compiled(model)

    def loss_at(seed=11):
        torch.manual_seed(seed)
        return cm.train_step(x, target=y).double()

    model.zero_grad()
    loss_at()
    grads = [p.grad.clone() for p in model.parameters()]
    direction = [torch.randn_like(p) for p in model.parameters()]
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(model.parameters(), direction):
            p.add_(eps * d)
    plus = loss_at()
    with torch.no_grad():
        for p, d in zip(model.parameters(), direction):
            p.sub_(2 * eps * d)
    minus = loss_at()
    numeric = (plus - minus) / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip(grads, direction))
    assert torch.allclose(numeric, analytic, rtol=1e-5, atol=1e-9), (numeric.item(), analytic.item())


def test_dropout_does_not_disturb_the_callers_rng():
    model = WithDropout()
    cm = _compiled(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    torch.manual_seed(3)
    cm.train_step(x, target=y)
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.randint(0, 2**62, ())   # the one draw a step takes: its base seed
    assert torch.equal(after, torch.rand(3))
