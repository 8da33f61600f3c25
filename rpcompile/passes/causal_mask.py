"""Causal attention: an SDPA mask that is provably the causal mask becomes `is_causal=True`.

Note [causal masks]: under TorchDynamo, transformers cannot look at a padding mask's values
(`_ignore_causal_mask_sdpa` skips the mask only when not tracing; transformers 5.x also builds
a packed-sequence mask from `position_ids` it cannot inspect), so even a batch without padding
captures the mask the non-traced model never makes: a (B, 1, S, S) boolean tensor built from
`arange`s, passed to `scaled_dot_product_attention(attn_mask=...)`. That costs S x S memory per
sequence (1 GiB at S = 32,768, more while it is built and converted to an additive bias) and,
worse, keeps SDPA off the flash kernel: with a mask it takes the memory-efficient or the math
kernel, the latter materialising (B, H, S, S) scores (issue #12: Qwen3-1.7B at 28,672 tokens
ran out of a 24 GiB budget in one allocation). The mask is also an activation every stage
reads, so it is carried across every stage boundary.

This pass rewrites such an SDPA call to `attn_mask=None, is_causal=True` and drops the mask's
subgraph, when it can *prove* the mask is the causal one for every size:

- The mask must be computed from sizes and constants alone (no input, parameter or buffer
  reaches it). A mask that reads `attention_mask` (padding) or user `position_ids` (packed
  sequences) is data, and stays as it is.
- Each value of that subgraph is evaluated symbolically: a tensor is its (symbolic) shape and
  one sympy expression for its element at index (i0, i1, ...), integer symbols `rp_i0`,
  `rp_i1`, ... . `arange(n)` is `i0`, broadcasting and `unsqueeze`/`expand`/indexing rename
  the index symbols, comparisons are sympy relations, `&` is `And`, `cumsum` a closed-form
  sum, `diff` a difference. Every rule is exact; an op without a rule, a float value, a
  possibly wrapping index or an aliasing in-place update stops the proof (no rewrite).
- The mask's element must then simplify, structurally, to the relation `kv <= q` of its last
  two index symbols (its other dims broadcast), with the query and key lengths the same
  size symbol: exactly SDPA's `is_causal` lower-triangular mask at every length. A sliding
  window (`kv > q - w` & `kv <= q`) or a chunked mask is a different formula and is not
  rewritten, however the two agree at lengths below the window: nothing is evaluated at
  sample sizes.

transformers 5.x (`sdpa_mask` with its index-based, non-vmap mask functions, the packed
sequence check over `arange` positions) is what this recognises; a mask it cannot read stays
correct, merely materialised. Padded batches keep their mask.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .graph_utils import is_impure, mutated_values

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# Index symbols: the element of a d-dim value at (rp_i0, ..., rp_i{d-1}).
_IDX = [sympy.Symbol(f"rp_i{k}", integer=True, nonnegative=True) for k in range(16)]


@dataclass(frozen=True)
class _Val:
    """A tensor (or scalar, shape ()) known exactly: its shape and its element at _IDX."""

    shape: tuple          # sympy sizes
    value: sympy.Basic    # integer expression, or a sympy Boolean for kind "bool"
    kind: str             # "int" or "bool"


def causal_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every SDPA whose mask is provably causal to is_causal=True (Note [causal masks])."""
    ev = _Evaluator(gm)
    rewritten = []
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target in _SDPA):
            continue
        args = _sdpa_args(node)
        mask = args.get("attn_mask") if args is not None else None
        if not isinstance(mask, fx.Node) or args.get("is_causal", False) is not False:
            continue
        if _proves_causal(ev, mask, args["query"], args["key"]):
            _set_causal(node)
            rewritten.append(mask)
    if rewritten:
        _drop_dead(gm, ev.visited)
        gm.graph.lint()
        gm.recompile()
    return gm


def _sdpa_args(node: fx.Node) -> Optional[dict]:
    if len(node.args) > len(_SDPA_ARGS) or any(k not in _SDPA_ARGS for k in node.kwargs):
        return None
    out = dict(zip(_SDPA_ARGS, node.args))
    out.update(node.kwargs)
    return out


def _set_causal(node: fx.Node) -> None:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if len(args) > 3:
        args[3] = None
    else:
        kwargs["attn_mask"] = None
    if len(args) > 5:
        args[5] = True
    else:
        kwargs["is_causal"] = True
    node.args, node.kwargs = tuple(args), kwargs


def _proves_causal(ev: "_Evaluator", mask: fx.Node, query, key) -> bool:
    q_ev = query.meta.get("example_value") if isinstance(query, fx.Node) else None
    k_ev = key.meta.get("example_value") if isinstance(key, fx.Node) else None
    if not (isinstance(q_ev, torch.Tensor) and isinstance(k_ev, torch.Tensor)) or q_ev.dim() < 2 or k_ev.dim() < 2:
        return False
    L, S = _size(q_ev.shape[-2]), _size(k_ev.shape[-2])
    if L != S:
        return False
    m = ev.value(mask)
    if not ev.unwritten(mask) or m is None or m.kind != "bool" or len(m.shape) < 2 or m.shape[-2] != L or m.shape[-1] != S:
        return False
    d = len(m.shape)
    value = m.value.xreplace({_IDX[j]: sympy.Integer(0) for j in range(d) if m.shape[j] == 1})
    return _is_kv_le_q(value, q=_IDX[d - 2], kv=_IDX[d - 1])


def _is_kv_le_q(rel, q, kv) -> bool:
    """Whether `rel` is, as a formula over integers, `kv <= q`."""
    if not isinstance(rel, sympy.core.relational.Relational):
        return False
    a, b = rel.lhs, rel.rhs
    if isinstance(rel, sympy.LessThan):
        diff = b - a                   # a <= b  <=>  b - a >= 0
    elif isinstance(rel, sympy.StrictLessThan):
        diff = b - a - 1               # a < b   <=>  b - a - 1 >= 0 (integers)
    elif isinstance(rel, sympy.GreaterThan):
        diff = a - b
    elif isinstance(rel, sympy.StrictGreaterThan):
        diff = a - b - 1
    else:
        return False
    return sympy.expand(diff - (q - kv)) == 0


def _drop_dead(gm: fx.GraphModule, candidates) -> None:
    """Remove the mask subgraphs left without users (only nodes the evaluator looked at)."""
    for node in reversed(list(gm.graph.nodes)):
        if node in candidates and not node.users and not is_impure(node):
            gm.graph.erase_node(node)


# --- symbolic evaluation -------------------------------------------------------------------------

def _size(s):
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s)


def _kind(dtype) -> Optional[str]:
    if dtype == torch.bool:
        return "bool"
    if dtype in (torch.int64, torch.int32):
        return "int"
    return None


def _broadcast(v: _Val, shape: tuple) -> Optional[sympy.Basic]:
    """v's element expression at the indices of a value of `shape` that v broadcasts to."""
    n, m = len(shape), len(v.shape)
    if m > n:
        return None
    mapping = {}
    for j in range(m):
        k = j + n - m
        if v.shape[j] == shape[k]:
            mapping[_IDX[j]] = _IDX[k]
        elif v.shape[j] == 1:
            mapping[_IDX[j]] = sympy.Integer(0)
        else:
            return None
    return v.value.xreplace(mapping)


def _as_bool(v: _Val) -> sympy.Basic:
    return v.value if v.kind == "bool" else sympy.Ne(v.value, 0)


def _as_int(v: _Val) -> sympy.Basic:
    return v.value if v.kind == "int" else sympy.Piecewise((1, v.value), (0, True))


_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_COMPARE = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"and": sympy.And, "or": sympy.Or, "xor": sympy.Xor}

# Callable targets and method names -> (rule, op name).
_FUNCTIONS = {
    operator.add: ("arith", "add"), operator.sub: ("arith", "sub"), operator.mul: ("arith", "mul"),
    operator.iadd: ("inplace", "add"), operator.isub: ("inplace", "sub"), operator.imul: ("inplace", "mul"),
    operator.iand: ("inplace", "and"), operator.ior: ("inplace", "or"),
    torch.add: ("arith", "add"), torch.sub: ("arith", "sub"), torch.mul: ("arith", "mul"),
    operator.lt: ("compare", "lt"), operator.le: ("compare", "le"), operator.gt: ("compare", "gt"),
    operator.ge: ("compare", "ge"), operator.eq: ("compare", "eq"), operator.ne: ("compare", "ne"),
    torch.lt: ("compare", "lt"), torch.le: ("compare", "le"), torch.gt: ("compare", "gt"),
    torch.ge: ("compare", "ge"), torch.eq: ("compare", "eq"), torch.ne: ("compare", "ne"),
    operator.and_: ("logic", "and"), operator.or_: ("logic", "or"), operator.xor: ("logic", "xor"),
    torch.logical_and: ("logic", "and"), torch.logical_or: ("logic", "or"), torch.logical_xor: ("logic", "xor"),
    torch.bitwise_and: ("logic", "and"), torch.bitwise_or: ("logic", "or"),
    operator.invert: ("not", None), torch.logical_not: ("not", None), torch.bitwise_not: ("not", None),
    operator.neg: ("neg", None), torch.neg: ("neg", None),
    torch.arange: ("arange", None), operator.getitem: ("getitem", None),
    torch.unsqueeze: ("unsqueeze", None), torch.cumsum: ("cumsum", None), torch.diff: ("diff", None),
    torch.broadcast_to: ("broadcast", None), torch.where: ("where", None),
    torch.ones: ("full", 1), torch.zeros: ("full", 0), torch.full: ("full", None),
    torch.ones_like: ("full", 1), torch.zeros_like: ("full", 0), torch.full_like: ("full_like", None),
    torch.reshape: ("reshape", None), torch.clone: ("copy", None),
}
_METHODS = {
    "add": ("arith", "add"), "sub": ("arith", "sub"), "mul": ("arith", "mul"),
    "__add__": ("arith", "add"), "__radd__": ("arith", "add"), "__sub__": ("arith", "sub"),
    "__mul__": ("arith", "mul"), "__rmul__": ("arith", "mul"),
    **{name: ("compare", name) for name in _COMPARE}, **{f"__{name}__": ("compare", name) for name in _COMPARE},
    "__and__": ("logic", "and"), "__or__": ("logic", "or"), "__xor__": ("logic", "xor"),
    "logical_and": ("logic", "and"), "logical_or": ("logic", "or"), "logical_xor": ("logic", "xor"),
    "bitwise_and": ("logic", "and"), "bitwise_or": ("logic", "or"),
    "__invert__": ("not", None), "logical_not": ("not", None), "bitwise_not": ("not", None),
    "neg": ("neg", None), "__neg__": ("neg", None),
    "unsqueeze": ("unsqueeze", None), "expand": ("broadcast", None), "expand_as": ("broadcast", None),
    "broadcast_to": ("broadcast", None), "view": ("reshape", None), "reshape": ("reshape", None),
    "squeeze": ("reshape", None), "cumsum": ("cumsum", None), "diff": ("diff", None),
    "to": ("cast", None), "bool": ("cast", None), "long": ("cast", None), "int": ("cast", None),
    "type": ("cast", None), "contiguous": ("cast", None), "detach": ("cast", None), "clone": ("copy", None),
    "new_ones": ("full", 1), "new_zeros": ("full", 0), "new_full": ("full_like", None),
}
# Ops whose result is a new tensor, never a view of an argument (so `x op= y` on it changes no
# other value).
_FRESH = {"arith", "compare", "logic", "not", "neg", "arange", "cumsum", "diff", "where", "full", "full_like", "copy"}


class _Evaluator:
    """Symbolic values of the nodes computed from sizes alone (Note [causal masks])."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.memo: dict = {}
        self.visited: set = set()
        self.writers: dict = {}     # storage (its address) -> the in-place nodes that write into it
        self.unknown_writes = False
        for n in gm.graph.nodes:
            for t in mutated_values(n):
                key = _storage(t)
                self.unknown_writes |= key is None
                self.writers.setdefault(key, []).append(n)

    # - values -
    def value(self, node) -> Optional[_Val]:
        if not isinstance(node, fx.Node):
            return _constant(node)
        if node not in self.memo:
            self.memo[node] = None      # cycles cannot happen in a graph; the guard is for safety
            self.visited.add(node)
            try:
                self.memo[node] = self._eval(node)
            except Exception:   # anything a rule or sympy cannot do: unproven, so left alone
                self.memo[node] = None
        return self.memo[node]

    def _eval(self, node: fx.Node) -> Optional[_Val]:
        ex = node.meta.get("example_value")
        if isinstance(ex, (torch.SymInt, int)) and not isinstance(ex, bool):
            return _Val((), _size(ex), "int")      # a size: exact whatever computed it
        if node.op != "call_function" and node.op != "call_method":
            return None
        if not isinstance(ex, torch.Tensor) or _kind(ex.dtype) is None or not self._unaliased(node):
            return None
        rule = (_METHODS.get(node.target) if node.op == "call_method" else _FUNCTIONS.get(node.target))
        if rule is None:
            return None
        shape = tuple(_size(s) for s in ex.shape)
        if len(shape) > len(_IDX):
            return None
        kind, op = rule
        out = getattr(self, f"_{kind}")(node, op, shape, _kind(ex.dtype))
        if out is None or out.kind != _kind(ex.dtype):
            return None
        return out

    def _unaliased(self, node: fx.Node) -> bool:
        """No in-place update writes into the storage of a value this node reads (fake tensors
        share a storage with their views), other than `x op= y` on a fresh x that nothing else
        reads, which is then an ordinary op: as `node` itself, or as the input it reads."""
        if self.unknown_writes:
            return False
        for a in node.all_input_nodes:
            for w in self.writers.get(_storage(a), []):
                if not ((w is node or w is a) and _plain_inplace(w)):
                    return False
        return True

    def unwritten(self, node: fx.Node) -> bool:
        """Whether the value a node computed is the one a later reader sees (no in-place update
        after it writes into its storage)."""
        return not self.unknown_writes and all(w is node and _plain_inplace(w)
                                               for w in self.writers.get(_storage(node), []))

    def _arg(self, node, i, name, default=None):
        if len(node.args) > i:
            return node.args[i]
        return node.kwargs.get(name, default)

    # - rules: (node, op, output shape, output kind) -> _Val or None -
    def _binary(self, node, shape):
        if len(node.args) != 2 or set(node.kwargs) - {"out"} or node.kwargs.get("out") is not None:
            return None
        a, b = self.value(node.args[0]), self.value(node.args[1])
        if a is None or b is None:
            return None
        ea, eb = _broadcast(a, shape), _broadcast(b, shape)
        if ea is None or eb is None:
            return None
        return a, b, ea, eb

    def _arith(self, node, op, shape, kind):
        got = self._binary(node, shape)
        if got is None or got[0].kind != "int" or got[1].kind != "int":
            return None
        return _Val(shape, sympy.expand(_ARITH[op](got[2], got[3])), "int")

    def _inplace(self, node, op, shape, kind):
        return (self._logic if op in _LOGIC else self._arith)(node, op, shape, kind)

    def _compare(self, node, op, shape, kind):
        got = self._binary(node, shape)
        if got is None or got[0].kind != "int" or got[1].kind != "int":
            return None
        return _Val(shape, _COMPARE[op](got[2], got[3]), "bool")

    def _logic(self, node, op, shape, kind):
        got = self._binary(node, shape)
        if got is None or got[0].kind != "bool" or got[1].kind != "bool":
            return None
        return _Val(shape, _LOGIC[op](got[2], got[3]), "bool")

    def _not(self, node, op, shape, kind):
        a = self.value(node.args[0]) if len(node.args) == 1 and not node.kwargs else None
        if a is None or a.kind != "bool" or a.shape != shape:
            return None
        return _Val(shape, sympy.Not(a.value), "bool")

    def _neg(self, node, op, shape, kind):
        a = self.value(node.args[0]) if len(node.args) == 1 and not node.kwargs else None
        if a is None or a.kind != "int" or a.shape != shape:
            return None
        return _Val(shape, -a.value, "int")

    def _where(self, node, op, shape, kind):
        if len(node.args) != 3 or node.kwargs:
            return None
        c, a, b = (self.value(x) for x in node.args)
        if c is None or a is None or b is None or c.kind != "bool" or a.kind != kind or b.kind != kind:
            return None
        ec, ea, eb = (_broadcast(v, shape) for v in (c, a, b))
        if ec is None or ea is None or eb is None:
            return None
        if kind == "bool":
            return _Val(shape, sympy.Or(sympy.And(ec, ea), sympy.And(sympy.Not(ec), eb)), "bool")
        return _Val(shape, sympy.Piecewise((ea, ec), (eb, True)), "int")

    def _arange(self, node, op, shape, kind):
        if set(node.kwargs) - {"device", "dtype", "layout", "pin_memory", "requires_grad"} or kind != "int":
            return None
        args = list(node.args)
        if len(args) == 1:
            start, step = 0, 1
        elif len(args) in (2, 3):
            start, step = args[0], (args[2] if len(args) == 3 else 1)
        else:
            return None
        s, t = self.value(start), self.value(step)
        if s is None or t is None or s.shape or t.shape or s.kind != "int" or t.kind != "int" or len(shape) != 1:
            return None
        return _Val(shape, sympy.expand(s.value + t.value * _IDX[0]), "int")

    def _full(self, node, op, shape, kind):
        if op is None:          # torch.full(size, fill)
            fill = self._arg(node, 1, "fill_value")
        else:
            fill = op
        return _filled(fill, shape, kind)

    def _full_like(self, node, op, shape, kind):
        """full_like(x, fill) or x.new_full(size, fill)."""
        return _filled(self._arg(node, 2 if node.op == "call_method" else 1, "fill_value"), shape, kind)

    def _copy(self, node, op, shape, kind):
        if len(node.args) != 1 or set(node.kwargs) - {"memory_format"}:
            return None
        a = self.value(node.args[0])
        return a if a is not None and a.shape == shape and a.kind == kind else None

    def _cast(self, node, op, shape, kind):
        if node.target in ("contiguous", "detach") and (len(node.args) > 1 or node.kwargs):
            return None
        a = self.value(node.args[0])
        if a is None or a.shape != shape:
            return None
        if a.kind == kind:
            return a
        return _Val(shape, _as_int(a) if kind == "int" else _as_bool(a), kind)

    def _unsqueeze(self, node, op, shape, kind):
        a = self.value(node.args[0])
        dim = self._arg(node, 1, "dim")
        if a is None or not isinstance(dim, int) or len(shape) != len(a.shape) + 1:
            return None
        dim = dim + len(shape) if dim < 0 else dim
        mapping = {_IDX[j]: _IDX[j if j < dim else j + 1] for j in range(len(a.shape))}
        return _Val(shape, a.value.xreplace(mapping), a.kind)

    def _broadcast(self, node, op, shape, kind):
        a = self.value(node.args[0])
        if a is None:
            return None
        e = _broadcast(a, shape)
        return None if e is None else _Val(shape, e, a.kind)

    def _reshape(self, node, op, shape, kind):
        """A view or reshape that only inserts or removes dims of size 1."""
        a = self.value(node.args[0])
        if a is None:
            return None
        src = [j for j, s in enumerate(a.shape) if s != 1]
        dst = [k for k, s in enumerate(shape) if s != 1]
        if [a.shape[j] for j in src] != [shape[k] for k in dst]:
            return None
        mapping = {_IDX[j]: sympy.Integer(0) for j, s in enumerate(a.shape) if s == 1}
        mapping.update({_IDX[j]: _IDX[k] for j, k in zip(src, dst)})
        return _Val(shape, a.value.xreplace(mapping), a.kind)

    def _cumsum(self, node, op, shape, kind):
        a = self.value(node.args[0])
        dim = self._arg(node, 1, "dim")
        if a is None or not isinstance(dim, int) or a.shape != shape or kind != "int" or not shape:
            return None
        if set(node.kwargs) - {"dim", "dtype"}:
            return None
        dim = dim + len(shape) if dim < 0 else dim
        i, j = _IDX[dim], sympy.Dummy("j", integer=True, nonnegative=True)
        total = sympy.summation(_as_int(a).xreplace({i: j}), (j, 0, i))
        if total.has(sympy.Sum):
            return None
        return _Val(shape, sympy.expand(total), "int")

    def _diff(self, node, op, shape, kind):
        """torch.diff(x, n=1, dim, prepend) with a prepend one element long along dim."""
        a = self.value(node.args[0])
        n = self._arg(node, 1, "n", 1)
        dim = self._arg(node, 2, "dim", -1)
        prepend, append = self._arg(node, 3, "prepend"), self._arg(node, 4, "append")
        if a is None or a.kind != "int" or n != 1 or append is not None or not isinstance(dim, int) or not shape:
            return None
        dim = dim + len(shape) if dim < 0 else dim
        i = _IDX[dim]
        at = lambda e: a.value.xreplace({i: e})   # noqa: E731
        later = sympy.expand(at(i) - at(i - 1))   # the difference at i >= 1
        if prepend is None:                       # out[i] = x[i + 1] - x[i]
            if a.shape[:dim] + a.shape[dim + 1:] != shape[:dim] + shape[dim + 1:]:
                return None
            return _Val(shape, sympy.expand(at(i + 1) - at(i)), "int")
        p = self.value(prepend)
        if p is None or p.kind != "int" or len(p.shape) != len(shape) or p.shape[dim] != 1 or a.shape != shape:
            return None
        if any(p.shape[k] != shape[k] for k in range(len(shape)) if k != dim):
            return None
        first = sympy.expand(at(sympy.Integer(0)) - p.value.xreplace({i: sympy.Integer(0)}))   # out[0] = x[0] - p
        if sympy.expand(first - later.xreplace({i: sympy.Integer(0)})) == 0:
            return _Val(shape, later, "int")
        return _Val(shape, sympy.Piecewise((first, sympy.Eq(i, 0)), (later, True)), "int")

    def _getitem(self, node, op, shape, kind):
        a = self.value(node.args[0])
        idx = node.args[1] if len(node.args) == 2 else None
        if a is None or idx is None:
            return None
        idx = idx if isinstance(idx, tuple) else (idx,)
        tensors = [isinstance(e, fx.Node) and isinstance(e.meta.get("example_value"), torch.Tensor) for e in idx]
        if any(tensors):
            return self._advanced_index(a, idx, tensors, shape)
        return self._basic_index(a, idx, shape)

    def _basic_index(self, a: _Val, idx, shape):
        if sum(e is Ellipsis for e in idx) > 1:
            return None
        used = sum(e is not None and e is not Ellipsis for e in idx)
        entries = []
        for e in idx:
            entries.extend([slice(None)] * (len(a.shape) - used) if e is Ellipsis else [e])
        entries.extend([slice(None)] * (len(a.shape) - sum(e is not None for e in entries)))
        mapping, j, k = {}, 0, 0
        for e in entries:
            if e is None:
                k += 1
                continue
            if j >= len(a.shape):
                return None
            if isinstance(e, slice):
                start, step = (self.value(x) if x is not None else None for x in (e.start, e.step))
                if (e.start is not None and (start is None or not _nonneg_int(start))) or \
                        (e.step is not None and (step is None or not _positive_int(step))):
                    return None
                s0 = start.value if start is not None else sympy.Integer(0)
                st = step.value if step is not None else sympy.Integer(1)
                mapping[_IDX[j]] = s0 + st * _IDX[k]
                k += 1
            else:
                v = self.value(e)
                if v is None or v.shape or v.kind != "int" or not v.value.is_Integer:
                    return None
                c = int(v.value)
                if c < 0:
                    if not a.shape[j].is_Integer:
                        return None
                    c += int(a.shape[j])
                mapping[_IDX[j]] = sympy.Integer(c)
            j += 1
        if k != len(shape) or j != len(a.shape):
            return None
        return _Val(shape, a.value.xreplace(mapping), a.kind)

    def _advanced_index(self, a: _Val, idx, tensors, shape):
        """x[i0, i1, ..., :, ...]: integer index tensors on the leading dims, then full slices."""
        t = sum(tensors)
        if not all(tensors[:t]) or any(e != slice(None) for e in idx[t:]) or t > len(a.shape):
            return None
        rest = len(a.shape) - t
        nb = len(shape) - rest
        if nb < 0 or list(shape[nb:]) != list(a.shape[t:]):
            return None
        mapping = {}
        for j in range(t):
            v = self.value(idx[j])
            if v is None or v.kind != "int":
                return None
            e = _broadcast(v, shape[:nb])
            if e is None or not _in_range(e, shape, a.shape[j]):
                return None
            mapping[_IDX[j]] = e
        for j in range(t, len(a.shape)):
            mapping[_IDX[j]] = _IDX[nb + j - t]
        return _Val(shape, a.value.xreplace(mapping), a.kind)


def _storage(node):
    ev = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(ev, torch.Tensor):
        return None
    try:
        return StorageWeakRef(ev.untyped_storage()).cdata
    except Exception:   # a tensor without a plain storage
        return None


def _plain_inplace(node: fx.Node) -> bool:
    """`x op= y` (operator.iadd and kin) on an x that a fresh op made and nothing else reads."""
    rule = _FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if rule is None or rule[0] != "inplace" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    x = node.args[0]
    src = (_FUNCTIONS.get(x.target) if x.op == "call_function" else
           _METHODS.get(x.target) if x.op == "call_method" else None)
    return len(x.users) == 1 and src is not None and src[0] in _FRESH


def _in_range(e, shape, size) -> bool:
    """Whether index expression e is in [0, size) at every index of `shape` (no wrapping)."""
    if e.is_Integer:
        return int(e) == 0 or (size.is_Integer and 0 <= int(e) < int(size))
    return any(e == _IDX[k] and shape[k] == size for k in range(len(shape)))


def _nonneg_int(v: _Val) -> bool:
    return not v.shape and v.kind == "int" and v.value.is_Integer and int(v.value) >= 0


def _positive_int(v: _Val) -> bool:
    return not v.shape and v.kind == "int" and v.value.is_Integer and int(v.value) > 0


def _filled(fill, shape, kind) -> Optional[_Val]:
    if isinstance(fill, bool):
        value = sympy.true if fill else sympy.false
        return _Val(shape, value, "bool") if kind == "bool" else _Val(shape, sympy.Integer(int(fill)), "int")
    if isinstance(fill, int):
        return _Val(shape, sympy.true if fill else sympy.false, "bool") if kind == "bool" \
            else _Val(shape, sympy.Integer(fill), "int")
    return None


def _constant(x) -> Optional[_Val]:
    if isinstance(x, bool):
        return _Val((), sympy.true if x else sympy.false, "bool")
    if isinstance(x, int):
        return _Val((), sympy.Integer(x), "int")
    if isinstance(x, torch.SymInt):
        return _Val((), x.node.expr, "int")
    return None


__all__ = ["causal_attention"]
