"""split_lm_head: the LM head and its cross-entropy as K vocabulary shards.

The output projection of a language model (hidden x vocabulary) is the heaviest single
block of the step and its logits are the largest tensor. This pass finds, in the graph
that TorchDynamo captured, the projection to the vocabulary and the cross-entropy that
consumes it, and rewrites the pair into K shards with an online log-sum-exp::

    h = hidden reshaped to (N, H)                      # prologue
    for k in range(K):                                 # shard k, vocab rows [a_k, b_k)
        l = linear(h, W[a_k:b_k]).float()              # (N, b_k - a_k), never (N, V)
        m_new = maximum(m, amax(l.detach(), -1))       # running max, detached
        s = s * exp(m - m_new) + sum(exp(l - m_new), -1)
        t = t + where(a_k <= y < b_k, l[rows, y - a_k], 0)   # the target logit
        m = m_new
    nll = where(y != ignore_index, m + log(s) - t, 0)  # epilogue
    loss = nll.sum() [/ (y != ignore_index).sum()]     # per the reduction

Everything is plain torch calls inserted as graph nodes, so autograd differentiates it
(the gradient of ``log s`` through a detached ``m`` is the softmax; the gradient of the
shared weight is the sum over its row slices, and for tied embeddings autograd adds the
embedding's gradient to it). Between two shards only small values are live (h, y, m, s,
t and the weight), so a stage cut may fall there; a stage that is recomputed for its
backward recomputes only its own slices of logits. Autograd saves each shard's
``exp(l - m)`` (N x V/K, fp32) for backward and nothing else of that size (the target
logit is read by advanced indexing, whose backward keeps only the indices; ``gather``
would keep ``l`` too). So a stage holding several shards keeps their slices until its
backward: a fused last stage with all K shards saves about the full fp32 logits' bytes.

K, when the caller does not set it (:func:`estimate_num_shards`): a shard about the cost
of one decoder layer, i.e. round(head FLOPs / FLOPs of one layer) in [1, 64], the layers
being the members of the numbered module container (``model.layers.N``) seen in
``nn_module_stack`` and their FLOPs those of their linear / matmul / attention nodes; and at
least as many as keep one shard's logits within a share of the device's memory (Note [shards
by memory]).

Note [shards by memory]: attention's FLOPs grow with the square of the sequence length and the
head's only linearly, so at long sequences the FLOPs rule asks for few shards while the logits
grow: Qwen3-1.7B at 28,672 tokens got 2 shards of 8.11 GiB fp32 logits each, and the plan needed
26.35 GiB (a backward stage holds a shard's logits and their gradient) where the card had 24
(the max-sequence search of issue 12 stopped at 24,576 tokens). So K is also at least
ceil(fp32 logits of a microbatch / (memory budget / SHARD_SHARE)): with a shard's logits at most
1/16 of the budget, a stage holds the value and its gradient and the saved exp(l - m) of a
dozen shards before the logits alone fill the device. At the benchmarks' sizes (16,384 tokens a
microbatch, 80-141 GB cards) the FLOPs rule's 5 shards already satisfy it.
Both rules count at the length the plan is made for: a capture's own, or a re-plan's (the
``at`` of split_lm_head, the length symbols of Note [plans per length] in plan_cache.py), not
the capture's. A re-plan that kept its capture's count (Llama-3.1-8B captured at 8,192 tokens: 3
shards) held 10.4 GiB of fp32 logits a shard at 65,536 tokens, more than the 24 GiB card's
plan could hold; counted at 65,536 the memory rule asks for 21 shards of 1.5 GiB.

Patterns recognised (see :func:`find_lm_head`):

* the projection: ``F.linear`` / ``torch._C._nn.linear`` (bias allowed) whose weight is
  a 2-D ``(V, H)`` value, usually a parameter placeholder (tied or not);
* between projection and loss, only ops that act on the token dims and leave the
  vocabulary dim whole: ``.float()``, ``.to(torch.float32)``, ``.to(same device)``,
  ``.contiguous()``, ``.view/.reshape/torch.reshape`` with the vocabulary kept as the
  last dim, and ``getitem`` with slices/ints/Ellipsis on leading dims (e.g.
  ``logits[:, :-1, :]``). They are replayed on the hidden states, which is exact since
  the projection is row-wise;
* the loss: ``F.cross_entropy(logits_2d, target_1d, ignore_index=..., reduction=...)``
  with reduction ``"mean"`` (transformers' causal-LM loss, a user's
  ``F.cross_entropy(logits.view(-1, V), labels.view(-1))``), ``"sum"`` (as normalize_loss
  leaves it, the division by the count that follows is kept) or ``"none"``.

Left unsplit with a one-line warning (never a wrong loss): class weights, label
smoothing, legacy ``size_average``/``reduce``, probability (float) targets, another op
between projection and loss (e.g. final-logit soft-capping), or logits (or any value on the way to the loss) that have
other users, e.g. logits returned as an output; rpcompile removes the logits output
before calling this pass. Models that return logits without a loss have no
cross-entropy in the graph: their head is left whole, silently.

Meta written. Every new node gets ``example_value`` (fake propagation), the
``nn_module_stack`` of the head (prologue, shards) or of the loss (epilogue) and
``meta["rp_lm_head_part"]`` in {"prologue", "shard", "epilogue"}. Shard nodes, and only
they, get ``meta["rp_lm_head"] = {"k": k, "K": K, "start": start, "stop": stop, "apart": bool}`` (vocab
rows [start, stop); "apart": the memory rule set K, so each shard compiles apart); each weight (and bias) row slice gets
``meta["rp_param_slice"] = (placeholder name, 0, start, stop)`` when it slices a parameter
or buffer placeholder. The node that replaces the loss inherits the loss node's ``rp_*``
meta (normalize_loss's ``rp_loss``). ``gm.meta["rp_lm_head"]`` summarises the head of the
graph (:meth:`LMHead.summary`): split or not, why not, K, bounds, sizes. annotate_costs
runs after this pass, so the new nodes are costed like any other.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .cost import node_value
from .graph_utils import bind_cross_entropy, size_hint, symbol_hints

__all__ = [
    "LMHead",
    "estimate_num_shards",
    "find_lm_head",
    "shard_bounds",
    "split_lm_head",
]

MAX_SHARDS = 64
SHARD_SHARE = 16   # a shard's fp32 logits at most 1/16 of the memory budget (Note [shards by memory])

_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
_CE_TARGETS = (F.cross_entropy,)


# --------------------------------------------------------------------------- records


@dataclass
class LMHead:
    """A projection to the vocabulary and the cross-entropy that consumes it."""

    linear: fx.Node
    hidden: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    chain: tuple[fx.Node, ...]  # logit-side ops between the projection and the loss
    loss: fx.Node
    target: fx.Node
    vocab_size: int
    hidden_size: int
    num_tokens: Any  # int or SymInt: rows of the loss input
    reduction: str
    ignore_index: int
    reason: str | None = None  # why the head cannot be split; None when it can

    @property
    def splittable(self) -> bool:
        return self.reason is None

    @property
    def flops(self) -> int:
        """Forward FLOPs of the whole projection, at the size hints of dynamic dims."""
        return self.flops_at()

    def flops_at(self, at: dict | None = None) -> int:
        """Forward FLOPs of the whole projection, with the size symbols named in `at` bound there."""
        return 2 * _hint(self.num_tokens, at) * self.hidden_size * self.vocab_size

    def summary(self, num_shards: int | None = None) -> dict:
        """What ``gm.meta["rp_lm_head"]`` holds (num_shards: K when the head was split)."""
        split = num_shards is not None
        return {
            "split": split, "reason": self.reason, "K": num_shards,
            "bounds": shard_bounds(self.vocab_size, num_shards) if split else None,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "weight": self.weight.name, "bias": getattr(self.bias, "name", None),
            "reduction": self.reduction, "ignore_index": self.ignore_index,
            "flops": self.flops,
        }

    def __str__(self) -> str:
        ops = "".join(f" -> {_op_name(n)}" for n in self.chain)
        s = (
            f"lm_head: {_op_name(self.linear)}({self.hidden.name}, {self.weight.name}"
            f"[{self.vocab_size}x{self.hidden_size}]){ops} -> cross_entropy("
            f"reduction={self.reduction!r}, ignore_index={self.ignore_index}) over "
            f"{self.num_tokens} tokens"
        )
        return s + (f"; left whole: {self.reason}" if self.reason else "")


# --------------------------------------------------------------------------- helpers


def _hint(x: Any, at: dict | None = None) -> int:
    """x's size at the capture's size hints; at: {symbol name: size} overriding some of them."""
    if isinstance(x, torch.SymInt):
        if at:
            expr = x.node.expr
            if any(s.name in at for s in expr.free_symbols):
                hints = symbol_hints(x.node.shape_env)
                return int(expr.xreplace({s: at[s.name] if s.name in at else hints[s] for s in expr.free_symbols}))
        return size_hint(x)
    return int(x)


def _numel(t: torch.Tensor, at: dict | None = None) -> int:
    return math.prod(_hint(d, at) for d in t.shape)


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _placeholder_kind(node: fx.Node) -> str | None:
    if node.op != "placeholder":
        return None
    kind = node.meta.get("rp_kind")
    if kind is None:
        ev = node_value(node)
        kind = "param" if isinstance(ev, torch.nn.Parameter) else "input"
    return kind


def _is_full_slice(x: Any) -> bool:
    return isinstance(x, slice) and x.start is None and x.stop is None and x.step is None


def _index_keeps_last_dim(index: Any, ndim: int) -> bool:
    """True when ``t[index]`` only indexes leading dims of a ``ndim``-dim tensor."""
    idx = index if isinstance(index, tuple) else (index,)
    for e in idx:
        if e is Ellipsis or isinstance(e, slice):
            continue
        if isinstance(e, int) and not isinstance(e, bool):
            continue
        if isinstance(e, fx.Node) and isinstance(node_value(e), (int, torch.SymInt)):
            continue
        return False  # None (new axis), tensors, lists, bools
    if Ellipsis in idx:
        after = idx[idx.index(Ellipsis) + 1 :]
        return not after or _is_full_slice(after[-1])
    if len(idx) < ndim:
        return True
    return len(idx) == ndim and _is_full_slice(idx[-1])


def _chain_op(node: fx.Node, vocab: int) -> tuple[str | None, str | None]:
    """Classify a logit-side op: (kind, reason-if-unsupported)."""
    src, out = node_value(node.args[0]) if node.args else None, node_value(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None, f"no example value on {node.name}"
    if out.dim() == 0 or out.shape[-1] != vocab or src.shape[-1] != vocab:
        return None, f"{_op_name(node)} ({node.name}) changes the vocabulary dim"
    if node.op == "call_method" and node.target == "float" and len(node.args) == 1:
        return "cast", None
    if node.op == "call_method" and node.target == "contiguous":
        return "noop", None
    if node.op == "call_method" and node.target == "to":
        if out.dtype == src.dtype and out.device == src.device:
            return "noop", None
        if out.dtype == torch.float32 and out.device == src.device:
            return "cast", None
        return None, f"{node.name} casts the logits to {out.dtype} / {out.device}"
    if (node.op == "call_method" and node.target in ("view", "reshape")) or (
        node.op == "call_function" and node.target is torch.reshape
    ):
        if len(node.args) < 2 or node.kwargs:
            return None, f"{_op_name(node)} ({node.name}) with a keyword shape is not supported"
        return "reshape", None
    if node.op == "call_function" and node.target is operator.getitem:
        if _index_keeps_last_dim(node.args[1], src.dim()):
            return "getitem", None
        return None, f"indexing {node.name} touches the vocabulary dim"
    return None, f"unsupported op {_op_name(node)} ({node.name}) between the head and the loss"


# --------------------------------------------------------------------------- finding


def _find_heads(gm: fx.GraphModule) -> list[LMHead]:
    heads = []
    for ce in gm.graph.nodes:
        if ce.op == "call_function" and ce.target in _CE_TARGETS:
            head = _match(ce)
            if head is not None:
                heads.append(head)
    return heads


def _match(ce: fx.Node) -> LMHead | None:
    args = bind_cross_entropy(ce)
    if args is None or not isinstance(args["input"], fx.Node):
        return None
    # walk back from the loss input to a projection, through single-input ops
    chain: list[fx.Node] = []
    node = args["input"]
    while not (node.op == "call_function" and node.target in _LINEAR_TARGETS):
        if node.op not in ("call_function", "call_method") or not node.args:
            return None
        if not isinstance(node.args[0], fx.Node) or len(chain) >= 16:
            return None
        chain.append(node)
        node = node.args[0]
    linear = node
    chain.reverse()
    largs = list(linear.args) + [None] * (3 - len(linear.args))
    hidden = linear.kwargs.get("input", largs[0])
    weight = linear.kwargs.get("weight", largs[1])
    bias = linear.kwargs.get("bias", largs[2])
    w, x, logits_in = node_value(weight), node_value(hidden), node_value(args["input"])
    if not (isinstance(weight, fx.Node) and isinstance(hidden, fx.Node)):
        return None
    if not (isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor)) or w.dim() != 2:
        return None
    vocab, hsize = int(w.shape[0]), int(w.shape[1])
    if not isinstance(logits_in, torch.Tensor) or logits_in.shape[-1] != vocab:
        return None  # a linear, but not the one whose outputs are the classes

    target = args["target"]
    y = node_value(target)
    ignore_index = args["ignore_index"]
    head = LMHead(
        linear=linear, hidden=hidden, weight=weight, bias=bias, chain=tuple(chain),
        loss=ce, target=target, vocab_size=vocab, hidden_size=hsize,
        num_tokens=logits_in.shape[0] if logits_in.dim() else 1,
        reduction=args["reduction"], ignore_index=ignore_index,
    )

    def reason() -> str | None:
        if args["weight"] is not None:
            return "cross_entropy with class weights is not supported"
        ls = args["label_smoothing"]
        if isinstance(ls, fx.Node) or ls != 0.0:
            return "cross_entropy with label_smoothing is not supported"
        if args["size_average"] is not None or args["reduce"] is not None:
            return "cross_entropy with legacy size_average/reduce is not supported"
        if args["reduction"] not in ("mean", "sum", "none"):
            return f"cross_entropy reduction={args['reduction']!r} is not supported"
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            return "cross_entropy with a non-constant ignore_index is not supported"
        if logits_in.dim() != 2:
            return f"cross_entropy input of {logits_in.dim()} dims (only (N, V) is supported)"
        if not isinstance(target, fx.Node) or not isinstance(y, torch.Tensor):
            return "cross_entropy target is not a tensor of the graph"
        if y.is_floating_point() or y.dim() != 1:
            return "cross_entropy with probability targets or non-1-D targets is not supported"
        if not isinstance(bias, (fx.Node, type(None))):
            return "projection with a constant bias is not supported"
        for n in chain:
            kind, why = _chain_op(n, vocab)
            if kind is None:
                return why
        for a, b in zip((linear, *chain), (*chain, ce)):
            others = [u.name for u in a.users if u is not b]
            if others:
                return (
                    f"the logits ({a.name}) have other users ({', '.join(others)}) "
                    "besides the loss, e.g. logits returned as an output"
                )
        return None

    head.reason = reason()
    return head


def find_lm_head(gm: fx.GraphModule) -> LMHead | None:
    """The first projection to the vocabulary feeding a cross-entropy, or None; ``.reason`` says why it can't be split."""
    heads = _find_heads(gm)
    return heads[0] if heads else None


# --------------------------------------------------------------------------- K


_LAYER_SEG = re.compile(r"\[\s*['\"]?([^\]'\"]+)['\"]?\s*\]")


@functools.lru_cache(maxsize=4096)    # (every node of a layer names the same few paths, at every plan)
def _module_path_segments(path: str) -> tuple:
    return tuple(s for s in _LAYER_SEG.sub(r".\1", path).split(".") if s)


def _node_flops(node: fx.Node, at: dict | None = None) -> int:
    """Rough forward FLOPs of the matmul-like ops (2 * out elements * reduced dim); 0 otherwise."""
    try:
        out = node_value(node)
        t, name = node.target, node.target if node.op == "call_method" else None
        if node.op == "call_function" and t in _LINEAR_TARGETS:
            w = node_value(node.args[1] if len(node.args) > 1 else node.kwargs["weight"])
            return 2 * _numel(out, at) * _hint(w.shape[-1], at)
        if (node.op == "call_function" and t in (torch.matmul, operator.matmul, torch.bmm, torch.mm)) or (
            name in ("matmul", "bmm", "mm", "__matmul__")
        ):
            a = node_value(node.args[0])
            return 2 * _numel(out, at) * _hint(a.shape[-1], at)
        if node.op == "call_function" and t is F.scaled_dot_product_attention:
            q, k, v = (node_value(a) for a in node.args[:3])
            rows = _numel(q, at) // _hint(q.shape[-1], at)
            return 2 * rows * _hint(k.shape[-2], at) * (_hint(q.shape[-1], at) + _hint(v.shape[-1], at))
    except Exception:
        return 0
    return 0


def estimate_num_shards(gm: fx.GraphModule, head: LMHead | None = None, at: dict | None = None,
                        max_logit_bytes: float | None = None) -> int:
    """K for the head: its FLOPs over those of one decoder layer, rounded, and at least as many as
    keep each shard's fp32 logits (of the whole captured batch) within max_logit_bytes (Note
    [shards by memory]), in [1, 64]. at: {symbol name: size} to count at instead of the size
    hints (what a capture at those sizes would choose: Note [longest length] in passes/longest.py)."""
    head = head or find_lm_head(gm)
    if head is None:
        return 1
    return max(_shard_counts(gm, head, at, max_logit_bytes))


def _shard_counts(gm: fx.GraphModule, head: LMHead, at: dict | None, max_logit_bytes: float | None) -> tuple:
    """(shards by the FLOPs rule, shards by the memory rule), each clamped."""
    return _clamp(head, _shards_by_flops(gm, head, at)), _shards_by_memory(head, at, max_logit_bytes)


def _clamp(head: LMHead, K: int) -> int:
    return int(max(1, min(MAX_SHARDS, head.vocab_size, K)))


def _shards_by_memory(head: LMHead, at: dict | None, max_logit_bytes: float | None) -> int:
    """The fewest shards whose fp32 logits each fit max_logit_bytes (Note [shards by memory]); 1 without it."""
    if not max_logit_bytes:
        return 1
    return _clamp(head, math.ceil(_hint(head.num_tokens, at) * head.vocab_size * 4 / max_logit_bytes))


def _shards_by_flops(gm: fx.GraphModule, head: LMHead, at: dict | None) -> int:
    head_nodes = {head.linear, *head.chain, head.loss}
    # decoder layers: the numbered container (e.g. model.layers.N) with most members
    stacks: dict[fx.Node, list[tuple]] = {}
    members: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        paths = [_module_path_segments(v[0]) for v in (n.meta.get("nn_module_stack") or {}).values()
                 if isinstance(v, tuple) and v and isinstance(v[0], str)]
        stacks[n] = paths
        for segs in paths:
            for i, s in enumerate(segs):
                if s.isdigit() and i > 0:
                    prefix = segs[:i]
                    if not any(p.isdigit() for p in prefix):
                        members.setdefault(".".join(prefix), set()).add(s)
    prefix, layers = None, 1
    if members:
        prefix, idx = max(members.items(), key=lambda kv: len(kv[1]))
        layers = len(idx)

    def in_layers(n: fx.Node) -> bool:
        if prefix is None:
            return True
        return any(".".join(segs).startswith(prefix + ".") for segs in stacks[n])

    layer_flops = sum(
        _node_flops(n, at) for n in gm.graph.nodes if n not in head_nodes and in_layers(n)
    ) / layers
    return 1 if layer_flops <= 0 else round(head.flops_at(at) / layer_flops)


def shard_bounds(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) vocab ranges: the first V % K shards one row larger."""
    base, extra = divmod(vocab_size, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# --------------------------------------------------------------------------- rewriting


# Note [shard values]: every shard but the first is the same ~25 ops on tensors of the same
# shapes (rows x width; the running max, sum and target logit are per row), so fake-executing
# each shard's nodes (~2 ms a node on an H200 host, 0.8 s of a re-plan at 25 shards) gives the
# same example values again and again. A shard after the first takes the values of an earlier
# shard of the same width and the same parity of k, node by node, instead: the same objects,
# shared by two nodes. Same parity because a shard reads the running values of the shard before
# it: were shard k's values shard k-1's, the running max it makes would be the very tensor it
# reads, and annotate_costs (which takes an output that shares an input's storage for a view)
# would cost the update as a free view. With the two parities alternating, a shard's values
# alias each other, and what it reads, exactly as in the shard that made them.


class _Builder:
    """Inserts nodes before ``anchor`` with example values, module stack and rp_lm_head meta."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode: Any):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.part: str = "prologue"
        self.shard: dict | None = None
        self.src: fx.Node | None = None
        self._made: dict = {}          # shard key -> the example values of its nodes, in order
        self._replay: list | None = None
        self._record: list | None = None
        self._at = 0

    def begin_shard(self, shard: dict, key: Any) -> None:
        """The next nodes are `shard`'s; those of an earlier shard with the same key have the
        same example values (Note [shard values]); key None: fake-execute them."""
        self.part, self.shard = "shard", shard
        self._replay = self._made.get(key) if key is not None else None
        self._record = self._made.setdefault(key, []) if key is not None and self._replay is None else None
        self._at = 0

    def end_shards(self) -> None:
        self.shard, self._replay, self._record = None, None, None

    def __call__(self, op: str, target: Any, *args: Any, _name: str | None = None, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs, name=_name)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if self.src is not None and key in self.src.meta:
                val = self.src.meta[key]
                node.meta[key] = dict(val) if isinstance(val, dict) else val
        node.meta["rp_lm_head_part"] = self.part
        if self.shard is not None:
            node.meta["rp_lm_head"] = dict(self.shard)
        if self._replay is not None:
            val = self._replay[self._at]
            self._at += 1
        else:
            val = self._fake(node)
            if self._record is not None:
                self._record.append(val)
        if val is not None:
            node.meta["example_value"] = val
        return node

    def _fake(self, node: fx.Node) -> Any:
        try:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), node_value)
            with self.fake_mode if self.fake_mode is not None else nullcontext():
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                return node.target(*args, **kwargs)
        except Exception:
            return None


def _fake_mode_of(*nodes: fx.Node) -> Any:
    from torch._guards import detect_fake_mode

    try:
        return detect_fake_mode([node_value(n) for n in nodes if isinstance(node_value(n), torch.Tensor)])
    except Exception:
        return None


def _rewrite(gm: fx.GraphModule, head: LMHead, num_shards: int, apart: bool = False) -> None:
    g = gm.graph
    V = head.vocab_size
    fake_mode = _fake_mode_of(head.hidden, head.weight, head.target)
    node = _Builder(g, head.loss, fake_mode)
    fn = lambda target, *a, **k: node("call_function", target, *a, **k)  # noqa: E731
    meth = lambda name, *a, **k: node("call_method", name, *a, **k)  # noqa: E731

    # prologue: replay the token-dim ops of the logits on the hidden states
    node.src, node.part = head.linear, "prologue"
    h = head.hidden
    for op in head.chain:
        kind, _ = _chain_op(op, V)
        if kind == "getitem":
            h = fn(operator.getitem, h, op.args[1])
        elif kind == "reshape":
            shape = op.args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
                shape = tuple(shape[0])
            last = shape[-1]
            if not (isinstance(last, int) and last == -1):
                shape = (*shape[:-1], head.hidden_size)
            h = fn(torch.reshape, h, tuple(shape), _name="lm_head_hidden")
    y = head.target

    m = s = t = None
    wkind = _placeholder_kind(head.weight)
    bkind = _placeholder_kind(head.bias) if isinstance(head.bias, fx.Node) else None
    for k, (a, b) in enumerate(shard_bounds(V, num_shards)):
        node.begin_shard({"k": k, "K": num_shards, "start": a, "stop": b, "apart": apart},
                         key=(b - a, k % 2) if k else None)
        w_k = fn(operator.getitem, head.weight, slice(a, b), _name=f"lm_head_weight_{k}")
        if wkind in ("param", "buffer"):
            w_k.meta["rp_param_slice"] = (head.weight.name, 0, a, b)
        b_k = None
        if head.bias is not None:
            b_k = fn(operator.getitem, head.bias, slice(a, b), _name=f"lm_head_bias_{k}")
            if bkind in ("param", "buffer"):
                b_k.meta["rp_param_slice"] = (head.bias.name, 0, a, b)
        l_k = fn(F.linear, h, w_k, b_k, _name=f"lm_head_logits_{k}")
        lv = node_value(l_k)
        if isinstance(lv, torch.Tensor) and lv.dtype in (torch.float16, torch.bfloat16):
            l_k = meth("float", l_k, _name=f"lm_head_logits_{k}_f32")
        m_k = fn(torch.amax, fn(torch.detach, l_k), -1, _name=None if k else "lm_head_max_0")
        m_new = m_k if m is None else fn(torch.maximum, m, m_k, _name=f"lm_head_max_{k}")
        e_k = fn(torch.exp, fn(torch.sub, l_k, fn(torch.unsqueeze, m_new, -1)))
        s_k = fn(torch.sum, e_k, -1, _name=None if k else "lm_head_sumexp_0")
        if s is not None:
            s_k = fn(torch.add, fn(torch.mul, s, fn(torch.exp, fn(torch.sub, m, m_new))), s_k,
                     _name=f"lm_head_sumexp_{k}")
        s, m = s_k, m_new
        ge, lt = fn(torch.ge, y, a), fn(torch.lt, y, b)
        off = fn(torch.sub, y, a) if a else y
        hit = fn(torch.logical_and, ge, lt)
        idx = fn(torch.clamp, off, 0, b - a - 1)
        if apart:       # Note [shard bounds as inputs] (passes/regions.py): arg indices
            # (the first shard's start is 0 in every shard count: its end is an input too)
            for n, i in ((w_k, 1), (b_k, 1), (ge, 1), (lt, 1), (off, 1), (idx, 2)) if a else (
                    (w_k, 1), (b_k, 1), (lt, 1), (idx, 2)):
                if n is not None:
                    n.meta["rp_shard_bound"] = i
        # l_k[rows, idx] rather than gather: its backward keeps only the indices, gather's
        # keeps l_k too (a second N x (b - a) fp32 tensor per shard saved for backward).
        rows = fn(torch.sub, fn(torch.cumsum, fn(torch.ones_like, y), 0), 1)
        g_k = fn(operator.getitem, l_k, (rows, idx))
        g_k = fn(torch.where, hit, g_k, 0.0, _name=None if k else "lm_head_target_logit_0")
        t = g_k if t is None else fn(torch.add, t, g_k, _name=f"lm_head_target_logit_{k}")

    # epilogue: nll = m + log s - t on the counted tokens, reduced like the loss was
    node.end_shards()
    node.src, node.part = head.loss, "epilogue"
    nll = fn(torch.sub, fn(torch.add, m, fn(torch.log, s)), t)
    valid = fn(torch.ne, y, head.ignore_index)
    nll = fn(torch.where, valid, nll, 0.0, _name="lm_head_nll")
    if head.reduction == "none":
        out = nll
    elif head.reduction == "sum":
        out = fn(torch.sum, nll, _name="lm_head_loss")
    else:  # mean over the counted tokens (nan when none is counted, like F.cross_entropy)
        out = fn(torch.div, fn(torch.sum, nll), fn(torch.sum, valid), _name="lm_head_loss")
    want, got = node_value(head.loss), node_value(out)
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.dtype != got.dtype:
        out = meth("to", out, want.dtype)

    for key, val in head.loss.meta.items():
        if key.startswith("rp_") and key not in out.meta:
            out.meta[key] = val
    head.loss.replace_all_uses_with(out)
    for dead in (head.loss, *reversed(head.chain), head.linear):
        g.erase_node(dead)


def split_lm_head(gm: fx.GraphModule, num_shards: int | None = None,
                  max_logit_bytes: float | None = None, at: dict | None = None) -> fx.GraphModule:
    """Rewrite the LM head and its cross-entropy into K vocabulary shards with an online log-sum-exp
    (K: num_shards, or estimate_num_shards with max_logit_bytes, counted at `at`: {symbol name:
    size} overriding the capture's size hints, as a plan at another length has them)."""
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"split_lm_head: num_shards must be a positive int, got {num_shards!r}")
    summaries = []
    for head in _find_heads(gm):
        if head.reason is not None:
            # Worth a word only where splitting would pay: shards were asked for, or the head
            # costs more than a layer (a classifier's small head is best whole anyway).
            if num_shards is not None and num_shards > 1 or num_shards is None and estimate_num_shards(gm, head) > 1:
                warnings.warn(f"split_lm_head: LM head left unsplit: {head.reason}; it runs whole, its full "
                              "logits in one stage (Config(lm_head_shards=0) keeps it whole without this "
                              "warning)", stacklevel=2)
            summaries.append(head.summary())
            continue
        K, apart = num_shards, False
        if num_shards is None:
            # shards the memory rule asked for run as compiled pieces of their own (Note [one
            # piece per shard] in passes/regions.py); the FLOPs rule's stay in one graph
            by_flops, by_memory = _shard_counts(gm, head, at, max_logit_bytes)
            K, apart = max(by_flops, by_memory), by_memory > by_flops
        if K > head.vocab_size:
            raise ValueError(
                f"split_lm_head: num_shards={K} exceeds the vocabulary size {head.vocab_size}"
            )
        summaries.append(head.summary(K))
        _rewrite(gm, head, K, apart)
    if summaries:
        gm.meta["rp_lm_head"] = summaries[0]  # a graph has one LM head; the first if several
    gm.graph.lint()
    gm.recompile()
    return gm
