"""Keep only the outputs a training step needs (the loss), so the rest is never computed."""
from __future__ import annotations

import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from .graph_utils import eliminate_dead_code, output_values, set_outputs


def loss_leaf_index(out_spec, n_leaves: int):
    """Index of the loss among the output leaves: the `loss` field, or the one scalar output."""
    if out_spec is None:
        return None
    tree = pytree.tree_unflatten(list(range(n_leaves)), out_spec)
    for getter in (lambda t: t["loss"], lambda t: t.loss):
        try:
            idx = getter(tree)
            if isinstance(idx, int):
                return idx
        except (KeyError, AttributeError, TypeError, IndexError):
            pass
    if isinstance(tree, int):
        return tree
    return None


def keep_loss_output(gm: fx.GraphModule, loss_output: int) -> fx.GraphModule:
    """Make the loss the graph's only output and drop what only other outputs needed."""
    outs = output_values(gm.graph)
    loss = outs[loss_output]
    ev = loss.meta.get("example_value") if isinstance(loss, fx.Node) else None
    if ev is None or ev.dim() != 0:
        shape = None if ev is None else tuple(ev.shape)
        raise CaptureError(f"the model's loss output has shape {shape}; train_step needs a scalar loss. "
                           "Reduce it to a scalar or pass Config(loss_fn=...)")
    set_outputs(gm, [loss])
    eliminate_dead_code(gm)
    gm.graph.lint()
    return gm
