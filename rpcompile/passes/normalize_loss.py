"""Make a microbatched loss equal the whole batch's loss.

Note [whole-batch loss]: a mean cross-entropy over the counted tokens of each microbatch,
averaged over microbatches, is not the mean over the whole batch when the counts differ
(ignored labels spread unevenly, uneven microbatches). We rewrite the loss into its *sum*
over counted tokens and keep a small `counter` graph, read off the labels alone, that the
runtime evaluates on every microbatch before the step: the loss of the batch is
sum_m(sum_m) / sum_m(count_m), and each microbatch's backward is seeded with 1 / count.
With class weights the count is the weight total of the counted targets (sum of
weight[target]), which is what F.cross_entropy's mean divides by; label smoothing divides by
the same count. A cross-entropy with reduction="sum" adds up over microbatches as it is.
Any other scalar loss is taken as a mean over rows and weighted by rows per microbatch.

Every spelling of the call is handled: `F.cross_entropy(x, y, ...)` with any of its arguments
positional or by keyword, and the `nn.CrossEntropyLoss(weight=..., ignore_index=...,
reduction=..., label_smoothing=...)` module, which dynamo traces into that call (the legacy
size_average/reduce arguments are resolved into a reduction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import bind_cross_entropy, graph_module, output_values


@dataclass
class LossScale:
    kind: str                                # "tokens" (sum over counted tokens), "sum" (a sum: add
                                             # microbatches as they are) or "rows" (mean over rows)
    output: int = 0                          # which graph output is the loss
    counter: Optional[fx.GraphModule] = None  # tokens: counts one microbatch's counted tokens
    ignore_index: int = -100


def cross_entropy_reduction(bound: dict) -> Optional[str]:
    """The reduction a bound cross-entropy call applies ("mean", "sum" or "none"), legacy
    size_average/reduce resolved as F.cross_entropy resolves them; None when not a constant."""
    if bound["size_average"] is not None or bound["reduce"] is not None:
        try:
            return torch.nn._reduction.legacy_get_string(bound["size_average"], bound["reduce"], emit_warning=False)
        except Exception:
            return None
    return bound["reduction"] if bound["reduction"] in ("mean", "sum", "none") else None


def _class_targets(bound: dict) -> bool:
    """Targets are class indices (not class probabilities): ignore_index applies."""
    target = bound["target"]
    ev = target.meta.get("example_value") if isinstance(target, fx.Node) else None
    return isinstance(ev, torch.Tensor) and not ev.is_floating_point()


def mean_cross_entropy(node: fx.Node):
    """(input, target, ignore_index) when `node` is a mean cross-entropy over class indices
    (with or without class weights and label smoothing), else None."""
    bound = bind_cross_entropy(node)
    if bound is None or cross_entropy_reduction(bound) != "mean" or not _class_targets(bound):
        return None
    if not isinstance(bound["ignore_index"], int):
        return None
    return bound["input"], bound["target"], bound["ignore_index"]


def _counter_graph(gm: fx.GraphModule, target: fx.Node, ignore_index: int, weight,
                   classes: Optional[int] = None) -> Optional[fx.GraphModule]:
    """A graph from the inputs to the count of targets != ignore_index, or with class weights
    to the weight total of those targets; None if the targets depend on parameters or buffers
    (the weight may be a buffer or parameter: the runtime passes the host tensor). It refuses a
    counted target outside [0, classes), as F.cross_entropy does (a vocabulary-split head would
    otherwise give a finite, wrong loss); it runs on the host before the step's jobs."""
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.op == "placeholder" and n.meta.get("rp_kind") in ("param", "buffer"):
            return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    if isinstance(weight, fx.Node):
        stack = [weight]
        while stack:
            n = stack.pop()
            if n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = g.node_copy(n, lambda x: env[x])
    counted = g.call_function(torch.ne, (env[target], ignore_index))
    if classes is not None:
        outside = g.call_function(torch.logical_or, (g.call_function(torch.lt, (env[target], 0)),
                                                     g.call_function(torch.ge, (env[target], classes))))
        bad = g.call_function(torch.any, (g.call_function(torch.logical_and, (counted, outside)),))
        g.call_function(torch._assert_async, (g.call_function(torch.logical_not, (bad,)),
                                              f"cross_entropy: a target is out of bounds: not in [0, {classes}) and "
                                              f"not ignore_index {ignore_index}"))
    if weight is None:
        g.output(g.call_method("sum", (counted,)))
    else:
        w = env[weight] if isinstance(weight, fx.Node) else weight
        labels = g.call_function(torch.Tensor.__getitem__, (env[target], counted))
        picked = g.call_function(torch.Tensor.__getitem__, (w, labels))
        g.output(g.call_method("sum", (g.call_method("double", (picked,)),)))
    return graph_module(gm, g, "LossCounter")


def _classes(logits: fx.Node) -> Optional[int]:
    """The class count of cross-entropy logits ((N, C, ...) or (C,)), when it is static."""
    ev = logits.meta.get("example_value") if isinstance(logits, fx.Node) else None
    if not isinstance(ev, torch.Tensor) or ev.dim() == 0:
        return None
    c = ev.shape[1] if ev.dim() >= 2 else ev.shape[0]
    return c if isinstance(c, int) else None


def _rewrite_reduction(node: fx.Node, bound: dict, reduction: str) -> None:
    """Rewrite a cross-entropy call as F.cross_entropy(input, target, **named) with `reduction`."""
    named = {k: v for k, v in bound.items() if k not in ("input", "target", "size_average", "reduce")}
    named["reduction"] = reduction
    node.target = F.cross_entropy
    node.args = (bound["input"], bound["target"])
    node.kwargs = named


def normalize_loss(gm: fx.GraphModule, loss_output: int = 0) -> fx.GraphModule:
    """Rewrite a mean cross-entropy loss into a token sum plus a counter graph (gm.meta['rp_loss'])."""
    loss = output_values(gm.graph)[loss_output]
    bound = bind_cross_entropy(loss) if isinstance(loss, fx.Node) else None
    reduction = cross_entropy_reduction(bound) if bound is not None else None
    if reduction == "sum":
        _rewrite_reduction(loss, bound, "sum")    # legacy arguments resolved, for split_lm_head
        gm.meta["rp_loss"] = LossScale("sum", output=loss_output)
        gm.graph.lint()
        gm.recompile()
        return gm
    found = mean_cross_entropy(loss) if bound is not None else None
    weight = bound["weight"] if found else None
    counter = _counter_graph(gm, found[1], found[2], weight, _classes(found[0])) if found else None
    if counter is None:
        gm.meta["rp_loss"] = LossScale("rows", output=loss_output)
        return gm
    _rewrite_reduction(loss, bound, "sum")
    loss.meta["rp_loss"] = "token_sum"
    gm.meta["rp_loss"] = LossScale("tokens", loss_output, counter, found[2])
    gm.graph.lint()
    gm.recompile()
    return gm
