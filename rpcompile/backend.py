"""`torch.compile(model, backend="rpcompile")`: the same compiler as a dynamo backend."""
from __future__ import annotations

from typing import Optional

import torch

from .capture import from_dynamo
from .config import Config
from .passes import compile_graph
from .runner import GraphRunner


def backend(config: Optional[Config] = None):
    """A dynamo backend running the graph as rpcompile stages: torch.compile(m, backend=rpcompile.backend(cfg))."""
    config = config or Config()
    runner = GraphRunner(config)
    plans = []

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        cap = from_dynamo(gm, example_inputs)
        plan = compile_graph(cap, config, "call")

        def run(*flat_args):
            return runner.call(plan, list(flat_args))

        plans.append(plan)
        return run

    compile_fn.plans = plans   # every graph dynamo handed over, newest last
    return compile_fn


def rpcompile_backend(gm, example_inputs):
    """The backend registered as "rpcompile" (default Config: devices=["cpu"])."""
    return backend()(gm, example_inputs)
