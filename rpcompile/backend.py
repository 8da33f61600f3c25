"""`torch.compile(model, backend="rpcompile")`: the same compiler as a dynamo backend.

Note [sizes a graph returns]: where a forward breaks its graph (a print, an unsupported call) under
`dynamic=True`, dynamo hands the size the next graph reads (`n = h.shape[0]` before the break) out
of the first graph as an output, a SymInt. rpcompile's stage jobs return tensors, and the plan
refused the graph ("returns a non-tensor value computed in forward"). A size is a function of the
call's sizes: the backend takes it out of the graph and computes it per call from the sizes of
the arguments, putting it back at its place among the outputs.

Note [graphs shared by modules]: dynamo passes a module's parameters and buffers to its graph as
inputs, so one graph serves every module whose forward it traced alike (each expert of an MoE
layer whose loop over experts breaks the graph, compiled frame by frame): the plan read the
parameters it was captured with, the first expert's, for all of them (a loop MoE's loss 0.04 off
eager's, every gradient given to one expert). A call passing other parameters or buffers gets a
plan of its own, bound to them.

Note [module floats]: under `dynamic=True` dynamo passes a module's float attributes (a norm's
epsilon, the attention's dropout probability and scale) as 0-d tensors and the graph `.item()`s
them. SDPA's `dropout_p` was then an fx node, not 0.0, so every stage job with attention was
taken as random: it stayed eager (ProgramCache.use_inductor) and replayed RNG streams it never
drew from; and each `.item()` broke the Inductor piece compiled around it. Such a float is module
state, not data: the backend reads it as the constant it is and compiles the graph with it, and a
call that passes another value (an attribute changed since) gets a plan of its own. Floats the
call passes as arguments stay as dynamo gives them (a per-call number would re-plan every call).

Note [the loss's backward ahead through the backend]: a backend's graph carries no training flag
(dynamo guards the modules' flags but hands over only the graph), and a backend trains by calls
alone, `loss.backward()` after each. So every call under autograd runs its loss's stage job
forward and backward at once, as rpcompile.compile's calls do in training mode (Note [the loss's
backward ahead] in runner.py). Where dynamo breaks the forward, only a graph whose fused stage
computes a 0-d loss runs ahead; a backward that brings it any other gradient (the graph's hidden
states, read by a later graph's loss) runs that job again, with eager's result. A call under
autograd that is never differentiated (an evaluation without torch.no_grad()) computes that
job's backward for nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Optional

import sympy
import torch
import torch.fx as fx

from .capture import dynamo_input_name, dynamo_source_name, from_dynamo
from .config import Config
from .errors import CaptureError
from .passes import compile_graph
from .passes.graph_utils import output_node
from .runner import GraphRunner


def backend(config: Optional[Config] = None):
    """A dynamo backend running the graph as rpcompile stages: torch.compile(m, backend=rpcompile.backend(cfg))."""
    config = config or Config()
    runner = GraphRunner(config)
    plans = []
    said = []

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        if not said and _warn_if_dtype_not_applied(config, example_inputs):
            said.append(True)
        symbolic = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        _inline_numbers(gm)
        sizes, sources = _take_out_sizes(gm, symbolic), _size_sources(symbolic)

        def bound_plan(bound):
            plans.append(compile_graph(bound, config, "call"))
            return plans[-1]

        def plans_of(graph_module):
            cap = from_dynamo(graph_module, example_inputs)
            _sizes_given(cap, symbolic)
            plans.append(compile_graph(cap, config, "call"))
            return _plans_by_module_state(cap, plans[-1], bound_plan)
        plan_for = _plans_by_module_floats(gm, example_inputs, plans_of)

        def run(*flat_args):
            # a call under autograd is a training call: Note [the loss's backward ahead through the backend]
            outputs = runner.call(plan_for(flat_args), list(flat_args), ahead=True)
            if not sizes:
                return outputs
            outputs = list(outputs)
            bound = {sym: sympy.Integer(int(flat_args[at] if d is None else flat_args[at].shape[d]))
                     for sym, (at, d) in sources.items()}
            for at, expr in sizes:
                outputs.insert(at, int(expr.xreplace(bound)))
            return outputs

        return run

    compile_fn.plans = plans   # every plan made (one per graph dynamo handed over at least), newest last
    compile_fn.runner = runner
    return compile_fn


# Note [the backend's dtype]: rpcompile.compile traces the model itself on copies of its
# parameters in the compute dtype (Config.dtype; bf16 on GPUs), so the graph's casts (RMSNorm's
# upcast and the cast back to the input's dtype) are those of a bf16 run, while the host keeps
# the model's fp32 masters. A backend is handed a graph dynamo traced in the model's own dtype,
# those casts fixed in it, so it runs as traced, weights and all in that dtype: Config.dtype
# cannot apply. It did not say so: on one H100 Qwen3-1.7B (fp32) trained through the backend at
# 3,429 tokens/s, against 24,866 through rpcompile.compile in bf16 (benchmarks/runs/backend_ahead/).
# So the first graph whose floating parameters are not in the compute dtype says so, once.
def _warn_if_dtype_not_applied(config, example_inputs) -> bool:
    """Warns where the compute dtype Config asks for differs from the graph's (Note [the
    backend's dtype]); whether it did."""
    want = config.compute_dtype
    have = sorted({str(t.dtype).replace("torch.", "") for t in example_inputs
                   if isinstance(t, torch.nn.Parameter) and t.is_floating_point() and t.dtype != want})
    if want is None or not have:
        return False
    dtype, graph = str(want).replace("torch.", ""), " and ".join(have)
    default = "" if config.dtype is not None else " (the default on GPUs)"
    warnings.warn(f"rpcompile.backend: this graph runs in {graph}, the dtype dynamo traced the model in: the "
                  f"compute dtype {dtype}{default} applies only to rpcompile.compile, which traces the model itself "
                  f"in it and keeps the model's parameters as host masters. For {dtype} compute use "
                  f"rpcompile.compile(model, config), or give torch.compile a model in {dtype}; "
                  f"Config(dtype=torch.{have[0]}) runs this graph as it is without this warning.", stacklevel=3)
    return True


def _plans_by_module_state(cap, plan, compile):
    """flat_args -> the plan reading the parameters and buffers this call passes (Note [graphs
    shared by modules]); compile(bound capture) -> a new one."""
    at = {kind: [i for i, n in enumerate(cap.placeholders()) if n.meta.get("rp_kind") == kind]
          for kind in ("param", "buffer")}
    others: dict = {}     # ids of the state a call passes -> its plan (which holds that state)

    def plan_for(flat_args):
        params, buffers = ([flat_args[i] for i in at[kind]] for kind in ("param", "buffer"))
        if all(a is b for a, b in zip(params + buffers, cap.params + cap.buffers)):
            return plan
        key = tuple(map(id, params + buffers))
        if key not in others:
            others[key] = compile(dataclasses.replace(cap, params=params, buffers=buffers))
        return others[key]
    return plan_for


def _plans_by_module_floats(gm, example_inputs, plans_of):
    """flat_args -> the plan for the values of the module floats this call passes (Note [module
    floats]), each compiled by plans_of(graph with those values inlined) -> flat_args -> plan.
    The plan for the example inputs' values is compiled now."""
    floats = [at for at, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
              if _is_module_float(node, example_inputs[at])]
    by_values: dict = {}

    def plan_for(flat_args):
        values = tuple(float(flat_args[at]) for at in floats)
        if values not in by_values:
            graph_module = gm
            if floats:     # (a copy: a later value inlines into the graph as dynamo gave it)
                graph_module = fx.GraphModule(gm, copy.deepcopy(gm.graph))
                _inline_floats(graph_module, dict(zip(floats, values)))
            by_values[values] = plans_of(graph_module)
        return by_values[values](flat_args)
    plan_for(example_inputs)
    return plan_for


def _is_module_float(node: fx.Node, example) -> bool:
    """A float attribute of a module that dynamo passes as a 0-d tensor (Note [module floats])."""
    arg = node.meta.get("grapharg")
    if arg is None or not arg.pass_arg_as_tensor:
        return False
    if not (isinstance(example, torch.Tensor) and example.dim() == 0 and example.is_floating_point()):
        return False
    return dynamo_input_name(dynamo_source_name(node))[1]


def _inline_floats(gm: fx.GraphModule, values: dict) -> None:
    """Each `.item()` of the placeholders at the positions `values` names becomes that number."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for at, value in values.items():
        for item in [u for u in placeholders[at].users if u.op == "call_method" and u.target == "item"]:
            item.replace_all_uses_with(value)
            gm.graph.erase_node(item)
    gm.recompile()


def _inline_numbers(gm: fx.GraphModule) -> None:
    """Note [numbers dynamo passes]: under dynamic=True dynamo passes an int argument the graph
    specialised on (a guard holds its value: the loss's `ignore_index=-100`) as an input, whose
    example value is the number. The passes read such arguments as constants (a mean
    cross-entropy's ignore_index: taken as another loss, its microbatches were weighed by rows, a
    loss 0.005 off eager's on GPT-2 with ignored labels), so its uses read the number itself."""
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        ev = node.meta.get("example_value")
        if isinstance(ev, torch.SymInt) and ev.node.expr.is_Integer:
            ev = int(ev.node.expr)
        if not isinstance(ev, int) or isinstance(ev, bool):
            continue
        for user in list(node.users):
            user.args = fx.map_arg(user.args, lambda a, node=node, ev=ev: ev if a is node else a)
            user.kwargs = fx.map_arg(user.kwargs, lambda a, node=node, ev=ev: ev if a is node else a)
    gm.recompile()


def _take_out_sizes(gm: fx.GraphModule, symbolic: list) -> list:
    """[(output position, sympy expression)] of the sizes gm returns, removed from its outputs
    (Note [sizes a graph returns]). symbolic: the placeholders' example values."""
    out = output_node(gm.graph)
    values = out.args[0]
    if not isinstance(values, (tuple, list)):
        return []
    sizes, kept = [], []
    for at, v in enumerate(values):
        ev = v.meta.get("example_value") if isinstance(v, fx.Node) else v
        if isinstance(ev, torch.SymInt):
            sizes.append((at, ev.node.expr))
        elif isinstance(ev, int) and not isinstance(ev, bool):
            sizes.append((at, sympy.Integer(ev)))
        else:
            kept.append(v)
    if not sizes:
        return []
    for _, expr in sizes:
        if not expr.free_symbols <= set(_size_sources(symbolic)):
            raise CaptureError(f"the graph returns a size ({expr}) that is not a function of the sizes of its "
                               "arguments (a count of the data's values): return it as a tensor")
    out.args = (type(values)(kept),)
    gm.recompile()
    return sizes


def _sizes_given(cap, symbolic: list) -> None:
    """A size argument that is no dimension of a tensor argument (a size the graph before a break
    returned: Note [sizes a graph returns]) is bound to the argument itself, whole-call value in
    every microbatch, as the graph was given it."""
    of_tensors = {s.node.expr for ex in symbolic if isinstance(ex, torch.Tensor) for s in ex.shape
                  if isinstance(s, torch.SymInt)}
    for at, node in enumerate(cap.placeholders()):
        ex = symbolic[at]
        if isinstance(ex, torch.SymInt) and ex.node.expr not in of_tensors:
            node.meta["rp_arg_index"] = (at, None)


def _size_sources(symbolic: list) -> dict:
    """Each size symbol of the placeholders' example values -> where a call holds its value:
    (argument position, None) for a size argument, (position, dim) for a tensor's dimension."""
    sources = {}
    for at, ex in enumerate(symbolic):
        if isinstance(ex, torch.SymInt) and isinstance(ex.node.expr, sympy.Symbol):
            sources.setdefault(ex.node.expr, (at, None))
        elif isinstance(ex, torch.Tensor):
            for d, s in enumerate(ex.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    sources.setdefault(s.node.expr, (at, d))
    return sources


def rpcompile_backend(gm, example_inputs):
    """The backend registered as "rpcompile" (default Config: devices=["cpu"])."""
    return backend()(gm, example_inputs)
