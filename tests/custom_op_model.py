"""A model whose module registers the operator its forward calls (torch.library), as a model's
own kernels do: a worker process has that operator only once it imports this module."""
import torch
import torch.nn as nn


@torch.library.custom_op("rpcompile_tests::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


scale.register_fake(lambda x, factor: torch.empty_like(x))
scale.register_autograd(lambda ctx, g: (g * ctx.factor, None),
                        setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]))


class ScaledMLP(nn.Module):
    def __init__(self, width=8, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = scale(torch.tanh(layer(x)), 0.5)
        return x.square().mean()
