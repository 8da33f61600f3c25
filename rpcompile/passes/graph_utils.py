"""Small graph helpers shared by the passes: impurity, dead code, copies, device retargeting,
cross-entropy arguments."""
from __future__ import annotations

import inspect
import operator
import re

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

_SIDE_EFFECT_FUNCTIONS = {torch._C._log_api_usage_once}
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


_SOURCE_KEY = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def call_leaf_name(source: str) -> str:
    """The leaf name (leaf_names: the call's argument as errors and Config.unbatched name it) of a
    dynamo source: "L['kwargs']['input_ids']" or the capture's "L['k']['input_ids']" ->
    "input_ids", "L['args'][0]['ids']" or "L['a'][0]['ids']" -> "args[0]['ids']"; another local,
    as a compiled forward's "L['labels']" or "L['stack0'].last_hidden_state", by its name."""
    parts = [k or int(i) for k, i in _SOURCE_KEY.findall(source)]
    rest = "".join(f"[{p!r}]" for p in parts[2:])
    if len(parts) >= 2 and parts[0] in ("k", "kwargs"):
        return f"{parts[1]}{rest}"
    if len(parts) >= 2 and parts[0] in ("a", "args"):
        return f"args[{parts[1]}]{rest}"
    return str(parts[0]) if parts else source


# Note [module path]: dynamo records in nn_module_stack every module a node was traced in,
# outermost first, each by its source path: the model's chain nests (`L['model'].model`,
# `L['model'].model.layers.0`, `...layers.0.self_attn`). A module kept elsewhere can sit inside
# it: transformers 5.25 wraps `apply_rotary_pos_emb` in a module held by its modeling file,
# recorded as `G['__import_..._modeling_qwen3'].apply_rotary_pos_emb` inside the attention. Such
# an entry does not extend the chain, and taken as the node's module it put the rotary nodes of
# every layer outside their layer (regions cut 11 pieces for 5; plans named the layers wrong).
def module_path(node: fx.Node):
    """The source path of the innermost module of the model's own chain that `node` was traced
    in (Note [module path]), or None without a module stack."""
    chain = None
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        path = str(entry[0] if isinstance(entry, tuple) else entry)
        if chain is None or path == chain or (path.startswith(chain) and path[len(chain)] in ".["):
            chain = path
    return chain


def bind_call(node: fx.Node, fn, signature: inspect.Signature):
    """The arguments of a call of `fn` (whose signature is given) by name, defaults filled in;
    None for other nodes or calls that do not bind."""
    if node.op != "call_function" or node.target is not fn:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def bind_cross_entropy(node: fx.Node):
    """The arguments of an `F.cross_entropy` node by name, defaults filled in (None for other
    nodes or calls that do not bind)."""
    return bind_call(node, F.cross_entropy, _CROSS_ENTROPY)


_SETITEM = {operator.setitem, torch.Tensor.__setitem__}
# `self.b += 1` on a tensor: dynamo records operator.iadd, an in-place update whose value a
# buffer's update need not read (dropped as dead code, a counter buffer was never updated)
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}
# Checks a model makes of its values (`torch._assert_async(cond, msg)`): nothing reads their value,
# their effect is the error; dropped as dead code, a model's own check never ran.
_CHECKS = {torch._assert_async, torch._assert, torch.ops.aten._assert_async.default,
           torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default}
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.imatmul}
# Named like in-place ops (a trailing underscore) but pure: `a & b`, `a | b`, `not a`, `a is b`.
_PURE_UNDERSCORED = {operator.and_, operator.or_, operator.not_, operator.is_}


def _functorch_switches():
    from torch._functorch import predispatch as fp
    enter = {getattr(fp, n) for n in ("_vmap_increment_nesting", "_jvp_increment_nesting", "_enter_dual_level")
             if hasattr(fp, n)}
    leave = {getattr(fp, n) for n in ("_vmap_decrement_nesting", "_jvp_decrement_nesting", "_exit_dual_level")
             if hasattr(fp, n)}
    return enter, leave


# Note [functorch regions]: torch.vmap inside a model (Mamba's parallel scan; transformers' mask
# functions) is captured as a region: _vmap_increment_nesting, ops on batched tensors between
# _add_batch_dim and _remove_batch_dim, _vmap_decrement_nesting. The switches have no users
# but must run (is_impure), a stage holds a region whole (cut_points), and the cost pass does
# not re-run them.
FUNCTORCH_ENTER, FUNCTORCH_LEAVE = _functorch_switches()


# Note [grad-mode regions]: `with torch.no_grad():` inside forward (HRM's recurrence runs its
# early cycles so, a 1-step gradient) is captured as two switches, _set_grad_enabled(False)
# and (True), with no users. Dropped as dead code, the region's ops took gradients: a tiny
# HrmText's were 10% of the largest gradient off eager's (tests/zoo.py; 0.04% at the any-model
# sweep's sizes), silently, the loss exact. The switches must run (is_impure),
# and a stage holds a grad-disabled region whole (cut_points), so every stage starts and ends
# with gradients on, as the capture had them (Note [plans made with gradients on]).
GRAD_SWITCH = torch._C._set_grad_enabled


def grad_off_positions(body: list) -> set:
    """Positions (of `body`, a graph's nodes in order) inside a grad-disabled region: after a
    _set_grad_enabled(False) up to the _set_grad_enabled(True) that ends it, inclusive."""
    inside, off = set(), False
    for p, node in enumerate(body):
        if off:
            inside.add(p)
        if node.op == "call_function" and node.target is GRAD_SWITCH:
            off = not bool(node.args[0]) if node.args else off
    return inside


def mutated_values(node: fx.Node) -> list:
    """The graph values an in-place node writes into: x of `x[i] = v` (operator.setitem),
    `x += y` (operator.iadd), `x.add_(y)`, `torch.Tensor.add_(x, y)`, a mutable aten op's first argument, or an `out=`."""
    targets = []
    if node.op == "call_function" and node.target in _SETITEM:
        targets.append(node.args[0])
    elif node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:   # x += y on a tensor
        if isinstance(node.args[0], fx.Node) and isinstance(node.args[0].meta.get("example_value"), torch.Tensor):
            targets.append(node.args[0])
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        if node.target._schema.is_mutable and node.args:
            targets.append(node.args[0])
    elif node.op in ("call_method", "call_function") and node.args and node.target not in _PURE_UNDERSCORED:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
            targets.append(node.args[0])
    if node.op in ("call_method", "call_function"):
        targets.append(node.kwargs.get("out"))
    return [t for t in torch.utils._pytree.tree_leaves(targets) if isinstance(t, fx.Node)]


def node_value(node):
    """The node's fake value: dynamo's ``example_value`` (``val`` in AOT/export graphs); what is
    not a node (a constant argument) is its own value."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def op_name(n: fx.Node):
    """A call's function or method name (`softmax` for torch.softmax, F.softmax and x.softmax), or None."""
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", None)


def is_impure(node: fx.Node) -> bool:
    """True for nodes that must run even when nothing reads their value (in-place updates)."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_function" and node.target in _SETITEM:
        return True   # x[i] = v: its value is None, its effect is on x (MoE layers invert a permutation so)
    if node.op == "call_function" and node.target in _CHECKS:
        return True
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        first = node.args[0] if node.args else None
        return isinstance(first, fx.Node) and isinstance(node_value(first), torch.Tensor)
    if node.op == "call_function" and (node.target in FUNCTORCH_ENTER or node.target in FUNCTORCH_LEAVE):
        return True   # Note [functorch regions]
    if node.op == "call_function" and node.target is GRAD_SWITCH:
        return True   # Note [grad-mode regions]
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in _SIDE_EFFECT_FUNCTIONS:
            return False  # logging only: safe to drop
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.is_mutable
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and node.target not in _PURE_UNDERSCORED:
            return True
        if node.target is torch.nn.functional.batch_norm:
            return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False))
    return False


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop nodes whose values nobody reads, keeping in-place updates, here and in the bodies of
    higher-order ops the graph calls.

    Note [dead code in bodies]: torch's Graph.eliminate_dead_code takes our purity test for the
    graph itself but recurses into the bodies it reaches by get_attr (a torch.utils.checkpoint's
    `wrap_body_0`) with its own, for which `x.copy_(y)` is pure: a checkpointed block that filled
    a `new_empty` buffer by `copy_` lost the copies, and trained on uninitialised memory (loss
    8.7e32 against eager's 1.3; DeepSeek-V3's attention builds its keys so). So each body gets the
    same test."""
    graph = gm.graph
    graph.lint()
    for node in reversed(graph.nodes):
        if not node.users and not is_impure(node):
            graph.erase_node(node)
    bodies = {n.target for n in graph.find_nodes(op="get_attr")}
    for name, child in gm.named_children():
        if name in bodies and isinstance(child, fx.GraphModule):
            eliminate_dead_code(child)
    gm.recompile()
    return gm


def output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def symbol_hints(shape_env) -> dict:
    """A ShapeEnv's values of its backed symbols where it traced them (torch 2.13's
    backed_var_to_val, var_to_val before it)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val


def size_hint(size) -> int:
    """A size's value where it was traced; for one the data decides (an unbacked symbol, as
    SmolVLM's image features after it drops padding images by a mask), dynamo's optimization hint
    (1 where it has none: only a plan's costs read it)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    if size.node.hint is not None:
        return int(size.node.hint)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
        return int(optimization_hint(size, fallback=1))
    except Exception:   # noqa: BLE001 - another torch (2.11 has size_hint), or no hint at all
        try:
            return int(size.node.shape_env.size_hint(size.node.expr))
        except Exception:   # noqa: BLE001
            return 1


def output_values(graph: fx.Graph) -> list:
    return pytree.tree_leaves(output_node(graph).args[0])


def scalar_outputs(graph: fx.Graph) -> list:
    """Positions of the 0-d tensor outputs."""
    return [i for i, v in enumerate(output_values(graph)) if isinstance(v, fx.Node)
            and isinstance(v.meta.get("example_value"), torch.Tensor) and v.meta["example_value"].dim() == 0]


def set_outputs(gm: fx.GraphModule, values: list) -> None:
    out = output_node(gm.graph)
    out.args = (tuple(values),)
    gm.recompile()


def map_devices(value, mapping):
    """Replace torch.device constants (inside args/kwargs) by mapping[device.type]."""
    if isinstance(value, torch.device):
        return mapping.get(value.type, value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_devices(v, mapping) for v in value)
    if isinstance(value, dict):
        return {k: map_devices(v, mapping) for k, v in value.items()}
    return value


def graph_module(root, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """Note [lazy graph modules]: a GraphModule whose Python code is generated when it is first
    called or its `.code` read, not when it is built (torch's _LazyGraphModule, which Dynamo uses
    for the same reason). The passes build hundreds of graph modules that never run (the graphs
    between rewrites; a plan's stage graphs, of which the devices run retargeted copies):
    generating their code was 2.4 of 6.2 s of a re-plan for a new length on the CPU
    (28-layer Qwen3 graph). runtime/programs.py generates the code of a program when it is
    built for a device, and of a piece before torch.compile traces it (`generate_code`)."""
    return _LazyGraphModule(root, graph, class_name=class_name)


def generate_code(gm: fx.GraphModule) -> fx.GraphModule:
    """The Python code of a lazy graph module and of its graph-module children, generated now
    (in this thread: worker threads may share a program, Note [lazy graph modules])."""
    for m in gm.modules():
        if isinstance(m, _LazyGraphModule):
            m.real_recompile()
    return gm


def clone_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm whose graph (and node metas, shallowly) can be rewritten independently."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    new = graph_module(gm, g, type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def retarget(gm: fx.GraphModule, mapping: dict) -> fx.GraphModule:
    """A copy of gm (and of its GraphModule children) with device constants mapped by type."""
    children = {name: retarget(m, mapping) for name, m in gm.named_children() if isinstance(m, fx.GraphModule)}
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda x: env[x])
        new.args, new.kwargs = map_devices(new.args, mapping), map_devices(new.kwargs, mapping)
        env[n] = new
    root = dict(children)
    for n in g.nodes:
        if n.op in ("get_attr", "call_module") and n.target not in root:
            root[n.target] = gm.get_submodule(n.target) if n.op == "call_module" else getattr(gm, n.target)
    return graph_module(root, g, type(gm).__name__)
