"""Make a microbatched loss equal the whole batch's loss.

Note [whole-batch loss]: a mean cross-entropy over the counted tokens of each microbatch,
averaged over microbatches, is not the mean over the whole batch when the counts differ
(ignored labels spread unevenly, uneven microbatches). We rewrite the loss into its *sum*
over counted tokens and keep a small `counter` graph, read off the labels alone, that the
runtime evaluates on every microbatch before the step: the loss of the batch is
sum_m(sum_m) / sum_m(count_m), and each microbatch's backward is seeded with 1 / count.
With class weights the count is the weight total of the counted targets (sum of
weight[target]), which is what F.cross_entropy's mean divides by; label smoothing divides by
the same count. F.nll_loss (a log_softmax's output, or nn.NLLLoss, which dynamo traces into it)
is cross-entropy without its log_softmax: the same mean over the counted targets, the same
weight total, any ignore_index (it has no label smoothing), and it is handled as the
cross-entropy is, here and in the Notes below. A cross-entropy with reduction="sum" adds up over
microbatches as it is, and so does every other sum over rows (Note [sums over rows]). Any other
scalar loss is taken as a mean over rows and weighted by rows per microbatch.

Note [cross-entropy terms]: a loss that adds something to a mean cross-entropy or nll_loss (an
MoE's load-balancing loss: `loss = ce + coef * aux_loss`; a user's loss_fn with a regularizer) is
a mean over rows as a whole, and before this its cross-entropy part was each microbatch's token
mean weighted by rows: with ignored labels spread unevenly, gradients 4% off eager's (the
largest; Qwen3-MoE, 2 microbatches). Where the loss reaches each mean cross-entropy only
through sums, casts and products with numbers or with values of the parameters and buffers
alone (a loss weight, a learned uncertainty weight: it is affine in them), each becomes its token
*sum* times a scale the runtime gives every microbatch, 1 / (T_k * w_m) (a placeholder of kind
"loss_scale", index k: T_k the counted tokens of the whole batch, w_m the microbatch's share of
the rows, which weighs the loss output), so the cross-entropy adds up to the whole batch's
token mean and the rest of the loss to its row mean. What else the loss holds is computed per
microbatch: a whole-batch statistic (the load-balancing loss's expert fractions) is each
microbatch's, as under gradient accumulation.

Note [sums over a batch count]: transformers' losses given `num_items_in_batch` (what its
Trainer passes under gradient accumulation: the counted tokens of every accumulated batch) are
`cross_entropy(..., reduction="sum") / num_items_in_batch`, a token sum over a count that is the
same in every microbatch (a number, a 0-d tensor, or an int argument the backend made a size
placeholder: the split passes each whole). Taken as a mean over
rows, each microbatch's loss was weighted by its rows: the loss and gradients 1/M of eager's. A
sum cross-entropy the loss is affine in is a term too, its scale 1 / w_m alone (no counter): it
adds up over microbatches as it is, and the rest of the loss keeps its row mean.

Note [sums over rows]: a loss that sums over the rows of the batch (`F.mse_loss(out, y,
reduction="sum")`, `(out - y).abs().sum()`) is the sum of its microbatches' losses; taken as a
mean over rows, each microbatch's was weighted by its rows: the loss and gradients about 1/M of
eager's. Recognised where the graph says so reliably: a cross-entropy or nll_loss with
reduction="sum" (legacy size_average/reduce resolved); a torch.nn.functional loss of _ROW_LOSSES
(mse, l1, smooth_l1, huber, binary cross-entropy with or without logits, kl_div, the margin and
embedding losses, poisson/gaussian nll) with reduction="sum", or its aten op (`torch.ops.aten.
mse_loss.default(x, y, 2)`, `torch._C._nn.mse_loss`) with reduction Reduction::Sum, whose first
argument is batch-first; and a 0-d sum of every element of a batch-first value, through sums
alone (`x.sum()`, `torch.sum(x)`, `x.sum(dim=(0, 1))`, `x.sum(-1).sum()`, `x.sum(0).sum()`).
Batch-first: dim 0 of the value is a batch symbol, or one times a factor (flattened rows,
`(batch * seq, ...)`), or the rows a mask of them picks (Note [rows a mask picks]); the batch
symbols are find_batch's, read off the graph's inputs (the first input whose dim 0 is dynamic
gives the batch size). A loss that is such a sum has kind
"sum" (every microbatch weighs 1); a loss affine in one (`0.5 * mse_sum + l1_mean`, `ce_mean +
1e-3 * logits.pow(2).sum()`, `mse_sum / num_items`) scales it as a term with 1 / w_m, as Note
[sums over a batch count] does a sum cross-entropy. Not recognised, and taken as a mean over
rows as before: a sum of a value that is not batch-first (a parameter's `w.pow(2).sum()`: the
same in every microbatch, it is part of the rest of the loss), a sum divided by a size
(`x.sum() / x.shape[0]`: a row mean), a sum of anything computed after a reduction over rows
other than a sum (`x.mean(0).sum()`, `x.sum(0).pow(2).sum()`), and a loss not affine in a sum
(`sqrt(x.sum())`).

Note [sums over a sum of the data]: a loss that divides a sum over rows by a sum over rows the
data alone computes (a masked mean written out, `(loss * mask).sum() / mask.sum()`, floored with
`.clamp(min=1)` or offset by an epsilon; a sum cross-entropy over `(labels != -100).sum()`; a sum
weighed by the data's weights over their total) is the batch's numerator over the batch's
divisor. Taken as a mean over rows, each microbatch's own quotient was weighed by its rows: 0.793
for eager's 0.908 (a masked mean, 2 microbatches), silently. Such a quotient is a term (alone or
in an affine loss, over_a_sum_of_the_data): its numerator times a scale 1 / (D * w_m), D the
divisor of the whole batch: a counter graph copies the divisor's sum from the inputs (as a
cross-entropy's counter, _input_graph), the runner adds it up over the microbatches before the
step and applies the steps after it (the floor, the offset: LossScale.finishes). A divisor the
parameters compute cannot be counted before the step: with microbatches that is an InputError
naming the line (check_loss_splits); before, a mean over rows, silently. So is a loss computed
with a number read off the data (`/ mask.sum().item()`, `/ mask.nonzero().shape[0]`: each
microbatch's own, 0.793 for eager's 0.908; _numbers_of_the_data), which kept a tensor is counted.

Note [outputs over rows]: a call's output other than the loss whose dim 0 is not the rows is
computed per microbatch, and the microbatches' values are put together as over_rows says: added up
where it is a sum over rows (`h.sum(0)`, `h.abs().sum() / 4`, `-h.sum()`), weighted by rows where
it is a mean over rows (`h.mean(0)`, `h.mean((0, 1)) * 2`), and through sums, differences, signs,
casts and products with batch-free values of one kind; the largest or smallest where it is a max
or min over rows (`h.max()`, `h.amax(0)`, `-h.amin(0)`), each microbatch that reaches it sharing
its gradient (an exact tie across microbatches is split by microbatch, not by element as eager
splits it). A 0-d output of no such kind is a mean over rows, as the loss is (an MoE's
load-balancing loss: each microbatch's, as under gradient accumulation). Any other output computed
from the rows (`h.T @ h`, `h.sum(0) + 1`, `h.amax(0) + h.amax(0)`) is a CaptureError with more
than one microbatch; one computed from no row (from parameters, or from a size of the batch alone:
reads_the_batch follows tensors) is the same in every microbatch, and the first microbatch's is
returned (its gradient seeded there alone). Before, only a bare 0-d sum added up: `h.sum(0)`,
`h.mean(0)` and `h.amax(0)` came back as the first microbatch's value and `-h.sum()`, `h.max()` as
means, silently, and only the first microbatch's rows got a gradient from such an output.

Every spelling of the call is handled: `F.cross_entropy(x, y, ...)` and `F.nll_loss(x, y, ...)`
with any of their arguments positional or by keyword, and the `nn.CrossEntropyLoss(weight=...,
ignore_index=..., reduction=..., label_smoothing=...)` and `nn.NLLLoss(...)` modules, which
dynamo traces into those calls (the legacy size_average/reduce arguments are resolved into a
reduction).
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..errors import InputError
from .batch import ARITHMETIC, BatchInfo, find_batch, model_line
from .cost import storage_key
from .graph_utils import (bind_call, bind_cross_entropy, graph_module, is_impure, mutated_values, node_value,
                          op_name, output_values, scalar_outputs)


@dataclass
class LossScale:
    kind: str                                # "tokens" (sum over counted tokens), "sum" (a sum: add
                                             # microbatches as they are) or "rows" (mean over rows)
    output: int = 0                          # which graph output is the loss
    counter: Optional[fx.GraphModule] = None  # tokens: counts one microbatch's counted tokens
    ignore_index: int = -100
    terms: tuple = ()                        # rows: the counter of each cross-entropy term's scale
                                             # placeholder (Note [cross-entropy terms]); None for a
                                             # sum term (Note [sums over a batch count])
    finishes: tuple = ()                     # rows: per term, what makes its counters' total the
                                             # term's divisor (`.clamp(min=1)`), or None (Note [sums
                                             # over a sum of the data])
    uncounted: tuple = ()                    # the model's lines of quotients over a sum of rows the
                                             # parameters compute: no microbatches (check_loss_splits)
    numbers: tuple = ()                      # the model's lines where the loss computes with a number
                                             # the data decides: no microbatches (check_loss_splits)
    picked: tuple = ()                       # the model's lines of means over rows a mask picks that
                                             # cannot be counted: no microbatches (Note [rows a mask picks])


_NLL_LOSS = inspect.signature(F.nll_loss)


def bind_class_loss(node: fx.Node):
    """The arguments of an `F.cross_entropy` or `F.nll_loss` node by name, defaults filled in
    (an nll_loss has no label_smoothing); None for other nodes or calls that do not bind
    (Note [cross-entropy terms]: nll_loss is cross-entropy without its log_softmax)."""
    bound = bind_cross_entropy(node)
    return bound if bound is not None else bind_call(node, F.nll_loss, _NLL_LOSS)


def cross_entropy_reduction(bound: dict) -> Optional[str]:
    """The reduction a bound cross-entropy (or nll_loss) call applies ("mean", "sum" or "none"),
    legacy size_average/reduce resolved as F.cross_entropy resolves them; None when not a
    constant."""
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
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
    """(input, target, ignore_index) when `node` is a mean cross-entropy or nll_loss over class
    indices (with or without class weights and label smoothing), else None."""
    bound = bind_class_loss(node)
    if bound is None or cross_entropy_reduction(bound) != "mean" or not _class_targets(bound):
        return None
    if not isinstance(bound["ignore_index"], int):
        return None
    return bound["input"], bound["target"], bound["ignore_index"]


def flat_loss_output(gm: fx.GraphModule) -> Optional[int]:
    """The loss among a dynamo backend's flat outputs (no `loss` field to read): a mean
    cross-entropy output; else the first scalar output with a cross-entropy term (an MoE's `ce +
    coef * aux`, Note [cross-entropy terms]); else the one scalar output, as loss_leaf_index takes
    a call's. (Weighed as a mean over rows instead, a sum over rows was half of eager's at 2
    microbatches, and an MoE's loss with ignored labels 0.016 off.)"""
    outs = output_values(gm.graph)
    found = next((i for i, v in enumerate(outs) if isinstance(v, fx.Node) and mean_cross_entropy(v)), None)
    if found is not None:
        return found
    scalars, batch = scalar_outputs(gm.graph), find_batch(gm, None)
    with_terms = [i for i in scalars if any(bind_class_loss(t) for t in _affine_terms(outs[i], outs[i], batch))]
    return with_terms[0] if with_terms else scalars[0] if len(scalars) == 1 else None


def _ancestors(node: fx.Node) -> set:
    """`node` and every node it is computed from."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


# Note [targets filled in place]: ProphetNet builds its n-gram targets as
# `t = labels.new_zeros(ngram, B, S).fill_(-100)`, then `t[i, :, :] = labels` for each stream.
# The writes are users of t, not ancestors of the target the loss reads (`t.view(-1)`): the
# counter copied the fill alone, counted no token, and the loss was the token sum over 0, NaN
# (eager's 4.86). So the counter copies, with the target's ancestors, every in-place node before
# the loss that writes into a storage one of them holds (and that node's ancestors).
def _ancestors_with_updates(gm: fx.GraphModule, node: fx.Node, reader: fx.Node) -> set:
    """_ancestors(node) and the in-place updates of their values made before `reader` (Note
    [targets filled in place])."""
    needed = _ancestors(node)
    before = []
    for n in gm.graph.nodes:
        if n is reader:
            break
        if is_impure(n) and n.op not in ("placeholder", "output"):
            before.append(n)
    grew = True
    while grew:
        grew = False
        storages = {storage_key(v) for v in map(node_value, needed) if isinstance(v, torch.Tensor)}
        for n in before:
            written = [node_value(m) for m in mutated_values(n)]
            if n not in needed and any(isinstance(v, torch.Tensor) and storage_key(v) in storages for v in written):
                needed |= _ancestors(n)
                grew = True
    return needed


def _counter_graph(gm: fx.GraphModule, target: fx.Node, ignore_index: int, weight,
                   classes: Optional[int] = None, what: str = "cross_entropy",
                   reader: Optional[fx.Node] = None) -> Optional[fx.GraphModule]:
    """A graph from the inputs to the count of targets != ignore_index, or with class weights
    to the weight total of those targets; None if the targets depend on parameters or buffers
    (the weight may be a buffer or parameter: the runtime passes the host tensor). It refuses a
    counted target outside [0, classes), as F.cross_entropy does (a vocabulary-split head would
    otherwise give a finite, wrong loss); it runs on the host before the step's jobs. `reader`:
    the loss node that reads the target (what was written into it before counts)."""
    made = _input_graph(gm, target, reader, weight)
    if made is None:
        return None
    g, env = made
    counted = g.call_function(torch.ne, (env[target], ignore_index))
    if classes is not None:
        outside = g.call_function(torch.logical_or, (g.call_function(torch.lt, (env[target], 0)),
                                                     g.call_function(torch.ge, (env[target], classes))))
        bad = g.call_function(torch.any, (g.call_function(torch.logical_and, (counted, outside)),))
        g.call_function(torch._assert_async, (g.call_function(torch.logical_not, (bad,)),
                                              f"{what}: a target is out of bounds: not in [0, {classes}) and "
                                              f"not ignore_index {ignore_index}"))
    if weight is None:
        g.output(g.call_method("sum", (counted,)))
    else:
        w = env[weight] if isinstance(weight, fx.Node) else weight
        labels = g.call_function(torch.Tensor.__getitem__, (env[target], counted))
        picked = g.call_function(torch.Tensor.__getitem__, (w, labels))
        g.output(g.call_method("sum", (g.call_method("double", (picked,)),)))
    return graph_module(gm, g, "LossCounter")


def _input_graph(gm: fx.GraphModule, value: fx.Node, reader: Optional[fx.Node], weight=None):
    """(graph, env): a graph of the inputs that computes `value` (env maps gm's nodes to its),
    with the in-place updates before `reader`; None where `value` depends on parameters or
    buffers (`weight`, a node that may be one, joins it)."""
    needed = _ancestors(value) if reader is None else _ancestors_with_updates(gm, value, reader)
    if any(n.op == "placeholder" and n.meta.get("rp_kind") in ("param", "buffer") for n in needed):
        return None
    if isinstance(weight, fx.Node):
        needed |= _ancestors(weight)
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        if n in needed and n.op == "placeholder":
            env[n] = g.node_copy(n, lambda x: env[x])
    # an input the model writes into (`labels.masked_fill_(...)`) is written in a clone: the
    # counter runs on the caller's batch, which the stage jobs read afterwards
    written = {storage_key(node_value(m)) for n in needed if n.op != "placeholder" and is_impure(n)
               for m in mutated_values(n) if isinstance(node_value(m), torch.Tensor)}
    for n in list(env):
        if isinstance(node_value(n), torch.Tensor) and storage_key(node_value(n)) in written:
            env[n] = g.call_method("clone", (env[n],))
    for n in gm.graph.nodes:
        if n in needed and n.op != "placeholder":
            env[n] = g.node_copy(n, lambda x: env[x])
    return g, env


def _classes(logits: fx.Node) -> Optional[int]:
    """The class count of cross-entropy logits ((N, C, ...) or (C,)), when it is static."""
    ev = logits.meta.get("example_value") if isinstance(logits, fx.Node) else None
    if not isinstance(ev, torch.Tensor) or ev.dim() == 0:
        return None
    c = ev.shape[1] if ev.dim() >= 2 else ev.shape[0]
    return c if isinstance(c, int) else None


def _loss_name(node: fx.Node) -> str:
    return "nll_loss" if node.target is F.nll_loss else "cross_entropy"


def _rewrite_reduction(node: fx.Node, bound: dict, reduction: str) -> None:
    """Rewrite a cross-entropy (nll_loss) call as F.cross_entropy(input, target, **named)
    (F.nll_loss(...)) with `reduction`."""
    named = {k: v for k, v in bound.items() if k not in ("input", "target", "size_average", "reduce")}
    named["reduction"] = reduction
    node.args = (bound["input"], bound["target"])
    node.kwargs = named


def normalize_loss(gm: fx.GraphModule, loss_output: int = 0) -> fx.GraphModule:
    """Rewrite a mean cross-entropy (nll_loss) into a token sum plus a counter graph, recognise a
    sum over rows, or scale a loss's terms (gm.meta['rp_loss'])."""
    loss = output_values(gm.graph)[loss_output]
    bound = bind_class_loss(loss) if isinstance(loss, fx.Node) else None
    reduction = cross_entropy_reduction(bound) if bound is not None else None
    if reduction == "sum":
        _rewrite_reduction(loss, bound, "sum")    # legacy arguments resolved, for split_lm_head
        gm.meta["rp_loss"] = LossScale("sum", output=loss_output)
        gm.graph.lint()
        gm.recompile()
        return gm
    batch = find_batch(gm, None)
    if bound is None and isinstance(loss, fx.Node) and sum_over_rows(loss, batch):
        gm.meta["rp_loss"] = LossScale("sum", output=loss_output)      # Note [sums over rows]
        return gm
    found = mean_cross_entropy(loss) if bound is not None else None
    weight = bound["weight"] if found else None
    counter = (_counter_graph(gm, found[1], found[2], weight, _classes(found[0]), _loss_name(loss), reader=loss)
               if found else None)
    if counter is None:
        terms, finishes, uncounted, picked = _scale_terms(gm, loss, batch)
        gm.meta["rp_loss"] = LossScale("rows", output=loss_output, terms=terms, finishes=finishes,
                                       uncounted=uncounted, numbers=_numbers_of_the_data(loss, batch),
                                       picked=picked or _picked_means(loss, batch))
        return gm
    _rewrite_reduction(loss, bound, "sum")
    loss.meta["rp_loss"] = "token_sum"
    gm.meta["rp_loss"] = LossScale("tokens", loss_output, counter, found[2])
    gm.graph.lint()
    gm.recompile()
    return gm


# Losses (torch.nn.functional's, and aten's of these names) whose reduction="sum" adds up a loss
# per row (dim 0 of their first argument) and whatever it holds per element (Note [sums over
# rows]); ctc_loss, batched in dim 1, is not one. (F.cross_entropy and F.nll_loss are read by
# bind_class_loss first.)
_ROW_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
               "binary_cross_entropy_with_logits", "soft_margin_loss", "multilabel_soft_margin_loss",
               "multilabel_margin_loss", "multi_margin_loss", "hinge_embedding_loss", "margin_ranking_loss",
               "cosine_embedding_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
               "poisson_nll_loss", "gaussian_nll_loss", "kl_div", "nll_loss", "cross_entropy_loss")
_FUNCTIONAL_LOSSES = {getattr(F, name): inspect.signature(getattr(F, name)) for name in _ROW_LOSSES
                      if hasattr(F, name)}
_SUM_REDUCTION = 2                       # at::Reduction::Sum, the `reduction` of an aten loss op


def _aten_loss(target):
    """The aten overload of a loss op among _ROW_LOSSES (`torch.ops.aten.mse_loss.default`,
    `torch.ops.aten.mse_loss`, `torch._C._nn.mse_loss`, `torch.binary_cross_entropy_with_logits`),
    else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    if isinstance(target, torch._ops.OpOverload):
        return target if target.namespace == "aten" and target._schema.name.split("::")[-1] in _ROW_LOSSES else None
    name = getattr(target, "__name__", None)
    if name in _ROW_LOSSES and target in (getattr(torch._C._nn, name, None), getattr(torch, name, None)):
        packet = getattr(torch.ops.aten, name, None)
        return getattr(packet, "default", None)
    return None


def _loss_call_sums(node: fx.Node):
    """The first argument of a loss call (torch.nn.functional or aten) with reduction="sum",
    legacy size_average/reduce resolved; None for any other node."""
    if node.op != "call_function":
        return None
    sig = _FUNCTIONAL_LOSSES.get(node.target)
    if sig is not None:
        args = bind_call(node, node.target, sig)
        if args is None:
            return None
        if args.get("size_average") is not None or args.get("reduce") is not None:
            try:
                reduction = torch.nn._reduction.legacy_get_string(args["size_average"], args["reduce"],
                                                                  emit_warning=False)
            except Exception:
                return None
        else:
            reduction = args.get("reduction")
        return next(iter(args.values())) if reduction == "sum" else None
    op = _aten_loss(node.target)
    if op is None:
        return None
    names = [a.name for a in op._schema.arguments]
    if "reduction" not in names or not node.args:
        return None
    i = names.index("reduction")
    default = op._schema.arguments[i].default_value
    reduction = node.kwargs.get("reduction", node.args[i] if len(node.args) > i else default)
    return node.args[0] if reduction == _SUM_REDUCTION else None


_SUM_FUNCTIONS = {torch.sum, torch.Tensor.sum, torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList}
_MEAN_FUNCTIONS = {torch.mean, torch.Tensor.mean, torch.ops.aten.mean.default, torch.ops.aten.mean.dim}


def _summed(node: fx.Node, method: str = "sum", functions=_SUM_FUNCTIONS):
    """(x, dims) when `node` sums x (dims None: every element; else a tuple of ints), else None;
    with method "mean" and _MEAN_FUNCTIONS, when it takes x's mean."""
    if (node.op == "call_method" and node.target == method) or (node.op == "call_function"
                                                               and node.target in functions):
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None:
            return node.args[0], None
        dims = (dim,) if isinstance(dim, int) else dim
        if isinstance(dims, (tuple, list)) and dims and all(isinstance(d, int) for d in dims):
            return node.args[0], tuple(dims)
    return None


def _value(node) -> Optional[torch.Tensor]:
    """A node's fake tensor (node_value), or None: a constant argument, a value that is not a tensor."""
    ev = node_value(node) if isinstance(node, fx.Node) else None
    return ev if isinstance(ev, torch.Tensor) else None


def _rows_first(node, batch: BatchInfo, picked: bool = True) -> bool:
    """Dim 0 of `node`'s value is the batch's rows (a batch symbol, one times a factor, the rows of
    batched values one after another or a half of them: BatchInfo.whole_rows), or, `picked`, the
    rows (entries) a mask of them picks (Note [rows a mask picks])."""
    ev = _value(node)
    return ev is not None and ev.dim() >= 1 and (batch.whole_rows(ev.shape[0])
                                                 or (picked and picked_by(node, batch) is not None))


def _reduces_rows(x, dims, batch: BatchInfo, picked: bool = True) -> bool:
    """A reduction of x over `dims` (None: every element) reduces its rows: x is batch-first and
    dims include dim 0."""
    return _rows_first(x, batch, picked) and (dims is None or 0 in [d % _value(x).dim() for d in dims])


# Note [rows a mask picks]: a value of the rows (or entries) a mask of the batch's rows picks
# (`h[mask]`, `h[mask.nonzero()[:, 0]]`, a size the data decides) holds each microbatch's picks
# one after another, as a batch-first value holds its rows: a sum over it (`(h[m] - y[m]).pow(2)
# .sum()`, `F.mse_loss(h[m], y[m], reduction="sum")`) is a sum over rows (Note [sums over rows]),
# where before it was taken as a mean over rows (the loss and gradients 1/2 of eager's over 2
# microbatches, silently). A mean over it (`F.mse_loss(h[m], y[m])`, `.mean()`, l1, huber,
# binary cross-entropy) divides by the picks of the whole batch, not the microbatch's (0.793 for
# eager's 0.908): where the mask is the data's (read off the inputs alone) and each pick holds a
# fixed number of entries, it becomes its sum over the mask's count times that number, counted
# over the whole batch before the step as Note [sums over a sum of the data] counts a divisor;
# a KL divergence's batchmean over picked rows (distillation on the answer's tokens,
# `F.kl_div(lp[m], q[m], reduction="batchmean")`: refused before) divides by dim 0 alone, the
# count times the entries of one pick that dim 0 holds, and so does a sum of a mean over dim 0
# (`x[m].mean(0).sum()`). Any other mean over picked rows (a mask the model computes) is an
# InputError with microbatches.
def picked_by(node, batch: BatchInfo) -> Optional[tuple]:
    """(mask, entries) where dim 0 of `node`'s value counts the true entries of a batch-first mask,
    picked by it (`h[mask]`, `torch.masked_select(h, mask)`) or at their positions
    (`mask.nonzero()`), and `entries` of the value are one true entry's (None where that is not
    a number: a size of the sequence); else None."""
    ev = _value(node)
    if ev is None or ev.dim() == 0 or not isinstance(ev.shape[0], torch.SymInt) or not free_unbacked_symbols(
            ev.shape[0]):
        return None
    expr, n = ev.shape[0].node.expr, node
    while True:       # (up through the values of the same dim 0, a tuple's too, to the node that made it)
        same = [a for a in n.all_input_nodes if any(
            t.dim() >= 1 and isinstance(t.shape[0], torch.SymInt) and t.shape[0].node.expr == expr
            for t in torch.utils._pytree.tree_leaves(node_value(a)) if isinstance(t, torch.Tensor))]
        if not same:
            break
        n = same[0]
    entries = ev.shape[1:].numel()
    entries = entries if isinstance(entries, int) else None
    positions = op_name(n) in ("nonzero", "argwhere") or (op_name(n) == "where" and len(n.args) == 1 and not n.kwargs)
    if positions and n.args and _rows_first(n.args[0], batch, picked=False):     # (`torch.where(mask)[0]` too)
        return n.args[0], entries
    if op_name(n) == "masked_select" and len(n.args) == 2 and _rows_first(n.args[0], batch, picked=False):
        x, mask = map(_value, n.args)
        return n.args[1], _broadcast_entries(x.shape, mask.shape)
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2:
        x, key = n.args
        key = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        k = _value(key)
        if k is not None and k.dtype == torch.bool and _rows_first(x, batch, picked=False) and _rows_first(
                key, batch, picked=False):
            return key, entries
    return None


def _broadcast_entries(shape, mask_shape) -> Optional[int]:
    """How many entries of a value of `shape` one entry of a mask broadcast to it covers (a mask of
    rows over (rows, 4): 4), or None where a size is not a number. Read off the sizes without
    comparing symbols (a comparison would guard the capture's shapes)."""
    covered = 1
    for i, d in enumerate(reversed(shape)):
        m = mask_shape[-1 - i] if i < len(mask_shape) else 1
        if type(m) is int and m == 1 and not (type(d) is int and d == 1):
            if type(d) is not int:
                return None
            covered *= d
    return covered


_ELEMENTWISE_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                       "binary_cross_entropy_with_logits", "soft_margin_loss")


def _mean_loss_call(node: fx.Node, names=_ELEMENTWISE_LOSSES, reduction: str = "mean"):
    """(first argument, bound arguments) of a torch.nn.functional elementwise loss call with
    reduction="mean" (legacy arguments unset), or of another of `names` with `reduction`, else None."""
    sig = _FUNCTIONAL_LOSSES.get(node.target) if node.op == "call_function" else None
    if sig is None or node.target.__name__ not in names:
        return None
    args = bind_call(node, node.target, sig)
    if args is None or args.get("size_average") is not None or args.get("reduce") is not None:
        return None
    return (next(iter(args.values())), args) if args.get("reduction") == reduction else None


def _batchmean(node: fx.Node):
    """_mean_loss_call of `F.kl_div(..., reduction="batchmean")`: a sum over dim 0's size."""
    return _mean_loss_call(node, ("kl_div",), "batchmean")


def _summed_row_mean(node: fx.Node) -> Optional[fx.Node]:
    """x where `node` sums every element of x's mean over dim 0 (`x.mean(0).sum()`: a sum over dim
    0's size), neither keeping dims nor casting; else None."""
    summed = _summed(node)
    if summed is None or summed[1] is not None or len(node.args) > 1 or node.kwargs:
        return None
    meaned = _summed(summed[0], "mean", _MEAN_FUNCTIONS)
    x = _value(meaned[0]) if meaned is not None else None
    if (x is None or meaned[1] is None or len(meaned[1]) != 1 or meaned[1][0] % x.dim() != 0
            or len(summed[0].args) > 2 or summed[0].kwargs.keys() - {"dim"}):
        return None
    return meaned[0]


def mean_over_picked(node: fx.Node, batch: BatchInfo) -> Optional[tuple]:
    """(mask, entries) where `node` takes a mean over a value holding rows a mask picks (picked_by)
    and divides by `entries` for each true entry of the mask: a mean of every element (`x.mean()`,
    `torch.mean(x)`, an elementwise loss with reduction="mean"), or over dim 0 (a KL divergence's
    batchmean, `x.mean(0).sum()`); else None (Note [rows a mask picks])."""
    meaned = _summed(node, "mean", _MEAN_FUNCTIONS)
    if meaned is not None and (len(node.args) > 2 or node.kwargs.keys() - {"dim"}):
        meaned = None       # (keepdim, a dtype: not rewritten; _picked_means refuses it)
    if meaned is not None and meaned[1] is not None:
        x = _value(meaned[0])
        meaned = (meaned[0], None) if x is not None and sorted(d % x.dim() for d in meaned[1]) == list(
            range(x.dim())) else None
    value = meaned[0] if meaned is not None else (_mean_loss_call(node) or (None,))[0]
    over_rows = None if value is not None else _summed_row_mean(node) or (_batchmean(node) or (None,))[0]
    value = over_rows if over_rows is not None else value
    picked = picked_by(value, batch) if isinstance(value, fx.Node) else None
    if picked is None or over_rows is None:
        return picked
    mask, entries = picked        # (dim 0 holds entries / rest of them for each true entry)
    rest = _value(value).shape[1:].numel()
    return mask, entries // rest if isinstance(entries, int) and isinstance(rest, int) else None


def _sum_instead(node: fx.Node) -> Optional[fx.Node]:
    """A node before `node` (mean_over_picked) that sums the elements it takes the mean of; None
    where it cannot."""
    graph = node.graph
    with graph.inserting_before(node):
        if (x := _summed_row_mean(node)) is not None:
            made = graph.call_function(torch.sum, (x,))
        elif node.op == "call_method":
            made = graph.call_method("sum", node.args[:1])
        elif node.target in (torch.mean, torch.Tensor.mean):
            made = graph.call_function(torch.sum, node.args[:1])
        elif (call := _mean_loss_call(node) or _batchmean(node)) is not None:
            made = graph.call_function(node.target, (), {
                **{k: v for k, v in call[1].items() if k not in ("size_average", "reduce")}, "reduction": "sum"})
        else:
            return None
    made.meta.update(node.meta)        # (a 0-d value of the mean's dtype, its line)
    return made


def _picked_means(loss: fx.Node, batch: BatchInfo) -> tuple:
    """The model's lines where `loss` reads a mean over rows a mask picks that is not counted
    (Note [rows a mask picks]): any mean or mean-reduced loss over such rows left."""
    lines = []
    for n in _ancestors(loss):
        meaned = _summed(n, "mean", _MEAN_FUNCTIONS)
        first = meaned[0] if meaned is not None else (_mean_loss_call(n) or (None,))[0]
        if first is None and n.op == "call_function" and (sig := _FUNCTIONAL_LOSSES.get(n.target)) is not None:
            args = bind_call(n, n.target, sig)        # (kl_div's batchmean, a legacy size_average)
            first = next(iter(args.values())) if args and args.get("reduction") != "sum" else None
        if isinstance(first, fx.Node) and picked_by(first, batch) is not None and (
                meaned is None or _reduces_rows(*meaned, batch)):
            lines.append(model_line(n))
    return tuple(lines)


def _sums_rows(node: fx.Node, batch: BatchInfo) -> bool:
    """`node` sums over the rows of the batch: a sum over dims including dim 0 of a value whose
    dim 0 is the rows, or a sum of such a sum."""
    summed = _summed(node)
    if summed is None or _value(summed[0]) is None:
        return False
    return _reduces_rows(*summed, batch) or _sums_rows(summed[0], batch)


def sum_over_rows(node: fx.Node, batch: BatchInfo) -> bool:
    """`node` is a 0-d sum over the rows of the batch (Note [sums over rows]): a loss call with
    reduction="sum" whose first argument is batch-first (a cross-entropy or nll_loss with it
    whatever its input), or a sum of every element of a batch-first value (through sums only:
    `x.sum()`, `torch.sum(x)`, `x.sum(-1).sum()`, `x.sum(0).sum()`)."""
    bound = bind_class_loss(node)
    if bound is not None:
        return cross_entropy_reduction(bound) == "sum"
    ev = _value(node)
    if ev is None or ev.dim() != 0:
        return False
    first = _loss_call_sums(node)
    if first is not None:
        return _rows_first(first, batch)
    return _sums_rows(node, batch)


# ops through which a loss stays affine in a term: x + y, x - y, -x, x * c, x / c (c a number
# or computed from parameters and buffers alone: _batch_free)
_SUMS = {operator.add, operator.iadd, torch.add, operator.sub, operator.isub, torch.sub}
_SCALES = {operator.mul, operator.imul, torch.mul, operator.truediv, operator.itruediv, torch.div}
_SIGNS = {operator.neg, torch.neg}
_METHODS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg,
            "to": "cast", "float": "cast", "double": "cast", "type": "cast"}


def _whole(placeholder: fx.Node) -> bool:
    """A parameter, a buffer, a 0-d tensor input, or a size argument (an int argument through the
    backend, dynamic=True: no tensor's dimension) the microbatch split passes whole. A sum over
    rows divided by such an int argument was taken as a mean over rows (1/M of eager's loss)."""
    ev = placeholder.meta.get("example_value")
    return (placeholder.meta.get("rp_kind") in ("param", "buffer") or (isinstance(ev, torch.Tensor) and ev.dim() == 0)
            or (placeholder.meta.get("rp_kind") == "sym" and "rp_arg_index" in placeholder.meta))


def _batch_free(value) -> bool:
    """A number, or a node computed from parameters, buffers, 0-d inputs and constants alone: the
    same in every microbatch of a step (a loss weight, a learned log-variance, a batch's token
    count), so a product with it keeps the loss affine in a term. Not a size (rows per
    microbatch differ)."""
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float))
    return all(n.op != "placeholder" or _whole(n) for n in _ancestors(value))


def _scaled(t, args):
    """(value, scale) of a product or quotient `t(*args)` by a batch-free scale (_batch_free: a
    divisor, or either factor), else None."""
    if t not in _SCALES or len(args) != 2:
        return None
    if _batch_free(args[1]):
        return args[0], args[1]
    if t not in (operator.truediv, operator.itruediv, torch.div) and _batch_free(args[0]):
        return args[1], args[0]
    return None


def _affine_terms(node: fx.Node, loss: fx.Node, batch: BatchInfo) -> list:
    """The mean cross-entropies (nll_losses) and the sums over rows `loss` is an affine function
    of through `node` (Note [cross-entropy terms], Note [sums over a batch count], Note [sums
    over rows]), each with one user; every node between them and the loss too."""
    if node is not loss and len(node.users) != 1:
        return []
    if mean_cross_entropy(node) is not None or sum_over_rows(node, batch):
        return [node] if node is not loss else []
    if over_a_sum_of_the_data(node, batch) is not None or mean_over_picked(node, batch) is not None:
        return [node]          # (the loss itself too: Note [sums over a sum of the data], [rows a mask picks])
    t, args = (_METHODS.get(node.target) if node.op == "call_method" else node.target), node.args
    if node.op not in ("call_function", "call_method") or node.kwargs.get("alpha", 1) != 1:
        return []
    if t in _SUMS or t in _SIGNS or t == "cast":
        operands = args if t in _SUMS else args[:1]
    elif (scaled := _scaled(t, args)) is not None:
        operands = scaled[:1]
    else:
        return []
    return [ce for a in operands if isinstance(a, fx.Node) for ce in _affine_terms(a, loss, batch)]


_DIVIDES = {operator.truediv, operator.itruediv, torch.div, torch.true_divide}
# the steps a divisor may take from a sum of the data: a floor, an offset, a cast (numbers beside it)
_FINISHING = {"clamp", "clamp_min", "add", "float", "double", "to", "type", "type_as", "__add__", "__radd__",
              torch.clamp, torch.clamp_min, torch.add, operator.add}


def over_a_sum_of_the_data(node: fx.Node, batch: BatchInfo) -> Optional[tuple]:
    """(numerator, sum, steps) where `node` is a sum over rows (over_rows: also scaled, negated,
    added up) divided by another, or by one floored, offset or cast (`(loss * mask).sum() /
    mask.sum().clamp(min=1)`): the steps from that sum to the divisor, in order; else None (Note
    [sums over a sum of the data]; _scale_terms takes the divisor where the data alone makes it)."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs:
        return None
    t = _METHODS.get(node.target) if node.op == "call_method" else node.target
    numerator, divisor = node.args
    if t not in _DIVIDES or not isinstance(numerator, fx.Node) or not isinstance(divisor, fx.Node):
        return None
    if over_rows(numerator, batch) != "sum":
        return None
    steps = []
    while over_rows(divisor, batch) != "sum":
        name = divisor.target if divisor.op in ("call_method", "call_function") else None
        chained = [a for a in (*divisor.args, *divisor.kwargs.values()) if isinstance(a, fx.Node)]
        if name == "type_as":           # (a cast to another value's dtype)
            chained = chained[:1]
        if name not in _FINISHING or len(chained) != 1:
            return None
        steps.append(divisor)
        divisor = chained[0]
    return numerator, divisor, steps[::-1]


def _divisor_graph(gm: fx.GraphModule, steps: list) -> Optional[fx.GraphModule]:
    """A graph from the counters' total to the divisor (`total.clamp(min=1)`), or None without steps."""
    if not steps:
        return None
    g = fx.Graph()
    first = steps[0]
    chained = next(a for a in (*first.args, *first.kwargs.values()) if isinstance(a, fx.Node))
    env = {chained: g.placeholder("total")}
    for n in steps:
        env[n] = (g.call_method("to", (env[n.args[0]], node_value(n.args[1]).dtype)) if n.target == "type_as"
                  else g.node_copy(n, lambda x: env[x]))
    g.output(env[steps[-1]])
    return graph_module(gm, g, "LossDivisor")


def _means_rows(node: fx.Node, batch: BatchInfo) -> bool:
    """`node` is a mean over dims including dim 0 of a value whose dim 0 is the rows."""
    meaned = _summed(node, "mean", _MEAN_FUNCTIONS)
    return meaned is not None and _reduces_rows(*meaned, batch, picked=False)    # (Note [rows a mask picks])


_EXTREMES = {"max": "max", "amax": "max", "min": "min", "amin": "min", torch.max: "max", torch.amax: "max",
             torch.min: "min", torch.amin: "min"}
_FLIPPED = {"max": "min", "min": "max"}      # an extreme negated


def _extreme_over_rows(node: fx.Node, batch: BatchInfo) -> Optional[str]:
    """"max" or "min" where `node` is one over dims including dim 0 of a batch-first value: `h.max()`,
    `h.amax(0)`, `torch.amin(h, dim=(0, 1))` (not `h.max(0)`, values and indices)."""
    kind = _EXTREMES.get(node.target) if node.op in ("call_method", "call_function") else None
    if kind is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target in ("max", "min", torch.max, torch.min):
        return kind if len(node.args) == 1 and not node.kwargs and _reduces_rows(node.args[0], None, batch) else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", ())
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return kind if _reduces_rows(node.args[0], dims or None, batch) else None      # (dims (): every element)


def over_rows(node, batch: BatchInfo) -> Optional[str]:
    """How a call's output that is not batch-first puts together from its microbatches' values
    (Note [outputs over rows]): "sum" where it is their sum (a sum over rows, Note [sums over
    rows]), "mean" where it is their mean weighted by rows (a mean over dims including dim 0 of
    a batch-first value), each also negated, cast, scaled by a batch-free value, or a sum or
    difference of two of one kind; "max" or "min" where it is their largest or smallest (also
    cast, or negated or scaled by a number: by a negative one, the other); None for anything else."""
    if not isinstance(node, fx.Node):
        return None
    if sum_over_rows(node, batch) or _sums_rows(node, batch):
        return "sum"
    if _means_rows(node, batch):
        return "mean"
    extreme = _extreme_over_rows(node, batch)
    if extreme is not None:
        return extreme
    if node.op not in ("call_function", "call_method") or node.kwargs.get("alpha", 1) != 1:
        return None
    t, args = (_METHODS.get(node.target) if node.op == "call_method" else node.target), node.args
    if t in _SUMS:
        kinds = {over_rows(a, batch) for a in args}
        kind = kinds.pop() if len(args) == 2 and len(kinds) == 1 else None
        return kind if kind in ("sum", "mean") else None
    if t == "cast":
        return over_rows(args[0], batch)
    if t in _SIGNS:
        kind = over_rows(args[0], batch)
        return _FLIPPED.get(kind, kind)
    scaled = _scaled(t, args)
    if scaled is None:
        return None
    value, by = scaled
    kind = over_rows(value, batch)
    if kind in _FLIPPED:      # (a negative number turns a max into a min)
        if not isinstance(by, (int, float)) or by == 0:
            return None
        return kind if by > 0 else _FLIPPED[kind]
    return kind


def reads_the_batch(node, batch: BatchInfo) -> bool:
    """Whether `node`'s values are computed from a batched input's (Note [outputs over rows]);
    through tensors only: a size read off one (position ids of the sequence's length) is none."""
    seen, stack = set(), [node] if isinstance(node, fx.Node) else []
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(_value(n), torch.Tensor):
            continue
        seen.add(n)
        if n.op == "placeholder" and n.meta.get("rp_kind") == "input" and n.meta.get("rp_index") in batch.leaves:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _scale_terms(gm: fx.GraphModule, loss, batch: BatchInfo) -> tuple:
    """Rewrite each mean cross-entropy (nll_loss) term of `loss` into its token sum times a scale
    placeholder (Note [cross-entropy terms]), each sum over a sum of the data into its numerator
    times one (Note [sums over a sum of the data]), and scale each sum term (Note [sums over a
    batch count], Note [sums over rows]); (counters, finishes, uncounted): the counters of the
    scales (None for a sum's) and what makes each one's total its divisor (None: the total), in
    placeholder order, and the lines of quotients whose divisor the parameters compute."""
    if not isinstance(loss, fx.Node):
        return (), (), ()
    counters, finishes, uncounted, picked_lines = [], [], [], []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for ce in _affine_terms(loss, loss, batch):
        bound = bind_class_loss(ce)
        ratio = over_a_sum_of_the_data(ce, batch)
        finish, base = None, ce
        picked = mean_over_picked(ce, batch) if ratio is None and bound is None else None
        if picked is not None:      # its sum times 1 / (the picks' total * w_m): Note [rows a mask picks]
            mask, per_pick = picked
            made = _input_graph(gm, mask, ce) if per_pick is not None else None
            base = _sum_instead(ce) if made is not None else None
            if base is None:
                picked_lines.append(model_line(ce))
                continue
            g, env = made
            count = g.call_method("sum", (g.call_method("ne", (env[mask], 0)),))
            g.output(g.call_method("mul", (g.call_method("double", (count,)), per_pick)))
            counter = graph_module(gm, g, "LossCounter")
        elif ratio is not None:       # its numerator times 1 / (the divisor's total * w_m)
            made = _input_graph(gm, ratio[1], ce)
            if made is None:        # (a divisor of the parameters: not a count of the data)
                uncounted.append(model_line(ce))
                continue
            g, env = made
            g.output(g.call_method("double", (env[ratio[1]],)))
            counter, finish, base = graph_module(gm, g, "LossCounter"), _divisor_graph(gm, ratio[2]), ratio[0]
            bound = None
        elif bound is None or cross_entropy_reduction(bound) == "sum":
            counter = None          # scale 1 / w_m: added up as it is (Note [sums over a batch count])
        else:
            counter = _counter_graph(gm, bound["target"], bound["ignore_index"], bound["weight"],
                                     _classes(bound["input"]), _loss_name(ce), reader=ce)
            if counter is None:
                continue
        value = ce.meta.get("example_value")
        with gm.graph.inserting_after(last):
            last = scale = gm.graph.placeholder(f"loss_scale_{len(counters)}")
        scale.meta.update(rp_kind="loss_scale", rp_index=len(counters))
        if bound is not None:
            _rewrite_reduction(ce, bound, "sum")
            ce.meta["rp_loss"] = "token_sum"
        with (gm.graph.inserting_after(ce) if base is ce else gm.graph.inserting_before(ce)):
            scaled = product = gm.graph.call_function(operator.mul, (base, scale))
        if isinstance(value, torch.Tensor):
            scale.meta["example_value"] = torch.empty_like(value, dtype=torch.float32)
            product_dtype = torch.promote_types(value.dtype, torch.float32)
            scaled.meta["example_value"] = torch.empty_like(value, dtype=product_dtype)
            if value.dtype != product_dtype and base is ce:     # (a bf16 loss: the product in fp32, the loss in bf16)
                with gm.graph.inserting_after(scaled):
                    cast = gm.graph.call_method("to", (scaled, value.dtype))
                cast.meta["example_value"] = value
                scaled = cast
        if base is not ce:      # the quotient becomes the scaled numerator in its dtype, under its name (the loss's)
            ce.op, ce.target, ce.args, ce.kwargs = "call_method", "to", (product, value.dtype), {}
        else:
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in ce.meta:
                    scaled.meta[key] = ce.meta[key]
            ce.replace_all_uses_with(scaled, delete_user_cb=lambda user, product=product: user is not product)
        counters.append(counter)
        finishes.append(finish)
    if counters:
        gm.graph.lint()
        gm.recompile()
    return tuple(counters), tuple(finishes), tuple(uncounted), tuple(picked_lines)


def _numbers_of_the_data(loss, batch: BatchInfo) -> tuple:
    """The model's line where `loss` computes with a number the data decides from the batch (a
    size or a scalar it holds: `mask.sum().item()`, `mask.nonzero().shape[0]`, and numbers from
    them), as arithmetic reads it (not as a size: JetMoE's split of its tokens per expert), or ().
    Note [sums over a sum of the data]: a microbatch would compute that number from its own rows."""
    if not isinstance(loss, fx.Node):
        return ()
    numbers, first = set(), {}     # (first: each tensor computed with a number, to the arithmetic that read it)
    for n in loss.graph.nodes:
        v = node_value(n)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if any(a in numbers for a in n.all_input_nodes) or (
                    free_unbacked_symbols(v) and any(reads_the_batch(a, batch) for a in n.all_input_nodes)):
                numbers.add(n)
        elif isinstance(v, torch.Tensor) and n.op in ("call_function", "call_method"):
            if op_name(n) in ARITHMETIC and any(a in numbers for a in n.all_input_nodes):
                first[n] = n
            elif (seed := next((a for a in n.all_input_nodes if a in first), None)) is not None:
                first[n] = first[seed]
        if n is loss:
            break
    return (model_line(first[loss]),) if loss in first else ()


def check_loss_splits(scale: Optional[LossScale], info: BatchInfo, num_microbatches: int) -> None:
    """Raise an InputError where the loss divides by a sum over the batch's rows that the
    parameters compute, computes with a number the data decides, or takes a mean over rows a mask
    picks it cannot count, and the batch is split (Note [sums over a sum of the data], Note [rows
    a mask picks])."""
    if scale is None or not info.split(num_microbatches):
        return
    if scale.numbers:
        raise InputError(f"the loss computes with a number the data decides over the batch's rows{scale.numbers[0]} "
                         f"(a Python number read off a tensor, `.item()`, or a size the data decides, "
                         f"`mask.nonzero().shape[0]`): split into {num_microbatches} microbatches, each would compute "
                         f"it from its own rows, and their losses put together are not eager's. Keep it a tensor "
                         f"(`mask.sum()`, not `mask.sum().item()`): a loss over such a sum is counted over the whole "
                         f"batch before the step; or use Config(num_microbatches=1).")
    if scale.picked:
        raise InputError(f"the loss takes a mean over rows a mask picks{scale.picked[0]} that rpcompile cannot count "
                         f"over the whole batch before the step (a mask the model computes, or a mean it cannot "
                         f"write as a sum): split into {num_microbatches} microbatches, each would divide by its own "
                         f"picks, and their means put together are not eager's. Use Config(num_microbatches=1), or "
                         f"a mask read off the inputs (`labels != -100`) with `F.mse_loss(h[mask], y[mask])` or "
                         f"`.mean()`, which is counted over the whole batch, or a sum over the picks divided by "
                         f"`mask.sum()`.")
    if not scale.uncounted:
        return
    raise InputError(f"the loss divides by a sum over the batch's rows that the parameters compute"
                     f"{scale.uncounted[0]}: split into {num_microbatches} microbatches, each would divide by its "
                     f"own rows' sum, and their quotients put together are not eager's. Use "
                     f"Config(num_microbatches=1), or a divisor the data alone computes (a mask's or the weights' "
                     f"sum), which is counted over the whole batch before the step.")
