"""Indices into the batch's rows, and other values, made from the batch size: checked at the
microbatches' sizes.

Note [rows picked by an index]: an operation given an index tensor along the rows (`h[idx]`,
index_select, gather, a write at `idx`) picks rows whole, so the shapes Note [rows kept apart]
reads say nothing of which rows it picks. Where the index is made from the batch size alone
(`torch.arange(B)`, an arange over a (B * S) value, `torch.randperm(B)`) a microbatch makes it
from its own size, and it picks the rows eager does only where the microbatches' indices,
each numbered from their own first row, put together are the whole batch's: `arange(B)` and
`arange(B) * S + S - 1` (a sequence classifier's last token) are; `arange(B - 1, -1, -1)`,
`(arange(B) + 1) % B` and `randperm(B)` (a row paired with another row of the batch) are not
(before, they trained silently to other losses than eager's). So the index's graph (factory
calls and arithmetic on sizes) runs on the CPU at the capture's batch size and at its halves
and thirds (torch.tensor_split's, as the runner splits), twice with other random seeds, and
the pieces are compared: rows of a value laid out one after another (S entries each) or, where
the value holds the rows in blocks (`torch.cat([chosen, rejected])`), block by block. An index
read from an input (`h[partner]`, a batched argument, or an unbatched one or a buffer of rows
to pick, as it is or through arithmetic and views: _KEEPS_NUMBERS) counts the whole batch's
rows, so a microbatch picks rows past its end (an IndexError in a stage job) or its own rows by
the batch's numbers: refused as well. An index the data makes in the
forward (a router's chosen tokens, `nonzero` of a mask, an argsort of integer labels) has the
microbatch's own positions, but an order the data decides: Note [rows in an order the data
decides] follows that order.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .codegen import is_random
from .graph_utils import map_devices, mutated_values, node_value, op_name, symbol_hints

# (position of the dim argument, of the index argument) of operations given one index tensor
# along a dim of their first argument
_ALONG_DIM = {"index_select": (1, 2), "index_copy": (1, 2), "index_copy_": (1, 2), "index_add": (1, 2),
              "index_add_": (1, 2), "index_fill": (1, 2), "index_fill_": (1, 2), "index_reduce": (1, 2),
              "index_reduce_": (1, 2), "gather": (1, 2), "scatter": (1, 2), "scatter_": (1, 2),
              "scatter_add": (1, 2), "scatter_add_": (1, 2), "scatter_reduce": (1, 2), "scatter_reduce_": (1, 2),
              "take_along_dim": (2, 1)}
_SIZE = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_size(v) -> bool:
    """A size or sizes (`x.size()`): what the index's graph computes from, not data."""
    return isinstance(v, _SIZE) or (isinstance(v, (tuple, list)) and all(isinstance(d, _SIZE) for d in v))


def made_from_sizes(n: fx.Node, sized: set) -> bool:
    """Whether `n`'s value is a size, or a call's on sizes and values made from sizes only (`sized`:
    the graph's earlier such nodes): an index this check can run at other batch sizes."""
    return _is_size(node_value(n)) or (n.op in ("call_function", "call_method")
                                         and all(a in sized for a in n.all_input_nodes))


# Operations whose integer result holds its integer arguments' numbers (shifted, scaled, laid
# out otherwise), not positions of its own: what an index read from an input goes through.
_KEEPS_NUMBERS = {"add", "sub", "mul", "floordiv", "floor_divide", "remainder", "mod", "neg", "abs", "clamp",
                  "clip", "view", "reshape", "flatten", "expand", "expand_as", "unsqueeze", "squeeze", "contiguous",
                  "to", "long", "int", "getitem", "repeat", "repeat_interleave", "cat", "concat", "stack",
                  "transpose", "permute", "t", "iadd", "isub", "imul", "div", "clone", "detach", "split", "chunk",
                  "narrow", "select", "unflatten", "view_as", "reshape_as"}


def read_from_input(n: fx.Node, read: dict) -> Optional[fx.Node]:
    """The input (an argument, batched or not, or a buffer) whose integers `n`'s value holds as
    they are, or through arithmetic and views (_KEEPS_NUMBERS; `read`: the graph's earlier such
    nodes, to their input), or None: positions counted over the whole batch, if any."""
    if not _is_index(n):
        return None
    if n.op in ("placeholder", "get_attr"):
        return n
    if op_name(n) not in _KEEPS_NUMBERS:
        return None
    return next((read[a] for a in n.all_input_nodes if a in read), None)


class _DataDecided(Exception):
    """The index needs a size the data decides, or an operation this check cannot run."""


def indices_into(n: fx.Node) -> list:
    """(index node, indexed node, dim) of each integer index tensor `n` picks or writes entries
    by along a dim of a value: `h[idx]`, `h[:, idx]`, `h[idx] = v`, index_select, gather,
    scatter (their first argument), `F.embedding(idx, h)` (its table)."""
    name = op_name(n)
    if name == "embedding" and n.op == "call_function" and len(n.args) > 1 and _is_index(n.args[0]):
        table = node_value(n.args[1])
        return [(n.args[0], n.args[1], 0)] if isinstance(table, torch.Tensor) and table.dim() == 2 else []
    if not n.args or not isinstance(x := node_value(n.args[0]), torch.Tensor):
        return []
    return [(index, n.args[0], dim) for index, dim in _indices_into_first(n, name, x)]


def _indices_into_first(n: fx.Node, name, x) -> list:
    """(index node, dim) of each index tensor along a dim of `n`'s first argument (value x)."""
    if n.op == "call_function" and n.target in (operator.getitem, operator.setitem):
        return _subscript(n.args[1], x.dim())
    if name in ("index_put", "index_put_") and len(n.args) > 1:
        return _subscript(tuple(slice(None) if k is None else k for k in n.args[1]), x.dim())   # (None: a whole dim)
    if name in _ALONG_DIM:
        at, index = _ALONG_DIM[name]
        dim = n.kwargs.get("dim", n.args[at] if len(n.args) > at else None)
        idx = n.kwargs.get("index", n.kwargs.get("indices", n.args[index] if len(n.args) > index else None))
        if isinstance(dim, int) and isinstance(idx, fx.Node) and _is_index(idx):
            return [(idx, dim % max(x.dim(), 1))]
    return []


def _is_index(node) -> bool:
    v = node_value(node)
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


def _subscript(key, ndim: int) -> list:
    """The integer index tensors of a subscript and the dim each indexes."""
    key = key if isinstance(key, tuple) else (key,)
    taken = sum(1 if not (k is None or k is Ellipsis) else 0 for k in key)
    found, dim = [], 0
    for k in key:
        if k is None:
            continue
        if k is Ellipsis:
            dim += ndim - taken
            continue
        v = node_value(k)
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            dim += v.dim()
            continue
        if isinstance(k, fx.Node) and _is_index(k):
            found.append((k, dim))
        dim += 1
    return found


def picks_apart(index: fx.Node, size, info, in_blocks: bool) -> Optional[str]:
    """Why `index` (made_from_sizes), indexing a dim of `size` entries that holds the batch's rows,
    picks other rows than eager's once split into microbatches, or None: it picks them as eager
    does, or the check cannot run it (Note [rows picked by an index])."""
    batch = info.size
    splits = [[len(p) for p in torch.arange(batch).tensor_split(m)] for m in (2, 3) if m <= batch]
    program = _program(index)
    try:
        whole = _evaluate(program, info, batch, seed=0).long()
        if not torch.equal(whole, _evaluate(program, info, batch, seed=1).long()):
            return ("it is random, drawn once for the whole batch and once per microbatch, differently (to pair "
                    "rows at random across the batch, pick the partners in the data loader and pass them as a "
                    "second batched argument)")
        entries, rows = _sizes(size, info, batch), node_value(index).shape
        first = next((d for d, s in enumerate(rows) if info.mentions(s)), None)
        if first is None:
            return f"it picks fixed positions ({_shown(whole)}), which each microbatch counts from its own first row"
        for parts in splits:
            pieces = [(_evaluate(program, info, b, seed=0).long(), _sizes(size, info, b)) for b in parts]
            if not any(_assembled(whole, entries, pieces, parts, first, blocks) for blocks in
                       _layouts(entries // batch if entries % batch == 0 else 0, in_blocks)):
                return (f"it does not pick each row's entries from that row: at {batch} rows it is "
                        f"{_shown(whole)}, at the microbatches' {parts} rows "
                        f"{' and '.join(_shown(i) for i, _ in pieces)}")
    except _DataDecided:
        return None
    return None


def _shown(value: torch.Tensor) -> str:
    flat = value.flatten()[:9].tolist()
    return "[" + ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in flat[:8]) + (
        ", ...]" if len(flat) > 8 else "]")


def _layouts(per_row: int, in_blocks: bool) -> list:
    """The numbers of blocks the dim's entries may come in: 1 (each row's entries together), or
    where the value holds the rows in blocks, each divisor of the entries per row."""
    if per_row == 0:
        return []
    return [1] + ([k for k in range(2, per_row + 1) if per_row % k == 0] if in_blocks else [])


def _to_whole(v: torch.Tensor, rows: int, before: int, batch: int, per_row: int, blocks: int) -> torch.Tensor:
    """Entry positions in a microbatch's dim (`rows` rows, `per_row` entries each, in `blocks`
    blocks) as positions in the whole batch's, the microbatch's first row the batch's `before`."""
    e = per_row // blocks
    block, rest = v // (rows * e), v % (rows * e)
    return block * (batch * e) + (before + rest // e) * e + rest % e


def _assembled(whole, entries, pieces, parts, first, blocks) -> bool:
    """Whether the microbatches' indices, as positions of the whole dim and put where their own
    positions lie in the whole index, are the whole batch's index."""
    batch = sum(parts)
    per_row = entries // batch
    out, seen, before = torch.full_like(whole, -1), torch.zeros(whole.shape[first], dtype=torch.bool), 0
    at_rows = whole.shape[first] // batch if whole.shape[first] % batch == 0 else 0
    if at_rows == 0:
        return False
    at_blocks = blocks if at_rows % blocks == 0 else 1     # (the index's own positions, laid out alike)
    for (idx, n), rows in zip(pieces, parts):
        shape = list(whole.shape)
        shape[first] = rows * at_rows
        if n != rows * per_row or list(idx.shape) != shape:
            return False
        values = _to_whole(idx % n, rows, before, batch, per_row, blocks)
        where = _to_whole(torch.arange(idx.shape[first]), rows, before, batch, at_rows, at_blocks)
        out.index_copy_(first, where, values)
        seen[where] = True
        before += rows
    return bool(seen.all()) and torch.equal(out, whole % entries)


# Note [values made from sizes]: a value made from the batch size alone (factory calls and
# arithmetic on sizes, as an index above) that holds a value per row and meets the rows as a
# value, not as an index, is each row's own once split only where the microbatches' values, put
# together, are the whole batch's. A causal mask expanded over the rows (`mask.expand(B, ...)`),
# position ids (`arange(S).expand(B, S)`), `ones(B, S)` are; a row's position in the batch
# (`h + arange(B)[:, None] / B`: 0.9171 for eager's 0.9393 over 2 microbatches), a mask of the
# first half of the rows (`arange(B) < B // 2`: 0.7173 for 0.6192) and a mean written as weights
# (`(per_row * full((B,), 1 / B)).sum()`: each microbatch weighs its rows by its own size, twice
# eager's loss) trained silently and are refused. A random value (`randn(B, d)`) is drawn per
# microbatch as dropout's masks are, and not refused.
def laid_apart(value: fx.Node, info, in_blocks: bool) -> Optional[str]:
    """Why `value` (made_from_sizes; a dim of it holds the batch's rows, each row's entries
    together or, `in_blocks`, in blocks of rows) is not each row's own once split into
    microbatches, or None: the microbatches' values put together are the batch's, or the check
    cannot run it (Note [values made from sizes])."""
    batch = info.size
    shape = node_value(value).shape
    first = next(d for d, s in enumerate(shape) if info.mentions(s))
    splits = [[len(p) for p in torch.arange(batch).tensor_split(m)] for m in (2, 3) if m <= batch]
    program = _program(value)
    if any(map(is_random, program)):
        return None         # (drawn per microbatch, as dropout's masks are)
    try:
        whole = _evaluate(program, info, batch, seed=0)
        entries = _sizes(shape[first], info, batch)
        for parts in splits:
            pieces = [_evaluate(program, info, b, seed=0) for b in parts]
            if not any(_put_together(whole, pieces, first, blocks) for blocks in
                       _layouts(entries // batch if entries % batch == 0 else 0, in_blocks)):
                return (f"at {batch} rows it is {_shown(whole)}, at the microbatches' {parts} rows "
                        f"{' and '.join(map(_shown, pieces))}")
    except _DataDecided:
        return None
    return None


def _put_together(whole: torch.Tensor, pieces: list, dim: int, blocks: int) -> bool:
    """Whether the microbatches' values, one after another along `dim` (block by block), are the batch's."""
    if whole.shape[dim] % blocks:
        return False
    size, at = whole.shape[dim] // blocks, [0] * blocks
    for piece in pieces:
        if piece.dim() != whole.dim() or piece.shape[dim] % blocks:
            return False
        for j, part in enumerate(piece.tensor_split(blocks, dim)):
            if at[j] + part.shape[dim] > size or not _same(part, whole.narrow(dim, j * size + at[j], part.shape[dim])):
                return False
            at[j] += part.shape[dim]
    return all(a == size for a in at)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN to NaN), each dim both expand (stride 0) compared once: a mask expanded
    over the rows is one row."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    for d in range(a.dim()):
        if a.stride(d) == 0 and b.stride(d) == 0 and a.shape[d] > 1:
            a, b = a.narrow(d, 0, 1), b.narrow(d, 0, 1)
    return torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | a.isnan() & b.isnan()).all()))


def _sizes(size, info, batch: int) -> int:
    return int(_substituted(size, info, batch))


def _substituted(value, info, batch: int):
    """A size (SymInt, SymFloat, SymBool or a number) at `batch` rows, the other sizes at the capture's."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    expr = value.node.expr
    hints = symbol_hints(value.node.shape_env)
    values = {}
    for s in expr.free_symbols:
        if s in info.symbols:
            values[s] = batch
        elif s in hints:
            values[s] = hints[s]
        else:
            raise _DataDecided      # (an unbacked size: the data decides it)
    out = expr.xreplace(values)
    return bool(out) if isinstance(value, torch.SymBool) else (int(out) if isinstance(value, torch.SymInt)
                                                              else float(out))


def _program(index: fx.Node) -> list:
    """The index's ancestors up to sizes (made_from_sizes), each after its arguments, the index last."""
    order, done, stack = [], set(), [(index, False)]
    while stack:
        m, expanded = stack.pop()
        if expanded:
            order.append(m)
        elif m not in done:
            done.add(m)
            stack.append((m, True))
            stack.extend((a, False) for a in (() if _is_size(node_value(m)) else m.all_input_nodes) if a not in done)
    return order


def _evaluate(program: list, info, batch: int, seed: int) -> torch.Tensor:
    """The index's value at `batch` rows: its program (_program) of sizes and factory calls run on the CPU."""
    values = {}
    cpu = {"cuda": torch.device("cpu"), "meta": torch.device("cpu")}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for m in program:
            v = node_value(m)
            if _is_size(v):
                values[m] = (type(v)(_substituted(d, info, batch) for d in v) if isinstance(v, (tuple, list))
                             else _substituted(v, info, batch))
                continue
            args, kwargs = fx.node.map_arg((m.args, m.kwargs), values.__getitem__)
            args, kwargs = map_devices(args, cpu), map_devices(kwargs, cpu)
            try:
                fn = getattr(args[0], m.target) if m.op == "call_method" else m.target
                values[m] = fn(*(args[1:] if m.op == "call_method" else args), **kwargs)
            except Exception as e:   # noqa: BLE001 - an operation this check cannot run: not checked
                raise _DataDecided from e
    out = values[program[-1]]
    if not isinstance(out, torch.Tensor):
        raise _DataDecided
    return out



# Note [rows in an order the data decides]: an argsort (or a sort) of integers along the
# rows (a label per row, each token's expert) orders the batch's rows by their data, and each
# microbatch orders only its own. The rows read in that order (`h[labels.argsort()]`) are then
# fine on their own (row by row, reduced over), but a value computed from them and from rows in
# another order (the batch's own: `h - h[order]`, the targets of a loss) pairs rows with other
# rows than eager's once split: `h - 0.25 * h[order]` trained silently to 0.757 for eager's
# 0.742. So each value's order is followed as a word of the permutations the data made (the
# empty word: the batch's own order): a read at an index composes the value's order with the
# index's (the order its positions pick rows in), a write at an index composes the written
# value's with the index's inverse, an argsort of a permutation is its inverse; an operation on
# rows of two orders, or an output of rows in an order the data made, is refused. A value that
# holds nothing of the rows (zeros_like, an arange) takes any order. An MoE's tokens sorted by
# expert meet only rows of their order (their routing weights, read at the same permutation) and
# are read back at its inverse (`inv_perm[perm] = arange`, then `out[inv_perm]`) or added back
# at their token positions, so they train as before. A slice of such a value (`argsort()[:2]`,
# the rows of the smallest keys) keeps rows by their rank in the batch: refused too, as a topk
# or argmax of integers along the rows is (_BY_RANK in batch.py). The positions of a mask's true
# entries (`nonzero`, `where(mask)`) count the rows in the mask's order: read at them, a value in
# another order gives other rows (`h[mask[order].nonzero()[:, 0]]`: 0.793 for eager's 0.908),
# refused; a value in the mask's order (an MoE's tokens sorted by expert) reads its own.
_SORTS = {"sort": (1, "dim", -1), "argsort": (1, "dim", -1), "msort": (None, None, 0)}
_PARTS = {"getitem", "narrow", "select"}
# (pieces of sizes the data decides hold every row between them, JetMoE's groups per expert; a
# piece of a size made from sizes, `order.split([2, B - 2])[0]`, is some of the rows, by rank)
_SPLITS = {"split", "split_with_sizes", "tensor_split", "chunk", "unbind"}
_READS = {"getitem", "index_select", "gather", "take_along_dim", "embedding"}
_POSITIONS = {"nonzero", "argwhere", "nonzero_static", "where"}    # (where of a mask alone)
_ANY = "any order"      # (a value holding nothing of the rows: zeros_like, an arange)


def _composed(first: tuple, then: tuple) -> tuple:
    """The order of rows read in order `then` from a value in order `first`."""
    out = list(first)
    for node, power in then:
        if out and out[-1] == (node, -power):
            out.pop()
        else:
            out.append((node, power))
    return tuple(out)


def _inverse(word: tuple) -> tuple:
    return tuple((node, -power) for node, power in reversed(word))


def _written(n: fx.Node):
    """The value a write at an index writes: `v` of `x[idx] = v`, index_put's, index_copy's source."""
    if op_name(n) in ("setitem", "index_put", "index_put_"):
        return n.args[2] if len(n.args) > 2 else n.kwargs.get("values")
    return n.args[3] if len(n.args) > 3 else next((n.kwargs[k] for k in ("source", "src", "value") if k in n.kwargs),
                                                  None)


class RowOrders:
    """The order of the batch's rows in each value of a graph, node by node (Note [rows in an
    order the data decides])."""

    def __init__(self, info):
        self.info = info
        self.order: dict = {}     # node -> word, or _ANY; a node not here: the batch's own order
        self.picks: dict = {}     # integer node -> word: the order its positions pick rows in
        self.counted: dict = {}   # integer node -> word: the order its positions count the rows in

    def step(self, n: fx.Node, rows: set, sized: set, valueless: bool) -> Optional[str]:
        """Follow `n` (after the graph's earlier nodes); why it pairs rows of two orders, keeps rows
        by their rank in one, or returns rows in one; or None."""
        if n.op == "output":
            return self._returned(n, rows)
        if n.op not in ("call_function", "call_method", "call_module"):
            return None
        if n in sized or valueless:
            self.order[n] = _ANY
            return None
        if (word := self._sorted(n)) is not None:
            self.order[n], self.picks[n] = word
            return None
        if (counted := self._positions(n)) is not None:
            self.counted[n] = counted
        along = [(index, indexed) for index, indexed, dim in indices_into(n)
                 if self.info.mentions(node_value(indexed).shape[dim])]
        if along and op_name(n) in _READS:
            index, indexed = along[0]
            if self.counted.get(index, ()) not in ((), self._word(indexed)):
                return (f"`{n.name}` reads rows at positions counted in an order the data decides "
                        f"({self._made(self.counted[index])}), of rows in another order: eager orders the whole "
                        f"batch's rows, each microbatch only its own, so split, it reads other rows than eager's")
            self._set(n, _composed(self._word(indexed), self.picks.get(index, ())),
                      _composed(self.picks.get(indexed, ()), self.picks.get(index, ())))
            return None
        if along:
            return self._write(n, *along[0])
        orders = {self.order.get(a, ()) for a in n.all_input_nodes if a in rows} - {_ANY}
        if len(orders) > 1:
            return self._mixed(n, orders)
        if orders and (word := next(iter(orders))) and op_name(n) in _PARTS | _SPLITS and self._a_part(n):
            return (f"`{n.name}` keeps some of the rows by their rank in an order the data decides "
                    f"({self._made(word)}): eager ranks the whole batch's rows, each microbatch only its own, so "
                    f"split, it keeps other rows than eager's")
        if n in rows:
            self._set(n, orders.pop() if orders else _ANY if any(a in rows for a in n.all_input_nodes) else (),
                      next((self.picks[a] for a in n.all_input_nodes if a in self.picks), ())
                      if op_name(n) in _KEEPS_NUMBERS else ())
        return None

    def _positions(self, n: fx.Node) -> Optional[tuple]:
        """The order in which the positions `n` holds count the rows: a mask's true entries
        (_POSITIONS) in the mask's order, or such positions laid out otherwise (_KEEPS_NUMBERS of
        them); None for other values, or the batch's own order."""
        name = op_name(n)
        if name in _POSITIONS and (name != "where" or len(n.args) + len(n.kwargs) == 1) and n.args:
            word = self._word(n.args[0]) if isinstance(n.args[0], fx.Node) else ()
        elif name in _KEEPS_NUMBERS and n.args and n.args[0] in self.counted and _is_index(n):
            word = self.counted[n.args[0]]
        else:
            return None
        return word or None

    def _a_part(self, n: fx.Node) -> bool:
        """Whether `n`'s value (a slice, or a split's pieces) holds fewer whole rows dims than its
        first argument: some of the rows, not all (a split's piece of a size the data decides
        is a group of rows, not a part: _SPLITS)."""
        x = node_value(n.args[0])
        if not isinstance(x, torch.Tensor):
            return False        # (a tuple's tensor: `torch.sort(k).indices`)
        whole = sum(map(self.info.whole_rows, x.shape))
        return any(sum(map(self.info.whole_rows, t.shape)) < whole for t in
                   torch.utils._pytree.tree_leaves(node_value(n)) if isinstance(t, torch.Tensor)
                   and not (op_name(n) in _SPLITS and free_unbacked_symbols(t)))

    def _word(self, node) -> tuple:
        word = self.order.get(node, ())
        return () if word is _ANY else word

    def _set(self, n: fx.Node, order, picks: tuple) -> None:
        if order:
            self.order[n] = order
        if picks and _is_index(n):
            self.picks[n] = picks

    def _sorted(self, n: fx.Node) -> Optional[tuple]:
        """(order, picks) of a sort of integers along the rows (a new permutation of them, or a
        permutation's inverse: the argsort of one), or None."""
        name = op_name(n)
        if name not in _SORTS or not n.args or not _is_index(n.args[0]):
            return None
        x = node_value(n.args[0])
        at, key, default = _SORTS[name]
        dim = n.kwargs.get(key, n.args[at] if at is not None and len(n.args) > at else default) if key else default
        if not isinstance(dim, int) or x.dim() == 0 or not self.info.mentions(x.shape[dim]):
            return None
        if name == "argsort" and self.picks.get(n.args[0]):
            return (), _inverse(self.picks[n.args[0]])
        return ((n, 1),), ((n, 1),)

    def _write(self, n: fx.Node, index: fx.Node, target: fx.Node) -> Optional[str]:
        """Follow a write at `index` into `target`'s rows: the written value's rows land where the
        index's positions say, so in its order composed with the index's inverse."""
        value = _written(n)
        undone = _inverse(self.picks.get(index, ()))
        order = self.order.get(target, ())
        if isinstance(value, fx.Node) and isinstance(node_value(value), torch.Tensor):
            written = self.order.get(value, ())
            if written is not _ANY:
                landed = _composed(written, undone)
                if order is not _ANY and order != landed:
                    return self._mixed(n, {order, landed})
                order = landed
            picks = _composed(self.picks.get(value, ()), undone) if value in self.picks or written is _ANY else ()
        else:
            picks = ()
        for m in [n] + mutated_values(n):
            self.order.pop(m, None)
            self.picks.pop(m, None)
            self._set(m, order, picks)
        return None

    def _returned(self, n: fx.Node, rows: set) -> Optional[str]:
        for a in n.all_input_nodes:
            word = self.order.get(a, ())
            if a in rows and word and word is not _ANY:
                return (f"`{a.name}`, an output, holds the batch's rows in an order the data decides "
                        f"({self._made(word)}): eager orders the whole batch's rows, each microbatch only its own, "
                        f"and the microbatches' outputs put together are not in eager's order")
        return None

    def _mixed(self, n: fx.Node, orders: set) -> str:
        word = next(w for w in sorted(orders, key=len, reverse=True) if w)
        return (f"`{n.name}` pairs rows in an order the data decides ({self._made(word)}) with rows in another "
                f"order: eager orders the whole batch's rows, each microbatch only its own, so split, rows meet "
                f"other rows than eager's (order the rows in the data loader instead, or put them back, "
                f"`h[order.argsort()]`, before they meet other rows)")

    @staticmethod
    def _made(word: tuple) -> str:
        from .batch import model_line        # (batch imports this module)
        root = word[0][0]
        name = op_name(root)
        article = "an" if name[0] in "aeiou" else "a"
        return f"`{root.name}`, {article} {name} of integers along the rows{model_line(root)}"
