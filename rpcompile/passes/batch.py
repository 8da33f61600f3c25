"""Which call inputs are batched, and what each stage checks of the batched values it reads.

Note [batched inputs]: a step splits dim 0 of the batched call inputs into microbatches, and
every stage job computes from its microbatch's slices only. A value derived from a batched
input (an attention mask turned into a 4-d mask, position ids, rotary tables) is computed in
the stage graphs from the sliced input, never cached across microbatches, so the one thing to
get right is *which* inputs are split. The rule:

- The batch size B is dim 0 of the first tensor argument (rpcompile.compile), or of the
  first input whose dim 0 is dynamic (the dynamo backend).
- Every tensor input with dim 0 == B is batched, unless the user names it in
  `Config(unbatched_inputs=...)`. At capture each of them gets a dynamic dim 0 (dynamo may
  give each its own symbol: an attention mask is `s75` while the ids are `s33`); all those
  symbols are batch symbols, bound to the microbatch's rows.
- A tensor input whose dim 0 is neither B nor 1 but whose other sizes are a batched input's
  (an attention mask short of a row) is an InputError at capture, unless named unbatched: taken
  as unbatched, every microbatch read its first rows (capture._refuse_short_rows).
- An input with dim 0 == B whose size the captured graph fixed (the model specialised it),
  or a batch symbol the graph also uses for another dimension (dynamo's duck sizing gave
  equal sizes one symbol), cannot be split soundly: with more than one microbatch that is an
  error naming the input, never a guess.

At run time a stage job checks, before it uses a microbatch's value that the plan says is
batched (an input, an activation, a gradient), that its dim 0 is what the plan's expression
gives for that microbatch (`row_checks`). The check is not optional: a mismatch is a
StageError naming the value and the stage.

Note [rows kept apart]: split into microbatches, a forward that computes one row from other rows
sees only its microbatch's rows, and its result is not eager's, silently: an in-batch contrastive
loss (`u @ v.T` scored against `arange(B)`: 7.72 where eager gives 12.31 over 2 microbatches) or
rows centred on the batch's mean (`h - h.mean(0)`). With more than one microbatch such a forward
is an InputError naming the model's line: a value with the batch size in two dims (rows against
rows), a batched floating-point value computed from one that a reduction over the rows made
(`mean(0)`, a contraction over the batch), or an operation along the rows that keeps the shape (a
softmax, a cumulative sum, a sort, a flip over dim 0, a layer or RMS norm whose normalized shape
takes in the rows, a softmax without dim over a 3-D value, a topk or argmax over the rows that
picks rows by comparing them: `_ALONG`; an attention along the rows: `_ATTENDS`), or a value
holding a part of the rows picked by position (`chosen, rejected = scores.chunk(2)`, DPO's
concatenated batch: a size of the batch size halved or less one, not proportional to it:
BatchInfo.whole_rows; the same halves of `torch.cat([chosen, rejected])`, two batched arguments,
are whole rows, and a sum over them a sum over rows; a call's outputs, put together from the
microbatches' along dim 0, must not hold them in blocks either: rows_in_blocks, refused in
_describe_io). Integer values (an MoE's counts of tokens per expert, routing indices, a count of a
class's rows) lay rows out (a grouped matmul's offsets, a split's sizes, indices) and are followed
only into arithmetic: a count over the rows that scales the rows (`h / mask.sum()`, a cast, an
elementwise function of it: ARITHMETIC, _counts_rows; counts per value of the rows, `bincount`,
`unique` and its inverse: _SLOTS; a number the data decides, `.item()`, `nonzero().shape[0]`) is a
reduction over them (a number used as a size or a bound lays rows out too: each row's own values
cropped to the columns the batch's longest row uses, `ids[:, :lengths.max().item()]`, as BLT's
patcher pads its patches, and the positions `arange(n)`: _takes_count), and rows scaled by the
batch size (`h / x.shape[0]`, which a microbatch takes as its own rows': _counts_the_batch) are
refused; a value whose size the
data decides, made from the rows (u0 + u1: JetMoE's tokens grouped per expert by counts read off
the router, rows picked by a mask), holds rows as they do (_holds_rows),
and an operation given indices (`x[token]`, a gather) picks rows whole rather than reducing them,
unless it sums them per index (`index_add`, `scatter_add`: a centroid per class is a reduction)
or writes them by index into a value that does not hold the rows (`last[labels] = h`, index_copy,
scatter: a row per class, the last written; in place, its later readers read rows: _INDEX_WRITES),
and the rows an index made from the batch size picks are checked at the microbatches' sizes
(`arange(B)` picks each row's own, `arange(B - 1, -1, -1)` not), an index read from a batched
argument refused (Note [rows picked by an index]), as is any other value made from the batch size
alone that is not each row's own (`arange(B) / B`: Note [values made from sizes]);
batch norm's statistics are one operation's business, per microbatch as under gradient
accumulation (checked against that), and are not refused.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch
import torch._functorch.predispatch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..errors import InputError
from .batch_index import RowOrders, indices_into, laid_apart, made_from_sizes, picks_apart, read_from_input
from .graph_utils import call_leaf_name, mutated_values, node_value, op_name, size_hint


@dataclass
class BatchInfo:
    """What the capture says about the batch (see Note [batched inputs])."""

    size: Optional[int] = None                          # B at capture
    symbols: frozenset = frozenset()                    # sympy symbols of the batched inputs' dim 0
    leaves: set = field(default_factory=set)            # call leaf indices split on dim 0
    fixed: list = field(default_factory=list)           # names of inputs of dim 0 == B the graph fixed
    fixed_at: dict = field(default_factory=dict)        # name -> the model's line that fixed it (fixed_where)
    shared: list = field(default_factory=list)          # (input name, dim): a batch symbol used elsewhere
    static: bool = False                                # no batch, and every input's shape static (dynamic=False)

    def is_batch_dim(self, size) -> bool:
        """Whether a size (int or SymInt) of a value is a batch symbol."""
        return isinstance(size, torch.SymInt) and size.node.expr in self.symbols

    def whole_rows(self, size) -> bool:
        """Whether a size depends on the batch size and is proportional to it, every batch symbol
        taken as the microbatch's rows, the other sizes as they are: the rows of batched values,
        each the same number of entries (a view of (batch, seq, ...) as (batch * seq, ...): an
        MoE's router logits), one value after another (`torch.cat([chosen, rejected])`: s1 + s2
        rows; its halves, `chunk(2)`: (s1 + s2 + 1)//2 rows each), which microbatches' values
        concatenate into (in blocks or not: rows_in_blocks). Not a part of the rows picked by
        position (`h.chunk(2)`, `h[1:]`: (s1 + 1)//2, s1 - 1 rows), which each microbatch would
        count from its own first row (Note [rows kept apart])."""
        if not self.mentions(size):
            return False
        expr = size.node.expr
        return expr in self.symbols or _proportional(expr, frozenset(self.symbols & expr.free_symbols))

    def split(self, num_microbatches: int) -> bool:
        """Whether the batch is split into microbatches: more than one, of batched inputs of more
        than one row."""
        return num_microbatches > 1 and bool(self.leaves) and (self.size or 0) > 1

    def mentions(self, size) -> bool:
        """Whether a size depends on the batch size."""
        return isinstance(size, torch.SymInt) and bool(self.symbols & size.node.expr.free_symbols)

    def shape_text(self, shape) -> str:
        """A shape as an error shows it, each batch symbol named `batch`: `(batch, batch)`,
        `((batch + 1)//2, 8)`, not dynamo's `(s10, s10)`."""
        batch = sympy.Symbol("batch", integer=True, positive=True)
        dims = [_unwrapped(str(d.node.expr.xreplace({s: batch for s in self.symbols})))
                if isinstance(d, torch.SymInt) else str(d) for d in shape]
        return f"({', '.join(dims)}{',' * (len(dims) == 1)})"


def _unwrapped(text: str) -> str:
    """`(batch + 1)//2` for sympy's `((batch + 1)//2)`: one pair of parentheses around it all dropped."""
    depth = 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0 and i < len(text) - 1:
            return text
    return text[1:-1] if text.startswith("(") else text


@functools.lru_cache(maxsize=4096)
def _proportional(expr: sympy.Expr, rows: frozenset) -> bool:
    """Whether expr over the batch size is one number, every symbol of `rows` at the batch size,
    the others at two values (a factor, not a term, of theirs): BatchInfo.whole_rows."""
    others = expr.free_symbols - rows
    for at in (3, 10):
        ratios = set()
        for v in (1, 2, 3, 5, 8, 13):
            value = sympy.sympify(expr.xreplace({**{s: sympy.Integer(at) for s in others},
                                                 **{s: sympy.Integer(v) for s in rows}}))
            if not value.is_number:
                return False
            ratios.add(sympy.Rational(value) / v)
        if len(ratios) > 1:
            return False
    return True


LOSS_TARGET = "__rp_target__"     # the keyword train_step passes a loss_fn's target under


def leaf_names(args, kwargs) -> list:
    """A readable name per pytree leaf of a call: `input_ids`, `args[0]`, `batch['mask']`,
    `target` (a loss_fn's target)."""
    paths, _ = torch.utils._pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = []
    for path, _ in paths:
        top, rest = path[0].idx, path[1:]
        if top == 0:
            head = f"args[{rest[0].idx}]"
        else:
            head = "target" if rest[0].key == LOSS_TARGET else str(rest[0].key)
        names.append(head + "".join(str(k) for k in rest[1:]))
    return names


def is_unbatched(name: str, unbatched) -> bool:
    """Whether a leaf name is one the user excluded from splitting (Config.unbatched_inputs):
    the argument itself or anything inside it."""
    for u in unbatched or ():
        u = f"args[{u}]" if isinstance(u, int) else str(u)
        if name == u or name.startswith(u + "[") or name.startswith(u + "."):
            return True
    return False


def _input_name(node: fx.Node) -> str:
    """An input's name: the call's argument (`batch['mask']`), or a parameter's or buffer's fqn."""
    return node.meta.get("rp_leaf_name") or node.meta.get("rp_name") or node.name


def _state_symbols(gm: fx.GraphModule) -> set:
    """The size symbols of the graph's module state (parameters, buffers, module attributes): a
    size a module holds is no batch. Longrope's frequency update (Phi-3, a graph of its own
    through the backend) takes frequencies of a dynamic length beside the buffer they are
    written to: taken as the batch, they were split per microbatch (a StageError)."""
    out = set()
    for n in gm.graph.find_nodes(op="placeholder"):
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and (n.meta.get("rp_kind") in ("param", "buffer")
                                             or n.meta.get("rp_module_state")):
            for s in ev.shape:
                if isinstance(s, torch.SymInt):
                    out |= s.node.expr.free_symbols
    return out


def find_batch(gm: fx.GraphModule, batch_size: Optional[int], unbatched=()) -> BatchInfo:
    """The batched inputs of a captured graph (placeholders with rp_kind "input")."""
    inputs = []
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value") if n.op == "placeholder" else None
        if (n.meta.get("rp_kind") == "input" and not n.meta.get("rp_module_state")
                and isinstance(ev, torch.Tensor) and ev.dim() >= 1):
            inputs.append((n, ev))
    B = batch_size
    if B is None:   # the dynamo backend: the first input whose dim 0 is dynamic and sizes no module state
        state = _state_symbols(gm)
        B = next((size_hint(ev.shape[0]) for _, ev in inputs if isinstance(ev.shape[0], torch.SymInt)
                  and not ev.shape[0].node.expr.free_symbols & state), None)
    info = BatchInfo(size=B)
    if B is None:
        info.static = bool(inputs) and not any(isinstance(d, torch.SymInt) for _, ev in inputs for d in ev.shape)
        return info
    symbols = set()
    for n, ev in inputs:
        name = _input_name(n)
        if is_unbatched(name, unbatched):
            continue
        d0 = ev.shape[0]
        if size_hint(d0) != B:
            continue
        if isinstance(d0, torch.SymInt) and d0.node.expr.is_Symbol:
            info.leaves.add(n.meta["rp_index"])
            symbols.add(d0.node.expr)
        else:
            info.fixed.append(name)
            where = fixed_where(ev, name)
            if where:
                info.fixed_at[name] = where
    info.symbols = frozenset(symbols)
    for n, ev in inputs:
        for d, s in enumerate(ev.shape):
            if d == 0 and n.meta["rp_index"] in info.leaves:
                continue
            if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & info.symbols:
                info.shared.append((_input_name(n), d))
    return info


def _source_leaf(source: str) -> Optional[str]:
    """The leaf name (call_leaf_name) of a dim-0 size source of the call, as
    "L['k']['pixel_values'].size()[0]" -> "pixel_values"; None for another size."""
    if not source.startswith("L[") or not source.endswith(".size()[0]"):
        return None
    return call_leaf_name(source[: -len(".size()[0]")])


def fixed_where(ev, name: str) -> Optional[str]:
    """Where the capture fixed dim 0 of the input `name` (the model's line whose guard made its size
    symbol a constant: `image_features = list(image_features)  # .../modeling_llava.py:164 in
    get_image_features`), or None. Read off the ShapeEnv of the input's fake value: the size symbol
    dynamo gave the dim (its sources) and the first guard on it (its source location)."""
    env = getattr(getattr(ev, "fake_mode", None), "shape_env", None)
    if env is None:
        return None
    try:
        symbols = set()
        for sym, sources in getattr(env, "var_to_sources", {}).items():
            for src in sources:
                text = src.name() if callable(src.name) else src.name
                if _source_leaf(str(text)) == name:
                    symbols.add(sym)
        for guard in env.guards:
            if symbols & guard.expr.free_symbols:
                loc = getattr(guard, "sloc", None)
                return (getattr(loc, "maybe_user_loc", None) or str(loc)).strip() if loc is not None else None
    except Exception:   # noqa: BLE001 - another torch's ShapeEnv: the error says less, nothing else changes
        return None
    return None


def check_splittable(info: BatchInfo, num_microbatches: int) -> None:
    """Raise an InputError where a split would pair rows wrongly (Note [batched inputs])."""
    if not info.split(num_microbatches):
        return
    if info.fixed:
        at = "".join(f"; {name!r} at `{where}`" for name, where in info.fixed_at.items())
        raise InputError(
            f"input(s) {', '.join(map(repr, info.fixed))} have dim 0 of size {info.size}, the batch size, but the "
            f"captured graph fixed that size (the model code specialised it{at}), so rpcompile cannot split them "
            f"into {num_microbatches} microbatches beside the other batched inputs. If such an input is not batched, "
            "name it in Config(unbatched_inputs=[...]); if it is, keep its dim 0 dynamic in the model (no branch, "
            "reshape or Python list over the batch: `list(x)`, `x.split(counts.tolist())`, as some "
            "vision-language models do with their images), or use num_microbatches=1.")
    if info.shared:
        where = ", ".join(f"{name!r} dim {d}" for name, d in info.shared)
        raise InputError(
            f"the batch size {info.size} is also the size of {where}, and the capture gave them one symbol, so a "
            f"microbatch would change both. Use a batch size that differs from the other dimensions, or mark only the "
            "batch dimension dynamic (torch._dynamo.mark_dynamic(x, 0) instead of dynamic=True).")


_FRESH = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}   # (a value of its own)
_add_batch_dim = getattr(torch._functorch.predispatch, "_add_batch_dim", None)
# Operations that compute each entry from the others along their dims, keeping the shape (a
# function's or a method's name: position of the dims argument, its keyword, its default; None
# for roll's is every dim): over the rows they mix rows that `rows_mixed`'s shapes do not show.
_ALONG = {"softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "cumsum": (1, "dim", None),
          "cumprod": (1, "dim", None), "cummax": (1, "dim", None), "cummin": (1, "dim", None),
          "logcumsumexp": (1, "dim", None), "sort": (1, "dim", -1), "flip": (1, "dims", None),
          "roll": (2, "dims", None), "diff": (2, "dim", -1), "normalize": (2, "dim", 1),
          "softmin": (1, "dim", None), "layer_norm": (1, "normalized_shape", None),
          "rms_norm": (1, "normalized_shape", None), "argsort": (1, "dim", -1), "msort": (1, None, 0),
          # (rows picked by comparing them: the hardest rows of the batch, `loss[loss.topk(k).indices]`)
          "topk": (2, "dim", -1), "kthvalue": (2, "dim", -1), "mode": (1, "dim", -1),
          "argmax": (1, "dim", None), "argmin": (1, "dim", None)}
# (rows picked by comparing them, integers too: the rows of the largest labels, `labels.topk(2)`;
# an argsort or sort of integers orders the rows whole: Note [rows in an order the data decides])
_BY_RANK = {"topk", "kthvalue", "mode", "argmax", "argmin"}
# Attentions: the dim of the key that each query attends along (multi_head_attention_forward
# takes (seq, batch, embed) or an unbatched (seq, embed): nn.MultiheadAttention without
# batch_first given (batch, seq, embed) attends along the batch)
_ATTENDS = {"scaled_dot_product_attention": -2, "flex_attention": -2, "multi_head_attention_forward": 0}
_IMPLICIT_DIM = ("softmax", "log_softmax", "softmin")   # F.softmax(x): the legacy dim, torch's _get_softmax_dim
_NORMALIZED = ("layer_norm", "rms_norm")     # over the last len(normalized_shape) dims
# Operations over windows of their spatial dims and across channels (a (batch, channels, *spatial)
# value, or an unbatched (channels, *spatial) one): the number of spatial dims (None: the value's
# less two). A conv or pool over the rows (`conv1d(h.T[None])`) mixes them.
_WINDOWS = {**{f"{op}{n}d": n for n in (1, 2, 3) for op in ("conv", "conv_transpose", "avg_pool", "max_pool",
                                                            "lp_pool", "adaptive_avg_pool", "adaptive_max_pool")},
            "interpolate": None, "upsample": None}


# Operations that add (or otherwise reduce) values into the slots an index tensor names: given
# the rows, a sum per class or per expert, whatever dims their result keeps.
_INDEX_REDUCTIONS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                     "index_reduce", "index_reduce_"}


# Operations that write values into the slots an index tensor (or a mask) names, in place where
# their name ends in `_` (and `buffer[idx] = h`): given the rows, a value that holds some of them
# wherever its own size does not say so, the last written (a row per class, `buf[labels] = h`).
_INDEX_WRITES = {"index_copy", "index_copy_", "scatter", "scatter_", "index_put", "index_put_", "setitem",
                 "masked_scatter", "masked_scatter_"}


def _reduces_by_index(n: fx.Node) -> bool:
    name = op_name(n)
    return name in _INDEX_REDUCTIONS or (name in ("index_put", "index_put_") and bool(
        n.kwargs.get("accumulate", n.args[3] if len(n.args) > 3 else False)))


def _by_index(n: fx.Node) -> bool:
    """Whether `n` sums or writes values into the slots an index names (its result takes rows in
    only where its own size holds them)."""
    return _reduces_by_index(n) or op_name(n) in _INDEX_WRITES


def _along_rows(n: fx.Node, info: BatchInfo) -> Optional[str]:
    """The name of `n`'s operation where it works along a floating-point value's rows (_ALONG), or
    picks rows by comparing integers along them (_BY_RANK), or None."""
    name = op_name(n)
    if n.op == "call_function" and name in _ATTENDS:
        key = node_value(n.kwargs.get("key", n.args[1] if len(n.args) > 1 else None))
        if (isinstance(key, torch.Tensor) and key.is_floating_point() and key.dim() > 0
                and info.mentions(key.shape[_ATTENDS[name] if key.dim() > 1 else 0])):
            return name
        return None
    if n.op == "call_function" and name in _WINDOWS and n.args:
        return name if _windows_over_rows(n, name, info) else None
    if n.op not in ("call_function", "call_method") or name not in _ALONG or not n.args:
        return None
    x = node_value(n.args[0])
    if (not isinstance(x, torch.Tensor) or x.dim() == 0
            or not (x.is_floating_point() or (name in _BY_RANK and not x.is_complex()))):
        return None
    at, key, default = _ALONG[name]
    dims = n.kwargs.get(key, n.args[at] if len(n.args) > at else default)
    if name == "flip" and len(n.args) > 2:
        dims = n.args[1:]                                   # x.flip(0, 1)
    if name in ("roll", "argmax", "argmin") and dims is None:
        dims = range(x.dim())                               # (the value taken flat)
    if name in _IMPLICIT_DIM and dims is None:
        dims = 0 if x.dim() in (0, 1, 3) else 1
    if name in _NORMALIZED:
        shape = node_value(dims) if isinstance(dims, fx.Node) else dims     # (x.shape: a torch.Size node)
        dims = range(x.dim() - (len(shape) if isinstance(shape, (list, tuple)) else 1), x.dim())
    dims = dims if isinstance(dims, (list, tuple, range)) else [dims]
    if any(isinstance(d, int) and -x.dim() <= d < x.dim() and info.mentions(x.shape[d]) for d in dims):
        return name
    return None


def _windows_over_rows(n: fx.Node, name: str, info: BatchInfo) -> bool:
    """Whether a conv, pool or interpolation (_WINDOWS) works along a dim of its input that holds
    the rows: a spatial dim, or the channels (not a grouped conv's: rows folded into groups, one
    kernel per row, stay apart)."""
    x = node_value(n.args[0])
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return False
    spatial = _WINDOWS[name] if _WINDOWS[name] is not None else max(x.dim() - 2, 1)
    first = 1 if x.dim() == spatial + 2 else 0          # (an unbatched input mixes every dim)
    groups = n.kwargs.get("groups", n.args[6] if name.startswith("conv") and len(n.args) > 6 else 1)
    if name.startswith("conv") and groups != 1:
        first = max(first, x.dim() - spatial)
    return any(info.mentions(d) for d in x.shape[first:])


_BLOCKS = {"cat", "concat", "concatenate", "repeat", "tile"}   # whole batches of rows one after another
_VIEWS = {"view", "reshape", "flatten", "_unsafe_view"}


def rows_in_blocks(node: fx.Node, info: BatchInfo) -> bool:
    """Whether dim 0 of `node`'s value, a multiple of the batch size, holds the rows in blocks,
    whole batches of rows one after another (`torch.cat([h, h])`, `h.repeat(2, 1)`, a (2, batch,
    ...) value flattened), rather than each row's entries together (a (batch, seq, ...) value
    flattened, `repeat_interleave`): the microbatches' values put together along dim 0 would
    interleave the blocks. Read off the node that made that dim 0 (Note [rows kept apart])."""
    size = node_value(node).shape[0]
    if not info.mentions(size):
        return False
    n = node
    while True:     # (up through the values of the same dim 0 to the node that made it)
        same = [a for a in n.all_input_nodes if isinstance(t := node_value(a), torch.Tensor) and t.dim() >= 1
                and isinstance(t.shape[0], torch.SymInt) and t.shape[0].node.expr == size.node.expr]
        if not same:
            break
        n = same[0]
    name = op_name(n)
    if name in _VIEWS and n.args and isinstance(x := node_value(n.args[0]), torch.Tensor):
        first = next((j for j, d in enumerate(x.shape) if info.mentions(d)), 0)
        return any(size_hint(d) != 1 for d in x.shape[:first])
    return name in _BLOCKS


def rows_mixed(gm: fx.GraphModule, info: BatchInfo) -> Optional[tuple]:
    """(node, why) of the first value computed from rows other than its own (Note [rows kept
    apart]), or None."""
    reduced = set()    # floating-point values a reduction over the rows made, and values from them
    counted = set()    # integers a count over the rows made (`mask.sum()`), and integers from them
    rows = set()       # values that hold the batch's rows (_holds_rows)
    sized = set()      # values made from sizes only, never written in place (Note [rows picked by an index])
    read = {}          # integers read from an input: the input (read_from_input)
    orders = RowOrders(info)   # (Note [rows in an order the data decides])
    laid = {}          # values made from sizes that hold rows, checked: why they are not each row's own, or None
    written = {t for n in gm.graph.nodes for t in mutated_values(n)}
    for n in gm.graph.nodes:
        if n not in written and made_from_sizes(n, sized):
            sized.add(n)
        if (along := _along_rows(n, info)) is not None:
            named = f"`{n.name}`" if n.name.rstrip("_0123456789") == along else f"`{n.name}` ({along})"
            return n, f"{named} works along the batch's rows"
        if (picked := _picked_apart(n, info, sized, read, rows)) is not None:
            return n, picked
        if n not in sized and (apart := _sized_apart(n, info, sized, laid)) is not None:
            return n, apart
        ev = node_value(n)
        values = _tensors(ev)       # (a tuple's too: `h.median(0)`, `torch.std_mean(h, 0)`, `h.split([1, B - 1])`)
        if _holds_rows(n, values, info, rows):
            rows.add(n)
        if (unordered := orders.step(n, rows, sized, op_name(n) in _VALUELESS)) is not None:
            return n, unordered
        if (source := read_from_input(n, read)) is not None:
            read[n] = source
        if _counts_rows(n, ev, rows, counted, reduced):
            counted.add(n)
        for target in mutated_values(n) if _by_index(n) else ():   # (`last[idx] = h`, index_copy_)
            if target not in rows and any(a is not target and isinstance(t := node_value(a), torch.Tensor)
                                          and t.is_floating_point() and (a in rows or a in reduced)
                                          for a in n.all_input_nodes):
                reduced.add(target)       # (its later readers read rows it does not hold as rows)
        if (n.op not in ("call_function", "call_method", "call_module")
                or not any(t.is_floating_point() for t in values)):
            continue
        if op_name(n) in _FRESH or n.target is _add_batch_dim:
            continue      # (inside torch.vmap the rows are there, its batch dim: Note [functorch regions])
        for shape in (t.shape for t in values if t.is_floating_point()):
            if sum(map(info.is_batch_dim, shape)) >= 2:
                return n, f"`{n.name}` of shape {info.shape_text(shape)} pairs the batch's rows with its rows"
            if any(info.mentions(d) and not info.whole_rows(d) for d in shape):
                return n, (f"`{n.name}` of shape {info.shape_text(shape)} holds a part of the batch's rows picked "
                           f"by their position in the batch (half of them, all but one), which a microbatch counts "
                           f"from its own; a batch of pairs (DPO's chosen and rejected answers) trains split when the "
                           f"halves come as two arguments, concatenated in the forward "
                           f"(`torch.cat([chosen, rejected])`)")
        tensors = {a: t for a in n.all_input_nodes if (t := _a_tensor(node_value(a))) is not None}
        if (op_name(n) in ARITHMETIC and n in rows and n not in sized
                and any(_counts_the_batch(a, info) for a in n.all_input_nodes)):
            return n, (f"`{n.name}` computes the batch's rows with the batch size (`x.shape[0]`), which each "
                       f"microbatch takes as its own rows'")
        if op_name(n) in ARITHMETIC and any(a in counted for a in n.all_input_nodes):   # (`h / u0` too)
            if n in rows:
                return n, (f"`{n.name}` computes the batch's rows from a count over its rows (`mask.sum()`), which "
                           f"each microbatch counts over its own")
            reduced.add(n)
        if n in rows:
            if any(a in reduced for a in tensors):
                return n, (f"`{n.name}` computes the batch's rows from a value that a reduction over its rows, or a "
                           f"write of them by index, made")
        # (not with an index tensor: x[token], a gather, picks rows whole; but a sum per index does not)
        elif ((all(t.is_floating_point() for t in tensors.values()) or _by_index(n))
              and any(a in reduced or (t.is_floating_point() and a in rows) for a, t in tensors.items())):
            reduced.add(n)
    return None


# Operations that compute with the numbers of their arguments (arithmetic, casts, elementwise
# functions): given a count over the rows, they carry it into their result, where a grouped
# matmul's offsets or a split's sizes, a count per expert, only lay the rows out.
ARITHMETIC = {"add", "sub", "mul", "div", "truediv", "floordiv", "true_divide", "floor_divide", "pow", "where",
              "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "float", "double", "half", "bfloat16",
              "to", "type_as", "type", "reciprocal", "sqrt", "rsqrt", "log", "exp", "rsub", "neg", "iadd",
              "isub", "imul", "itruediv", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__add__",
              "__radd__", "__sub__", "__rsub__"}


_VALUELESS = _FRESH | {"zeros_like", "ones_like", "empty_like", "full_like"}   # (of its argument's shape alone)
# Operations that count or list the values the rows hold, a slot per value (a size the data may
# decide: not rows, which _holds_rows would take it for)
_SLOTS = {"bincount", "histc", "histogram", "unique", "unique_consecutive", "_unique2", "unique_dim"}


def _counts_the_batch(node, info: BatchInfo) -> bool:
    """Whether `node` is a number of the batch size (`x.shape[0]`, `x.shape[0] ** -0.5`)."""
    v = node_value(node) if isinstance(node, fx.Node) else None
    return isinstance(v, (torch.SymInt, torch.SymFloat)) and bool(info.symbols & v.node.expr.free_symbols)


def _tensors(value) -> list:
    """The tensors of a value: itself, or a tuple's."""
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _a_tensor(value) -> Optional[torch.Tensor]:
    """A tensor, or a tuple's first floating-point tensor (else its first): what rows_mixed reads
    of an argument (`h.median(0)`'s values and indices, as `.values` reads them)."""
    if isinstance(value, torch.Tensor):
        return value
    leaves = _tensors(value)
    return next((t for t in leaves if t.is_floating_point()), leaves[0] if leaves else None)


def _counts_rows(n: fx.Node, value, rows: set, counted: set, reduced: set) -> bool:
    """Whether `n`'s value is integers (or booleans) a count over the batch's rows made: computed
    from values that hold rows without holding rows itself (`mask.sum()`, `labels.max()`), or
    from such a count (`counts[labels]`, `mask.sum().clamp(min=1)`); counts per value of the rows
    (`labels.bincount()`, `labels.unique()` and its inverse: _SLOTS); a number the data decides
    from the rows or such a value (`labels.nonzero().shape[0]`, `labels.unique().numel()`,
    `mask.sum().item()`, an unbacked size)."""
    if n.op not in ("call_function", "call_method"):
        return False
    inputs = n.all_input_nodes
    if op_name(n) in _SLOTS:
        return any(a in rows or a in counted for a in inputs)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return bool(free_unbacked_symbols(value)) and any(a in rows or a in counted or a in reduced for a in inputs)
    if (not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()
            or op_name(n) in _VALUELESS):
        return False
    return (any(a in counted and _takes_count(n, a) for a in inputs)
            or (n not in rows and any(a in rows for a in inputs)))


# Operations whose values a number argument gives (a fill's); elsewhere a number is a size or a bound
_FILLS = {"full", "fill", "fill_", "masked_fill", "masked_fill_", "scalar_tensor", "tensor", "as_tensor",
          "index_fill", "index_fill_"}


def _takes_count(n: fx.Node, a: fx.Node) -> bool:
    """Whether tensor `n` takes the values of its count argument `a`: a tensor's, or a number's
    in arithmetic or a fill (`mask * u0`, `torch.full((B,), u0)`), not a number that sizes or
    bounds it (`h[:, :u0]`, `arange(u0)`: Note [rows kept apart])."""
    return (not isinstance(node_value(a), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))
            or op_name(n) in ARITHMETIC or op_name(n) in _FILLS)


def _picked_apart(n: fx.Node, info: BatchInfo, sized: set, read: dict, rows: set) -> Optional[str]:
    """Why `n` picks or writes the batch's rows by an index made from sizes that a microbatch
    would make otherwise, or read from an input (Note [rows picked by an index]), or None."""
    for index, indexed, dim in indices_into(n):
        size = node_value(indexed).shape[dim]
        if not info.whole_rows(size):
            continue
        if index in read:
            source = read[index]
            by = "" if index is source else f"`{index.name}`, "
            if source in rows:
                return (f"`{n.name}` picks the batch's rows by {by}positions read from the batched argument "
                        f"`{_input_name(source)}`: a microbatch's slice of it still counts the whole batch's rows, "
                        f"where its own are numbered from its first (pass the picked rows themselves as a batched "
                        f"argument instead)")
            return (f"`{n.name}` picks the batch's rows by {by}positions read from `{_input_name(source)}`, which "
                    f"count the whole batch's rows: each microbatch would pick its own rows at those positions, or "
                    f"past its end")
        if index not in sized:
            continue
        why = picks_apart(index, size, info, dim == 0 and rows_in_blocks(indexed, info))
        if why is not None:
            return f"`{n.name}` picks the batch's rows by `{index.name}`, an index made from sizes, not data: {why}"
    return None


def _sized_apart(n: fx.Node, info: BatchInfo, sized: set, laid: dict) -> Optional[str]:
    """Why `n` computes with a value made from sizes that holds a value per row, as a value (not
    an index: _picked_apart; integers only where `n` makes floats of them, else positions), that
    is not each row's own once split (Note [values made from sizes]), or None. `laid`: the values
    checked so far, to why."""
    held = [(a, t) for a in n.all_input_nodes if a in sized and isinstance(t := node_value(a), torch.Tensor)
            and info.whole_rows(next((d for d in t.shape if info.mentions(d)), None))]
    if not held:        # (most nodes: nothing more to look at)
        return None
    indices = {index for index, _, _ in indices_into(n)}
    to_floats = any(t.is_floating_point() for t in _tensors(node_value(n)))
    for a, t in held:
        if a in indices or not (t.is_floating_point() or t.dtype == torch.bool or to_floats):
            continue    # (integers as positions, `inv[perm] = arange(N)`: Note [rows in an order the data decides])
        if a not in laid:
            laid[a] = laid_apart(a, info, rows_in_blocks(a, info))
        if laid[a] is not None:
            return (f"`{n.name}` computes with `{a.name}`, made from the batch size, not data, a value per row "
                    f"that is not each row's own ({laid[a]}): each microbatch makes it from its own size (a mean "
                    f"written as weights of 1 / batch: use .mean(); a row's position in the batch: pass it as a "
                    f"batched argument)")
    return None


def _holds_rows(n: fx.Node, tensors: list, info: BatchInfo, rows: set) -> bool:
    """Whether `n`'s value (its `tensors`: one, or a tuple's) holds the batch's rows: a size of it
    depends on the batch size, or the data decides a size of it (u0 + u1) and it is made from
    values that hold rows: the rows picked by a mask (`h[labels == c]`), JetMoE's tokens grouped
    per expert by counts read off the router (the rows in another order). Not a sum per index
    (`zeros(classes.numel(), d).index_add(0, inverse, h)`: a value reduced over the rows)."""
    if any(info.mentions(d) for t in tensors for d in t.shape):
        return True
    return (any(map(free_unbacked_symbols, tensors)) and not _reduces_by_index(n) and op_name(n) not in _SLOTS
            and any(a in rows for a in n.all_input_nodes))


def model_line(node: fx.Node) -> str:
    """" at `line` (File ..., line N, in forward)": the model's line that made `node`, the innermost
    frame outside torch (the model's call of F.rms_norm, not rms_norm's own line); "" without one."""
    trace = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    files = [i for i, line in enumerate(trace) if line.startswith("File ") and i + 1 < len(trace)]
    from ..capture import library_of      # (capture imports the passes)
    files = [i for i in files if library_of(trace[i].split('"')[1] if '"' in trace[i] else "") != "torch"] or files
    return f" at `{trace[files[-1] + 1]}` ({trace[files[-1]]})" if files else ""


def check_rows_apart(gm: fx.GraphModule, info: BatchInfo, num_microbatches: int) -> None:
    """Raise an InputError where microbatches would compute rows from other rows (Note [rows kept apart])."""
    if not info.split(num_microbatches):
        return
    found = rows_mixed(gm, info)
    if found is None:
        return
    node, why = found
    raise InputError(f"the forward computes a row of the batch from other rows{model_line(node)}: {why}. Split into "
                     f"{num_microbatches} microbatches, each would see only its own rows and the result would not "
                     f"be eager's (an in-batch contrastive loss, a norm over the batch). Use "
                     f"Config(num_microbatches=1): the whole batch goes through the pipeline of stage jobs as one "
                     f"microbatch.")


# torch's size functions (torch.utils._sympy.functions) as a lambdified size expression calls
# them: the halves of a batch of pairs (`torch.cat([chosen, rejected]).chunk(2)`) have
# (s1 + s2 + 1)//2 rows, FloorDiv, which lambdify left an unknown name (a NameError at the check)
_SIZE_FUNCTIONS = {"FloorDiv": operator.floordiv, "CleanDiv": operator.floordiv, "IntTrueDiv": operator.truediv,
                   "CeilDiv": lambda a, b: -(-a // b), "PythonMod": operator.mod, "Mod": operator.mod,
                   "Max": max, "Min": min}


class RowCheck:
    """fn(rows, syms) -> int: the dim 0 the plan expects of a value for a microbatch of `rows`
    rows and size symbols `syms` ({name: int}). A module-level callable, not a closure, so a
    Stage pickles (runtime/portable.py); the lambdified expression is built on first call and
    not pickled."""

    def __init__(self, expr: sympy.Expr, symbols: tuple, batch: tuple):
        self.expr = expr          # dim 0 as a sympy expression
        self.symbols = symbols    # its free symbols, sorted by name
        self.batch = batch        # per symbol: a batch symbol (bound to rows) or a size symbol
        self._fn = None

    def __call__(self, rows, syms) -> int:
        fn = self._fn
        if fn is None:
            fn = self._fn = sympy.lambdify(self.symbols, self.expr, modules=[_SIZE_FUNCTIONS, "math"])
        return int(fn(*[rows if b else syms[s.name] for s, b in zip(self.symbols, self.batch)]))

    def __getstate__(self):
        return {**self.__dict__, "_fn": None}

    def __repr__(self):
        return f"RowCheck({self.expr})"


def _row_check(expr: sympy.Expr, info: BatchInfo, known: set) -> Optional[RowCheck]:
    """fn(rows, syms) -> the dim 0 the plan expects of a value for a microbatch, or None when
    dim 0 does not depend on the batch (or depends on a symbol no microbatch binds)."""
    free = expr.free_symbols
    if not free & info.symbols or not all(s in info.symbols or s.name in known for s in free):
        return None
    names = tuple(sorted(free, key=lambda s: s.name))
    return RowCheck(expr, names, tuple(s in info.symbols for s in names))


def attach_row_checks(stages, info: BatchInfo, sym_names) -> None:
    """Per stage: {name: expected dim 0 for a microbatch} for every batched value it reads
    (inputs, activations) and every gradient it reads (of its batched outputs)."""
    known = set(sym_names)
    for st in stages:
        checks = {}
        for p in st.forward.graph.nodes:
            if p.op != "placeholder" or st.kinds.get(p.name) not in ("act", "input"):
                continue
            ev = p.meta.get("example_value")
            if isinstance(ev, torch.Tensor) and ev.dim() >= 1 and isinstance(ev.shape[0], torch.SymInt):
                fn = _row_check(ev.shape[0].node.expr, info, known)
                if fn is not None:
                    checks[p.name] = fn
        for out in st.forward.graph.find_nodes(op="output"):
            for v in torch.utils._pytree.tree_leaves(out.args[0]):
                ev = v.meta.get("example_value") if isinstance(v, fx.Node) else None
                if (v.name in st.grad_outputs and isinstance(ev, torch.Tensor) and ev.dim() >= 1
                        and isinstance(ev.shape[0], torch.SymInt)):
                    fn = _row_check(ev.shape[0].node.expr, info, known)
                    if fn is not None:
                        checks[f"grad of {v.name}"] = fn
        st.row_checks = checks
