"""`torch.compile(model, backend="rpcompile")`: the same compiler as a dynamo backend."""
from __future__ import annotations

from typing import Optional

import torch

from .capture import from_dynamo
from .config import Config
from .passes import compile_graph
from .runner import GraphRunner, PipelineCall


def backend(config: Optional[Config] = None):
    """A dynamo backend running the graph as rpcompile stages: torch.compile(m, backend=rpcompile.backend(cfg))."""
    config = config or Config()
    runner = GraphRunner(config)
    plans = []

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        cap = from_dynamo(gm, example_inputs)
        plan = compile_graph(cap, config, "call")
        params = cap.params

        def run(*flat_args):
            leaves = list(flat_args)
            tensors = [a for a in leaves if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)]
            needs_grad = torch.is_grad_enabled() and (any(p.requires_grad for p in params)
                                                      or any(t.requires_grad for t in tensors))
            if needs_grad:
                outs = PipelineCall.apply(runner, plan, leaves, len(params), *params,
                                          *[a for a in leaves if isinstance(a, torch.Tensor)])
                return list(outs)
            outputs, _ = runner.call_forward(plan, leaves, keep_for_backward=False)
            return outputs

        plans.append(plan)
        return run

    compile_fn.plans = plans   # every graph dynamo handed over, newest last
    return compile_fn


def rpcompile_backend(gm, example_inputs):
    """The backend registered as "rpcompile" (default Config: devices=["cpu"])."""
    return backend()(gm, example_inputs)
