"""80th session: a sum over rows divided by an int argument, through
torch.compile(backend=rpcompile.backend(...), dynamic=True) on CUDA devices in fp32, against
eager over three calls (the count equal to the batch size, then others): loss and gradients."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x, t, count):
        return F.mse_loss(self.b(torch.tanh(self.a(x))), t, reduction="sum") / count


torch.manual_seed(0)
model = Regression()
ref = copy.deepcopy(model).cuda()
cfg = rpcompile.Config(devices=["cuda:0", "cuda:0"], num_microbatches=2, dtype=torch.float32)
compiled = torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)
worst_loss = worst_grad = 0.0
for count in (6, 40, 17):
    x, t = torch.randn(6, 8), torch.rand(6, 5)
    loss = compiled(x, t, count)
    loss.backward()
    expected = ref(x.cuda(), t.cuda(), count)
    expected.backward()
    worst_loss = max(worst_loss, abs(float(loss) - float(expected)) / abs(float(expected)))
scale = max(q.grad.abs().max().item() for q in ref.parameters())
for p, q in zip(model.parameters(), ref.parameters()):
    worst_grad = max(worst_grad, (p.grad.to(q.device) - q.grad).abs().max().item() / scale)
print(f"intarg: loss rel diff {worst_loss:.2e}, grads {worst_grad:.2e} of the largest", flush=True)
assert worst_loss < 1e-5 and worst_grad < 1e-4
