"""Cost annotation pass: per-node FLOPs and bytes as sympy expressions in the graph's dynamic dims.

Every call node of a captured graph gets ``node.meta["rp_cost"] = NodeCost(...)``. The numbers
come from re-running the node's target on fresh fake tensors shaped like its inputs'
``example_value``s, inside the FakeTensorMode they belong to:

* forward FLOPs: under ``torch.utils.flop_counter.FlopCounterMode`` (its formula registry);
* backward FLOPs: ``torch.autograd.grad`` of the outputs w.r.t. the inputs through which a
  gradient flows, under a second ``FlopCounterMode``;
* saved bytes: the tensors autograd packs during that forward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers excluded, each storage
  counted once).

Symbolic sizes make the counts SymInts; their ``.node.expr`` is the sympy expression we keep, so
a plan can be re-evaluated for a new batch size by substitution (:func:`evaluate`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import flop_counter as _fc
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from .graph_utils import FUNCTORCH_ENTER, FUNCTORCH_LEAVE, mutated_values, node_value, symbol_hints

__all__ = [
    "NodeCost",
    "Hardware",
    "annotate_costs",
    "graph_key",
    "graph_costs",
    "set_costs",
    "evaluate",
    "graph_symbols",
    "node_seconds",
    "flop_counter_mode",
    "EXTRA_FLOP_FORMULAS",
]

_ZERO = sympy.Integer(0)
_CALL_OPS = ("call_function", "call_method", "call_module")

aten = torch.ops.aten

# The flop registry has formulas for the CUDA attention kernels but not for the CPU flash
# kernel that SDPA dispatches to on CPU; without these the CPU count of attention is 0 while
# a meta/CUDA capture counts it. The formulas are the registry's own SDPA formulas.
#
# Note [grouped-query attention FLOPs]: with fewer key/value heads than query heads (Qwen3,
# Llama: SDPA's enable_gqa), each key/value head serves a group of query heads, and the kernel
# computes attention over every query head. torch before 2.13 asserted equal head counts in its
# SDPA formulas: a count that met a fused kernel given fewer key/value heads (enable_gqa, which
# transformers passes when it gives no mask) raised, and a measurement so failed costed the op 0
# FLOPs (torch 2.11: an eager count of Qwen3 on CPU raised; the small Qwen3 plans checked on CPU
# and on an H100 met none). The formulas are given key and value widened to the query's heads.
def _query_heads(formula, query_at: int) -> Callable:
    """`formula` of shapes with the key and value (right after the query, at query_at) counted
    with the query's heads (Note [grouped-query attention FLOPs])."""
    def count(*shapes, **kwargs):
        shapes, heads = list(shapes), shapes[query_at][1]
        for at in (query_at + 1, query_at + 2):
            b, _, s, d = shapes[at]
            shapes[at] = (b, heads, s, d)
        return formula(*shapes, **kwargs)
    return count


_SDPA_OPS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
EXTRA_FLOP_FORMULAS: dict[Any, Callable] = {
    **{getattr(aten, op): _query_heads(_fc.sdpa_flop.__wrapped__, 0) for op in _SDPA_OPS if hasattr(aten, op)},
    **{getattr(aten, op + "_backward"): _query_heads(_fc.sdpa_backward_flop.__wrapped__, 1)
       for op in _SDPA_OPS if hasattr(aten, op + "_backward")},
}


# Note [MoE FLOPs]: a mixture-of-experts layer multiplies each token by its top-k experts only.
# Grouped matmuls (torch._grouped_mm, what F.grouped_mm and transformers' default "grouped_mm"
# experts run) take all tokens x top-k rows sorted by expert, the experts' stacked weights and
# the group offsets: their work is rows x in x out, however the rows fall into groups, which is
# tokens x top-k x one expert's FLOPs. The registry has no formula for them (counted 0).
# transformers runs its own loop of mm as a custom op (transformers::grouped_mm_fallback) for
# fp32 weights under compile; it gets the same formula. MoE layers written as a loop over
# experts with torch.where / nonzero have data-dependent sizes: see Note [data-dependent sizes].
def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul of a (rows, k) or (groups, m, k) by b (groups, k, n) or (k, n)."""
    if len(a_shape) == 3 and len(b_shape) == 2:      # (g, m, k) x (k, n) split over n
        return 2 * a_shape[1] * a_shape[2] * b_shape[-1]
    numel = 1
    for d in a_shape:
        numel *= d
    return 2 * numel * b_shape[-1]


def _grouped_mm_backward_flop(a_shape, b_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    """transformers::grouped_mm_fallback_backward: the input and the weight gradients."""
    return 2 * _grouped_mm_flop(a_shape, b_shape)


def _register_grouped_mm() -> None:
    EXTRA_FLOP_FORMULAS[aten._grouped_mm] = _grouped_mm_flop
    ops = torch.ops.transformers   # registered when transformers' MoE integration is imported
    for name, formula in (("grouped_mm_fallback", _grouped_mm_flop),
                          ("grouped_mm_fallback_backward", _grouped_mm_backward_flop)):
        if hasattr(ops, name):
            EXTRA_FLOP_FORMULAS[getattr(ops, name)] = formula


def flop_counter_mode() -> _fc.FlopCounterMode:
    """A silent FlopCounterMode with the registry plus :data:`EXTRA_FLOP_FORMULAS`."""
    _register_grouped_mm()
    return _fc.FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)


@dataclass(frozen=True)
class NodeCost:
    """Costs of one node, as sympy expressions in the graph's symbols (Integer when static).

    ``fwd_flops``/``bwd_flops``: FLOPs of the forward op and of its backward (0 where no
    gradient flows). ``param_bytes``: bytes of parameter placeholders the node reads directly.
    ``out_bytes``: bytes of the node's output value(s). ``saved_bytes``: activation bytes the op
    saves for backward. ``saved_values``: those of them that are values of the graph, the op's
    inputs or outputs, as ((producer node name, index in its flattened value), bytes): several
    ops may save one value (Note [saved values once]). ``requires_grad``: a gradient flows
    through the node in backward.
    ``is_view``: every output aliases an input (moves no data). ``itemsize``: element size of
    the node's (floating) output, the dtype its byte counts were measured in.
    """

    fwd_flops: sympy.Expr = _ZERO
    bwd_flops: sympy.Expr = _ZERO
    param_bytes: sympy.Expr = _ZERO
    out_bytes: sympy.Expr = _ZERO
    saved_bytes: sympy.Expr = _ZERO
    saved_values: tuple = ()
    requires_grad: bool = False
    is_view: bool = False
    itemsize: int = 0


# Note [host-wide uploads]: a device reads page-locked host memory at 55 GB/s alone and 52-55
# GB/s with two uploading at once (2x H200, benchmarks/pin_probe.py), but four H200s uploading
# together got about 32 GB/s each (two 4-GPU traces of Llama-3.1-8B: 26.8 GB a step a device,
# and 15 GiB in a last step; RESULTS.md): the host's memory, not each device's link, is then the
# limit. Pricing 55 GB/s a device there made a 4-GPU plan's uploads look 1.7x faster than they
# ran. So a plan prices each device's uploads at min(upload_bw, host_upload_bw / devices): copies
# and pipelines alike upload on every device at once for most of a step.
@dataclass(frozen=True)
class Hardware:
    """Roofline numbers of a device: FLOP/s, device memory B/s and host-to-device B/s, and
    the host time a stage job costs beyond its compute, per device of the plan."""

    peak_flops: float
    mem_bw: float
    upload_bw: float
    job_overhead_per_device_s: float = 0.0
    peer_bw: float = 10e9           # B/s one device reads of another's memory (replicas' gradients)
    host_upload_bw: float = float("inf")   # B/s the host's memory gives all devices uploading at once

    @classmethod
    def of(cls, config) -> "Hardware":
        """The hardware a Config plans for: H100-class GPUs (on_gpu) or CPU devices, each
        device's upload at its share of the host's (Note [host-wide uploads])."""
        hw = cls.h100() if config.on_gpu else cls.cpu()
        return dataclasses.replace(hw, upload_bw=min(hw.upload_bw, hw.host_upload_bw / len(config.devices)))

    @classmethod
    def cpu(cls) -> "Hardware":
        return cls(peak_flops=50e9, mem_bw=10e9, upload_bw=10e9)

    @classmethod
    def h100(cls) -> "Hardware":
        # The devices' worker threads launch kernels through one interpreter, so a job's start
        # (and each hand-over between jobs) waits longer the more devices there are: measured on
        # H200s, a microbatch's hop between jobs took ~12 ms with 2 devices and ~38 ms (median)
        # with 4; 32 stage jobs on 4 GPUs ran 16% slower than 8 (the plan without this term).
        return cls(peak_flops=790e12, mem_bw=3.0e12, upload_bw=55e9, job_overhead_per_device_s=0.010,
                   peer_bw=150e9, host_upload_bw=128e9)

    def job_overhead_s(self, num_devices: int) -> float:
        return self.job_overhead_per_device_s * num_devices

    def seconds(self, cost: NodeCost, bindings: dict, *, dtype_bytes: int | None = None):
        return node_seconds(cost, bindings, peak_flops=self.peak_flops, mem_bw=self.mem_bw,
                            dtype_bytes=dtype_bytes)


def exchange_seconds(params, replicas: int, hw: Hardware, itemsize: int = 4) -> float:
    """Seconds the replicas of a plan take to sum their gradients (Note [replicas] in
    runtime/replicas.py): each device reads its slice of every other device's accumulators, fp32
    or, where each copy runs one microbatch or the copies are worker processes, the host set's
    dtype (`itemsize` bytes an element: Note [one microbatch a copy], runtime/grads.py; Note
    [copies' sums a part at a time], runtime/replicas.py)."""
    grad_bytes = itemsize * sum(p.numel() for p in params if p.requires_grad)
    return grad_bytes * (replicas - 1) / replicas / hw.peer_bw


# ----------------------------------------------------------------------------------------------
# symbolic helpers


def _expr(v) -> sympy.Expr:
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return sympy.sympify(v.node.expr)
    if isinstance(v, bool):
        return sympy.Integer(int(v))
    if isinstance(v, int):
        return sympy.Integer(v)
    return sympy.sympify(v)


def _tensor_bytes(t: torch.Tensor) -> sympy.Expr:
    n = sympy.Integer(t.element_size())
    for s in t.shape:
        n = n * _expr(s)
    return n


def evaluate(expr, bindings: dict | None = None) -> float:
    """Value of ``expr`` with symbols bound by ``bindings`` (keys: sympy Symbols or their names).
    Memoised: the planner evaluates the same few expressions (one per kind of node of a decoder
    layer) tens of thousands of times at one set of sizes."""
    expr = sympy.sympify(expr)
    if expr.is_Number:
        return float(expr)
    names = tuple(sorted(((k.name if isinstance(k, sympy.Symbol) else str(k)), v) for k, v in (bindings or {}).items()))
    try:
        return _evaluate(expr, names)
    except TypeError:   # a value that cannot be hashed
        return _evaluate.__wrapped__(expr, names)


@functools.lru_cache(maxsize=1 << 16)
def _evaluate(expr, names: tuple) -> float:
    by_name = dict(names)
    subs, missing = {}, []
    for s in expr.free_symbols:
        if s.name in by_name:
            subs[s] = sympy.sympify(by_name[s.name])
        else:
            missing.append(s.name)
    if missing:
        raise ValueError(f"evaluate: no value bound for symbol(s) {sorted(missing)} in {expr}")
    return float(expr.xreplace(subs))


def graph_symbols(gm: fx.GraphModule) -> dict[str, sympy.Symbol]:
    """The free symbols of the placeholders' sizes (and SymInt placeholders), by name."""
    syms: dict[str, sympy.Symbol] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        for v in tree_flatten(node_value(node))[0]:
            vals = list(v.shape) if isinstance(v, torch.Tensor) else [v]
            for s in vals:
                if isinstance(s, torch.SymInt):
                    for sym in _expr(s).free_symbols:
                        syms[sym.name] = sym
    return dict(sorted(syms.items()))


def node_seconds(cost: NodeCost, bindings: dict, *, peak_flops: float, mem_bw: float,
                 dtype_bytes: int | None = None) -> tuple[float, float]:
    """(forward, recompute+backward) seconds of a node by a roofline model.

    Forward: max(fwd_flops / peak_flops, (out_bytes + param_bytes) / mem_bw); backward: the same
    with bwd_flops and twice the bytes (read the gradient and the saved values, write the input
    gradients). Views move no bytes; nodes no gradient flows through have no backward.
    ``dtype_bytes`` rescales the recorded bytes to another element size (e.g. 2 to plan a bf16
    run from an fp32 capture).
    """
    scale = 1.0
    if dtype_bytes is not None and cost.itemsize:
        scale = dtype_bytes / cost.itemsize
    moved = 0.0 if cost.is_view else evaluate(cost.out_bytes + cost.param_bytes, bindings) * scale
    fwd = max(evaluate(cost.fwd_flops, bindings) / peak_flops, moved / mem_bw)
    bwd = 0.0
    if cost.requires_grad:
        bwd = max(evaluate(cost.bwd_flops, bindings) / peak_flops, 2.0 * moved / mem_bw)
    return fwd, fwd + bwd


# ----------------------------------------------------------------------------------------------
# the pass


def _kind(node: fx.Node) -> str:
    kind = node.meta.get("rp_kind")
    if kind is not None:
        return kind
    ev = node_value(node)
    if isinstance(ev, torch.Tensor):
        if ev.requires_grad and "parameters" in node.name:
            return "param"
        if "buffers" in node.name:
            return "buffer"
        return "input"
    return "sym"


def _param_bytes(node: fx.Node) -> sympy.Expr:
    """Bytes of the parameter placeholders ``node`` reads; only the rows of a parameter slice
    (``meta["rp_param_slice"] = (placeholder name, dim, start, stop)``, from split_lm_head)."""
    total = _ZERO
    sl = node.meta.get("rp_param_slice")
    for a in node.all_input_nodes:
        if a.op != "placeholder" or _kind(a) != "param":
            continue
        nbytes = _tensor_bytes(node_value(a))
        if sl is not None and sl[0] == a.name:
            _, dim, start, stop = sl
            nbytes = nbytes / _expr(node_value(a).shape[dim]) * (_expr(stop) - _expr(start))
        total = total + nbytes
    return total


def _flat(v) -> list:
    return tree_flatten(v)[0]


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # tensors without storage (sparse, some subclasses)
        return id(t)


def _fake_mode(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    vals = []
    for node in gm.graph.nodes:
        vals.extend(v for v in _flat(node_value(node))
                    if isinstance(v, (torch.Tensor, torch.SymInt)))
    try:
        mode = detect_fake_mode(vals)
    except Exception:
        mode = None
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


_ENTER_AUTOCAST = getattr(torch.amp, "_enter_autocast", None)
_EXIT_AUTOCAST = getattr(torch.amp, "_exit_autocast", None)
# Targets that switch global state or log: never re-run (running would leak the state); the
# grad-mode and autocast switches are tracked and replayed around the ops they enclose.
_STATE_TARGETS = {torch._C._log_api_usage_once, torch._C._set_grad_enabled,
                  _ENTER_AUTOCAST, _EXIT_AUTOCAST} - {None}
# torch.vmap inside the model (Note [functorch regions]): the level switches are state; moving a
# tensor into or out of a batched level is a view (a gradient flows, no FLOPs). The ops between
# are measured on plain tensors of the per-example shape their example values have.
_FP = torch._functorch.predispatch
_STATE_TARGETS |= FUNCTORCH_ENTER | FUNCTORCH_LEAVE | {getattr(_FP, "lazy_load_decompositions", None)} - {None}
_BATCH_DIM_MOVES = {getattr(_FP, n) for n in ("_add_batch_dim", "_remove_batch_dim") if hasattr(_FP, n)}
_DETACH = {"detach", torch.detach, torch.Tensor.detach}
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}

# Note [linear on rows]: a linear is measured on its input flattened to rows (2-D). torch 2.11's
# matmul folds a 3-D input times a weight that needs no gradient through numel(), which fails
# on symbolic sizes ("Cannot call numel() on tensor with symbolic sizes/strides"): every frozen
# weight a gradient flows past (LoRA's base layers, the frozen layers above trainable ones) was
# costed 0 FLOPs. On rows the same kernel runs (addmm/mm of the folded input), with the same
# FLOPs forward and backward, and the rows are a view of the input, so a saved input is still
# found as that input (tests/test_cost.py checks a frozen linear's costs).

# Meta fakes are measured as CPU fakes: on meta, SDPA dispatches to its math decomposition while
# on CPU (as on CUDA) it runs a fused kernel, whose FLOPs and saved tensors are the ones a real
# run has; this keeps a meta capture's costs equal to a CPU capture's.
_MEASURE_DEVICE = {"meta": torch.device("cpu")}


# Note [measurements across captures]: a measurement is a function of the node's signature
# (`_Annotator._key`: op, target, inputs' symbolic sizes, strides and dtypes, gradient and
# parameter flags, grad mode, autocast), of the flop formulas, and of what the op's fake kernel
# reads of the capture's ShapeEnv: the hints and ranges of the size symbols it meets (a
# `x.size(0) == 1` test decides by them). Two captures that name the same sizes with the same
# symbols (s0, s1 ... in the order dynamo meets the dims) and hints get the same expressions, so
# the measurements are kept for the process too, keyed by all of that: a second capture of a
# model (a new Config, the eval call beside the training one, another model of the same
# layers) measures nothing it measured before. The test suite captures tiny Qwen3s and Llamas
# 260 times; the cost pass was 15% of its CPU time.
_MEASURED: dict = {}
_MEASURED_MAX = 50_000       # entries (a few hundred a model): cleared when full

# A fake tensor's signature, by the tensor: its sizes and strides never change, and a re-plan at
# a new length keys the capture's same fake tensors again (printing their sympy sizes was 0.5 of
# the 1.5 s of annotate_costs in a 28-layer Qwen3's re-plan on CPU).
_TENSOR_SIGS = WeakIdKeyDictionary()


def _sig(v):
    if isinstance(v, torch.Tensor):
        sig = _TENSOR_SIGS.get(v)
        if sig is None:
            sig = _TENSOR_SIGS[v] = ("T", tuple(str(_expr(s)) for s in v.shape),
                                     tuple(str(_expr(s)) for s in v.stride()), v.dtype, v.device.type)
        return sig
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(v.node.expr))
    return (type(v).__name__, repr(v))


# Note [data-dependent sizes]: ops such as torch.where(mask), nonzero and boolean-mask
# indexing make tensors whose size depends on the data (an unbacked symbol, u0). The classic
# MoE layer loops over experts and picks each expert's tokens so: Σ_e u_e = tokens x top-k. The
# plan needs a number for each u: the expected count of nonzero elements of the mask, followed
# back through views and casts to a one-hot (one 1 per index: the routing's tokens x top-k
# choices, spread over the experts the views slice it into) or else taken as half the mask.
# Costs hold the estimates in place of the unbacked symbols (gm.meta["rp_size_estimates"]), and
# no stage boundary hands over a value of data-dependent size (cut_points).
_ONE_HOT = {torch._C._nn.one_hot, torch.nn.functional.one_hot}
_CASTS = {"to", "bool", "int", "long", "float", "half", "bfloat16", "double", "type", "contiguous"}
_NONZERO_FUNCTIONS = {torch.nonzero, torch.argwhere, torch.Tensor.nonzero, torch.Tensor.argwhere}


def _nonzero_source(node: fx.Node):
    """The mask whose nonzero elements set the size of `node`'s output, if it is such an op."""
    if node.op == "call_function":
        if node.target is torch.where and len(node.args) == 1 and not node.kwargs:
            return node.args[0]
        if node.target in _NONZERO_FUNCTIONS or node.target in (aten.nonzero.default, aten.nonzero):
            return node.args[0]
        if node.target in (torch.masked_select, torch.Tensor.masked_select):
            return node.args[1]
        if node.target in (operator.getitem, torch.Tensor.__getitem__):
            idx = node.args[1] if isinstance(node.args[1], (tuple, list)) else (node.args[1],)
            masks = [i for i in idx if isinstance(i, fx.Node) and isinstance(node_value(i), torch.Tensor)
                     and node_value(i).dtype == torch.bool]
            return masks[0] if masks else None
    if node.op == "call_method" and node.target in ("nonzero", "argwhere"):
        return node.args[0]
    if node.op == "call_method" and node.target == "masked_select":
        return node.args[1]
    return None


def _numel(t) -> sympy.Expr:
    n = sympy.Integer(1)
    if isinstance(t, torch.Tensor):
        for s in t.shape:
            n = n * _expr(s)
    return n


def _rough_size(expr) -> float:
    """A rough size of an expression for comparisons: every symbol taken as 64."""
    expr = sympy.sympify(expr)
    return float(expr.xreplace({s: 64 for s in expr.free_symbols}))


def _in_place(node: fx.Node) -> bool:
    return bool(mutated_values(node))


class _Annotator:
    def __init__(self, gm: fx.GraphModule, cache: dict | None = None):
        self.gm = gm
        self.fake_mode = _fake_mode(gm)
        self.shape_env = getattr(self.fake_mode, "shape_env", None)
        self.cache: dict = {} if cache is None else cache   # node signature -> measurement
        self.rg: dict[fx.Node, list[bool]] = {}  # node -> per flat example value: grad flows
        self.warned: set = set()
        self.leaves: dict = {}  # (producer node, flat index) -> fake leaf
        # Costs are for training: grad mode starts on, whatever mode the capture ran under.
        self.grad_enabled = True
        self.autocast: tuple = ()  # args of the enclosing _enter_autocast nodes
        self.estimates: dict = {}  # unbacked size symbol -> expected value (Note [data-dependent sizes])
        self.unbacked: dict = {}   # size expression -> its unbacked symbols (most sizes repeat)
        self.formulas = tuple(EXTRA_FLOP_FORMULAS.items())

    # -- per node ---------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.gm.graph.nodes:
            ev = node_value(node)
            flat_out = _flat(ev)
            if node.op == "placeholder":
                kind = _kind(node)
                rg = node.meta.get("rp_requires_grad")  # the capture's word beats the fake's flag
                self.rg[node] = [isinstance(v, torch.Tensor) and _floating(v) and kind in ("param", "input")
                                 and bool(v.requires_grad if rg is None else rg) for v in flat_out]
                continue
            if node.op not in _CALL_OPS:
                continue
            if node.target is torch._C._set_grad_enabled:
                self.grad_enabled = bool(node.args[0])
            elif node.target is _ENTER_AUTOCAST:
                self.autocast = self.autocast + (tuple(node.args),)
            elif node.target is _EXIT_AUTOCAST:
                self.autocast = self.autocast[:-1]
            self._estimate_new_sizes(node, flat_out)
            node.meta["rp_cost"] = self._substitute(self.cost(node, flat_out))
        self.gm.meta["rp_size_estimates"] = dict(self.estimates)

    # -- data-dependent sizes (Note [data-dependent sizes]) ---------------------------------
    def _estimate_new_sizes(self, node, flat_out) -> None:
        new = set()
        for v in flat_out:
            for s in (v.shape if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else []):
                if not isinstance(s, torch.SymInt):
                    continue
                e = s.node.expr
                found = self.unbacked.get(e)
                if found is None:
                    found = self.unbacked[e] = free_unbacked_symbols(e)
                new |= {u for u in found if u not in self.estimates}
        if not new:
            return
        source = _nonzero_source(node)
        if source is not None:
            est = self._nnz(source, 0)
        else:
            sizes = [_numel(node_value(a)) for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
            est = max(sizes, key=lambda e: _rough_size(e), default=sympy.Integer(1)) / 2
        for u in new:
            self.estimates[u] = sympy.sympify(est)

    def _nnz(self, node: fx.Node, depth: int) -> sympy.Expr:
        """Expected count of nonzero elements of `node`'s value."""
        ev = node_value(node)
        numel = _numel(ev)
        if depth > 16 or not isinstance(ev, torch.Tensor):
            return numel / 2
        if node.op == "call_function" and node.target in _ONE_HOT:
            return _numel(node_value(node.args[0]))           # one 1 per index
        cost = node.meta.get("rp_cost")
        srcs = [a for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
        keeps = cost is not None and cost.is_view or (node.op == "call_method" and node.target in _CASTS)
        if keeps and srcs:   # a view or a cast: the same density as its source
            return self._nnz(srcs[0], depth + 1) * numel / _numel(node_value(srcs[0]))
        return numel / 2

    def _substitute(self, cost: NodeCost) -> NodeCost:
        if not self.estimates:
            return cost
        subs = {f: getattr(cost, f).xreplace(self.estimates)
                for f in ("fwd_flops", "bwd_flops", "param_bytes", "out_bytes", "saved_bytes")}
        subs["saved_values"] = tuple((v, b.xreplace(self.estimates)) for v, b in cost.saved_values)
        return dataclasses.replace(cost, **subs)

    def cost(self, node, flat_out) -> NodeCost:
        out_tensors = [v for v in flat_out if isinstance(v, torch.Tensor)]
        out_bytes = sum((_tensor_bytes(t) for t in out_tensors), _ZERO)
        floats = [t for t in out_tensors if _floating(t)]
        itemsize = (floats or out_tensors)[0].element_size() if out_tensors else 0
        param_bytes = _param_bytes(node)
        base = dict(param_bytes=param_bytes, out_bytes=out_bytes, itemsize=itemsize)

        flat_args, spec = tree_flatten((node.args, node.kwargs))
        in_vals, in_rg, in_param, in_names = [], [], [], []
        for a in flat_args:
            if isinstance(a, fx.Node):
                vals = _flat(node_value(a))
                flags = self.rg.get(a, [False] * len(vals))
                kind = _kind(a) if a.op == "placeholder" else "act"
                for j, (v, f) in enumerate(zip(vals, flags)):
                    in_vals.append(v); in_rg.append(f); in_param.append(kind in ("param", "buffer"))
                    in_names.append((a.name, j))
        in_tensors = [v for v in in_vals if isinstance(v, torch.Tensor)]
        any_rg = self.grad_enabled and any(in_rg)

        # nothing to run: no tensor input (factories, SymInt arithmetic) or a state switch
        if not in_tensors or node.target in _STATE_TARGETS:
            self.rg[node] = [False] * len(flat_out)
            return NodeCost(**base)

        if node.target in _BATCH_DIM_MOVES:
            self.rg[node] = [isinstance(v, torch.Tensor) and _floating(v) and any_rg for v in flat_out]
            return NodeCost(**base, requires_grad=any_rg, is_view=True)

        # views and no-op conversions: every output aliases an input; no FLOPs, nothing saved
        in_storages = {storage_key(t) for t in in_tensors}
        if (out_tensors and not _in_place(node)
                and all(storage_key(t) in in_storages for t in out_tensors)):
            flows = any_rg and node.target not in _DETACH
            self.rg[node] = [isinstance(v, torch.Tensor) and _floating(v) and flows for v in flat_out]
            return NodeCost(**base, requires_grad=flows, is_view=True)

        key = self._key(node, flat_args, spec, in_rg, in_param)
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            shared = self._shared_key(key, flat_args) if key is not None else None
            hit = _MEASURED.get(shared) if shared is not None else None
            if hit is None:
                hit = self._measure(node, flat_args, spec, in_rg, in_param)
                if shared is not None:
                    if len(_MEASURED) >= _MEASURED_MAX:
                        _MEASURED.clear()
                    _MEASURED[shared] = hit
            if key is not None:
                self.cache[key] = hit
        fwd, bwd, saved, saved_in, saved_out, out_rg = hit
        if len(out_rg) != len(flat_out):  # measured output structure differs from example value
            out_rg = [isinstance(v, torch.Tensor) and _floating(v) and any_rg for v in flat_out]
        self.rg[node] = out_rg
        # the saved inputs and outputs by the values they are (Note [saved values once])
        saved_values = tuple((in_names[i], b) for i, b in saved_in if i < len(in_names))
        saved_values += tuple(((node.name, j), b) for j, b in saved_out if j < len(flat_out))
        return NodeCost(fwd_flops=fwd, bwd_flops=bwd, saved_bytes=saved, saved_values=saved_values,
                        requires_grad=any(out_rg), **base)

    def _key(self, node, flat_args, spec, in_rg, in_param):
        try:
            sig = []
            for a in flat_args:
                body = self._body(a)
                if body is not None:
                    sig.append(("body", str(body.graph)))
                elif isinstance(a, fx.Node):
                    sig.append(tuple(_sig(v) for v in _flat(node_value(a))))
                else:
                    sig.append(_sig(a))
            key = (node.op, node.target, str(spec), tuple(sig), tuple(in_rg), tuple(in_param),
                   self.grad_enabled, repr(self.autocast))
            hash(key)
            return key
        except Exception:
            return None

    def _shared_key(self, key, flat_args):
        """key, with what else a measurement may read in this capture (Note [measurements across
        captures]): each size symbol's hint and range, and the FLOP formulas."""
        exprs = []
        for a in flat_args:
            for v in (_flat(node_value(a)) if isinstance(a, fx.Node) else [a]):
                sizes = (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else (v,)
                exprs += [s.node.expr for s in sizes if isinstance(s, torch.types.py_sym_types)]
        symbols = set().union(*(e.free_symbols for e in exprs)) if exprs else set()
        env = self.shape_env
        if not symbols:
            return key, (), self.formulas
        if env is None:
            return None
        hints = symbol_hints(env)
        facts = tuple(sorted((str(u), str(hints.get(u)), str(env.var_to_range.get(u))) for u in symbols))
        return key, facts, self.formulas

    # -- measuring on fakes -----------------------------------------------------------------
    def _measure(self, node, flat_args, spec, in_rg, in_param):
        # (a fake implementation that fails logs its traceback as an error before it raises: the
        # failures here are tried again, and said once, by the warning below)
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        was, fake_log.disabled = fake_log.disabled, True
        try:
            return self._measure_logged(node, flat_args, spec, in_rg, in_param)
        finally:
            fake_log.disabled = was

    def _measure_logged(self, node, flat_args, spec, in_rg, in_param):
        try:
            return self._measure_once(node, flat_args, spec, in_rg, in_param, clone=False)
        except Exception as first:
            try:  # in-place ops cannot run on leaves that require grad: run on clones
                return self._measure_once(node, flat_args, spec, in_rg, in_param, clone=True)
            except Exception:
                pass
            try:  # Note [ops that need the python dispatcher]
                return self._measure_once(node, flat_args, spec, in_rg, in_param, clone=False, dispatcher=True)
            except Exception:
                # a node reading only 0-dim tensors (a module's scalar attribute, `.item()`) is
                # cheap whatever it does: costing it as 0 loses nothing worth a warning
                scalar = all(v.dim() == 0 for a in flat_args if isinstance(a, fx.Node)
                             for v in _flat(node_value(a)) if isinstance(v, torch.Tensor))
                if node.target not in self.warned and not scalar:
                    self.warned.add(node.target)
                    warnings.warn(f"annotate_costs: could not measure {node.format_node()} "
                                  f"({type(first).__name__}: {first}); costed as 0 FLOPs")
                return (_ZERO, _ZERO, _ZERO, (), (), [])

    # Note [ops that need the python dispatcher]: some ops' fake implementations run their
    # Python reference only under the python dispatcher, which dynamo's tracing enables and a
    # measurement on fakes did not: masked_scatter of symbolic sizes (how a vision-language model
    # puts its image features into the text embeddings) failed with "SymIntArrayRef expected to
    # contain only concrete integers", a warning at every capture, and was costed as 0 with
    # nothing saved. A measurement that fails is tried again under it (the others stay as
    # measured).
    def _measure_once(self, node, flat_args, spec, in_rg, in_param, clone, dispatcher=False):
        saved: dict = {}
        excluded: set = set()  # storages of parameters and buffers: not activations
        inputs: dict = {}      # storage -> the flat position of the input leaf that owns it

        def pack(t):
            k = storage_key(t)
            if k not in excluded and k not in saved:
                try:
                    saved[k] = _expr(t.untyped_storage().nbytes())
                except Exception:
                    saved[k] = _tensor_bytes(t)
            return t

        with ExitStack() as stack:
            stack.enter_context(self.fake_mode)
            if self.shape_env is not None:  # planning must not add guards to the capture
                stack.enter_context(self.shape_env.suppress_guards())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            if dispatcher:
                from torch._dispatch.python import enable_python_dispatcher
                stack.enter_context(enable_python_dispatcher())

            # leaves shaped like the inputs' example values (same sizes, strides, dtype), one per
            # producer value, reused by its consumers; in-place ops get fresh ones
            fresh = clone or _in_place(node)
            leaves, call_args, i = {}, [], 0
            for a in flat_args:
                if not isinstance(a, fx.Node):
                    call_args.append(a)
                    continue
                body = self._body(a)
                if body is not None:
                    call_args.append(body)
                    continue
                ev = node_value(a)
                vals, vspec = tree_flatten(ev)
                new = []
                for j, v in enumerate(vals):
                    if isinstance(v, torch.Tensor):
                        t = None if fresh else self.leaves.get((a, j))
                        if t is None:
                            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                    device=_MEASURE_DEVICE.get(v.device.type, v.device))
                            if in_rg[i] and _floating(t):
                                t.requires_grad_(True)
                            if not fresh:
                                self.leaves[(a, j)] = t
                        if t.requires_grad:
                            leaves[id(t)] = t
                        if in_param[i]:
                            excluded.add(storage_key(t))
                        elif not clone:
                            inputs.setdefault(storage_key(t), i)
                        v = t.clone() if clone else t
                    new.append(v)
                    i += 1
                call_args.append(tree_unflatten(new, vspec) if vals else ev)
            leaves = list(leaves.values())
            args, kwargs = tree_unflatten(call_args, spec)

            for amp in self.autocast:  # _enter_autocast(device_type, dtype, enabled, cache)
                device_type, dtype, enabled = (tuple(amp) + (None, True))[:3]
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=bool(enabled)))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if leaves else nullcontext():
                with flop_counter_mode() as fwd_counter:
                    out = self._call(node, args, kwargs)
            fwd = _expr(fwd_counter.get_total_flops())

            flat_out = _flat(out)
            out_rg = [isinstance(v, torch.Tensor) and v.requires_grad for v in flat_out]
            diff = [v for v, r in zip(flat_out, out_rg) if r]
            bwd = _ZERO
            # Only ops with forward FLOPs get a backward run: the registry counts matmul, conv
            # and attention kernels, and an op without them forward has none in its backward
            # (elementwise, norms, softmax, losses, indexing); this halves the annotation time.
            if diff and leaves and fwd != 0:
                grads = [torch.ones_like(v) for v in diff]
                try:
                    with flop_counter_mode() as bwd_counter:
                        torch.autograd.grad(diff, leaves, grads, allow_unused=True)
                    bwd = _expr(bwd_counter.get_total_flops())
                except Exception:   # noqa: BLE001 - Note [a backward that cannot run on fakes]
                    bwd = 2 * fwd
        saved_bytes = sum(saved.values(), _ZERO) if diff else _ZERO
        saved_in, saved_out = [], []
        if diff:
            outputs = {}
            for j, v in enumerate(flat_out):
                if isinstance(v, torch.Tensor):
                    outputs.setdefault(storage_key(v), j)
            for k, b in saved.items():
                if k in inputs:
                    saved_in.append((inputs[k], b))
                elif k in outputs:
                    saved_out.append((outputs[k], b))
        return fwd, bwd, saved_bytes, tuple(saved_in), tuple(saved_out), out_rg

    # Note [a backward that cannot run on fakes]: an op with forward FLOPs has its backward
    # measured too. transformers 5.17's grouped_mm_fallback (an MoE's experts in fp32) has a
    # Python backward that loops over the group offsets (`offs.tolist()`), which fake tensors
    # cannot: the whole measurement failed, and the experts were costed 0 FLOPs both ways (torch
    # 2.11). Its forward stands, and its backward counts twice the forward, a matmul's.

    # Note [bodies of higher-order ops]: a higher-order op (torch.utils.checkpoint's
    # tag_activation_checkpoint, a wrap) takes its body as a get_attr of a GraphModule, which has
    # no fake value: it was measured with None for its body, failed, and was costed 0 FLOPs with a
    # warning (a model checkpointing its own blocks was planned as if they cost nothing). The body
    # itself is passed, and its code is part of the measurement's key (bodies of the same inputs
    # may compute different things).
    def _body(self, arg):
        """The GraphModule a higher-order op's argument `arg` names (a get_attr without a fake
        value), or None."""
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and node_value(arg) is None:
            return self.gm.get_submodule(arg.target)
        return None

    def _call(self, node, args, kwargs):
        if node.op == "call_function":
            if node.target in _LINEAR and args and args[0].dim() > 2:
                # Note [linear on rows]
                args = (args[0].flatten(0, -2), *args[1:])
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_arg, *rest = args
            return getattr(self_arg, node.target)(*rest, **kwargs)
        return self.gm.get_submodule(node.target)(*args, **kwargs)


def annotate_costs(gm: fx.GraphModule, cache: dict | None = None) -> fx.GraphModule:
    """Set ``node.meta["rp_cost"]`` (a :class:`NodeCost` of sympy expressions) on every call node.
    cache: measurements by node signature, kept between graphs of one capture (Note [costs per
    capture])."""
    _Annotator(gm, cache).run()
    gm.graph.lint()
    return gm


# Note [costs per capture]: one capture is planned more than once: at each new size no held plan
# fits (Note [plans per length] in plan_cache.py), or for another Config (tests/test_cost.py plans
# the Qwen3-1.7B shape three ways; the cost pass took 0.8-2 s of each 4-7 s compile on 2 busy CPU
# cores, 0.03 s when it finds its costs kept). The costs are symbolic in the size symbols,
# so they depend on neither the sizes planned at nor the devices (Hardware turns them into
# seconds later); they are a function of the graph the pass sees, its nodes' fake values (the
# capture's, or made from them by the earlier passes) and the flop formulas. The passes before
# (capture .. split_lm_head) are deterministic, so the same capture, mode, loss output and LM head
# shard count give the same graph. The compile_graph pass keeps the costs on the Captured
# (`Captured.costs`) under graph_key: every node's name, op, target, arguments (nodes by name) and
# the meta the pass reads (rp_kind, rp_requires_grad, rp_param_slice), with the formulas
# registered; a graph with that key takes the same NodeCosts (frozen) and size estimates. A
# capture's fake values live in its own FakeTensorMode, so the costs are not shared between
# captures (two captures of one model are two keys). A cost warning ("could not measure") is not
# repeated for the same graph (Python's default filter shows it once anyway). A graph the key
# misses (a re-plan at a new length splits the LM head into other shards) still finds most of its
# nodes measured: the measurements (FLOPs, saved bytes, which outputs need gradients) are kept on
# the Captured too (`Captured.node_costs`), by node signature (op, target, inputs' symbolic shapes,
# strides and dtypes, gradient and parameter flags, grad mode, autocast), which is all they depend
# on within one FakeTensorMode (and, with the size symbols' hints and ranges, for the process:
# Note [measurements across captures]). A CPU re-plan of a 28-layer Qwen3 graph: the pass took 1.3 s
# measuring afresh, 0.77-0.84 s with the kept measurements (the rest: signatures and sizes).
@dataclass(frozen=True)
class _Ref:
    name: str


def graph_key(gm: fx.GraphModule) -> tuple:
    """What annotate_costs' results depend on within one capture (Note [costs per capture])."""
    _register_grouped_mm()
    nodes = []
    for n in gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
        entry = (n.name, n.op, n.target, args, n.meta.get("rp_kind"), n.meta.get("rp_requires_grad"),
                 n.meta.get("rp_param_slice"))
        try:
            hash(entry)
        except TypeError:   # slices (before Python 3.12) and such: their text
            entry = tuple(x if i < 2 else repr(x) for i, x in enumerate(entry))
        nodes.append(entry)
    return tuple(nodes), tuple(EXTRA_FLOP_FORMULAS.items())


def graph_costs(gm: fx.GraphModule) -> tuple:
    """The costs annotate_costs set on gm: ({node name: NodeCost}, size estimates)."""
    return ({n.name: c for n in gm.graph.nodes if (c := n.meta.get("rp_cost")) is not None},
            dict(gm.meta.get("rp_size_estimates", {})))


def set_costs(gm: fx.GraphModule, costs: tuple) -> fx.GraphModule:
    """annotate_costs' result from graph_costs of a graph with the same graph_key."""
    by_name, estimates = costs
    for n in gm.graph.nodes:
        if n.name in by_name:
            n.meta["rp_cost"] = by_name[n.name]
    gm.meta["rp_size_estimates"] = dict(estimates)
    return gm
