"""fp16 working copies with a gradient scaler: scaled seeds, unscaled step, skipped overflow."""
import copy

import torch
import torch.nn.functional as F

import rpcompile

from models import MLP


def test_fp16_with_grad_scaler_tracks_fp32_training():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, dtype=torch.float16,
                                                   loss_fn=F.mse_loss))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(3):
        loss = cm.train_step(x, target=y, grad_scale=scaler)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        loss_ref = F.mse_loss(ref(x), y)
        loss_ref.backward()
        opt_ref.step(), opt_ref.zero_grad()
        assert torch.allclose(loss.float(), loss_ref, rtol=5e-3), (loss.item(), loss_ref.item())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32, "host masters stay fp32"
        assert torch.allclose(p, q, atol=3e-3), (p - q).abs().max()


def test_overflow_skips_the_step():
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    cm = rpcompile.compile(model, rpcompile.Config(dtype=torch.float16, loss_fn=F.mse_loss))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)     # fp16 gradients overflow
    cm.train_step(torch.randn(8, 8), target=torch.randn(8, 4), grad_scale=scaler)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**40
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
