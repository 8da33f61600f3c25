"""Make a microbatched loss equal the whole batch's loss.

Note [whole-batch loss]: a mean cross-entropy over the counted tokens of each microbatch,
averaged over microbatches, is not the mean over the whole batch when the counts differ
(ignored labels spread unevenly, uneven microbatches). We rewrite the loss into its *sum*
over counted tokens and keep a small `counter` graph, read off the labels alone, that the
runtime evaluates on every microbatch before the step: the loss of the batch is
sum_m(sum_m) / sum_m(count_m), and each microbatch's backward is seeded with 1 / count.
Any other scalar loss is taken as a mean over rows and weighted by rows per microbatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .graph_utils import bind_cross_entropy, output_values


@dataclass
class LossScale:
    kind: str                                # "tokens" (sum over counted tokens) or "rows" (mean over rows)
    output: int = 0                          # which graph output is the loss
    counter: Optional[fx.GraphModule] = None  # tokens: counts one microbatch's counted tokens
    ignore_index: int = -100


def mean_cross_entropy(node: fx.Node):
    """(input, target, ignore_index) when `node` is a plain mean cross-entropy, else None."""
    bound = bind_cross_entropy(node)
    if bound is None:
        return None
    if bound["weight"] is not None or bound["size_average"] is not None or bound["reduce"] is not None:
        return None
    if bound["reduction"] != "mean" or bound["label_smoothing"] != 0.0:
        return None
    return bound["input"], bound["target"], bound["ignore_index"]


def _counter_graph(gm: fx.GraphModule, target: fx.Node, ignore_index: int) -> Optional[fx.GraphModule]:
    """A graph from the inputs to the count of targets != ignore_index; None if it needs weights."""
    needed, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.op == "placeholder" and n.meta.get("rp_kind") in ("param", "buffer"):
            return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = g.node_copy(n, lambda x: env[x])
    ne = g.call_function(torch.ne, (env[target], ignore_index))
    g.output(g.call_method("sum", (ne,)))
    return fx.GraphModule(gm, g, class_name="LossCounter")


def normalize_loss(gm: fx.GraphModule, loss_output: int = 0) -> fx.GraphModule:
    """Rewrite a mean cross-entropy loss into a token sum plus a counter graph (gm.meta['rp_loss'])."""
    loss = output_values(gm.graph)[loss_output]
    found = mean_cross_entropy(loss) if isinstance(loss, fx.Node) else None
    counter = _counter_graph(gm, found[1], found[2]) if found else None
    if counter is None:
        gm.meta["rp_loss"] = LossScale("rows", output=loss_output)
        return gm
    loss.kwargs = {**loss.kwargs, "reduction": "sum"}
    if len(loss.args) > 6:
        loss.args = loss.args[:6] + ("sum",) + loss.args[7:]
    loss.meta["rp_loss"] = "token_sum"
    gm.meta["rp_loss"] = LossScale("tokens", loss_output, counter, found[2])
    gm.graph.lint()
    gm.recompile()
    return gm
