"""Capture traces a model's repeated layers once (Note [layers traced once]).

Note [layers traced once]: TorchDynamo traces a model call bytecode by bytecode, every decoder
layer anew: capturing Qwen3-1.7B (28 layers) took 12.9-16.3 s of its first step on the GPU host
(2 H200s, torch 2.11; 5.0 s on a quiet CPU with torch 2.13), while the worker processes waited
for the plan. PyTorch's hierarchical compilation (`torch.compiler.nested_compile_region`) has
dynamo trace a marked function once and stamp out the traced subgraph for every later call
whose inputs and guards agree (an `invoke_subgraph` node per call, the layer's weights as its
operands). So, during the capture only, the forward of each module class repeated in a ModuleList or Sequential (the
outermost such lists: not the experts inside a repeated layer) is marked, and afterwards each
`invoke_subgraph` node is replaced by a copy of its subgraph's nodes, the module paths in their
`nn_module_stack` moved from the traced layer to the called one, and the sizes the subgraph
asked for that nothing reads dropped (dynamo's outer graph drops them too). For Qwen3 and Llama
layers the passes then see the graph a plain capture gives: the same calls in the same order,
each node in its own layer (the test compares the two); elsewhere a layer's calls on its weights
alone can come first in it (Falcon's `weight.T`), still within the layer, and a size product
the plain capture computed once for all layers is computed in each (Qwen3-MoE's `8 * s0`).
Where a call's guards differ (a layer reads its own index), dynamo traces it again, up to one
entry per layer.
A layer whose sizes depend on the data (an MoE layer's torch.where) is not stamped out: its
copies would share the first layer's unbacked symbols where a plain capture gives each its own;
then, as wherever marking fails, the capture runs again unmarked (the marked capture, which
traced one layer and stamped out the rest, is thrown away). Measured on CPU (torch 2.13, fake
copies): Qwen3-1.7B 5.0 -> 2.5 s, Llama-3.1-8B 4.7-5.0 -> 2.5-3.3 s. Only where dynamo reuses a
region's trace (`_stamps_out`): not with the GPU host's torch 2.11, so not yet measured there.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import types

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


# Fewer repeats are not marked: stamping a copy out costs about a third of tracing it, and the
# first trace in a region costs ~0.5 s more (Qwen3-shaped layers on CPU: 8 layers 1.9 s against
# 2.1 s plain, 28 layers 2.5 s against 5.0 s).
MIN_REPEATS = 8


def repeated_classes(model: torch.nn.Module) -> dict:
    """{module class: how many times it repeats} of the classes of modules with modules of their
    own (layers, not single Linears: a region costs its call more than it saves) repeated within
    one ModuleList or Sequential, only the outermost lists (one inside a repeated module is its
    business)."""
    found: dict = {}
    inside: list = []          # path prefixes of repeated modules found so far
    for path, mod in model.named_modules():
        if any(path.startswith(p) for p in inside):
            continue
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            counts: dict = {}
            for child in mod.children():
                if next(child.children(), None) is not None:    # a layer, not a Linear: worth a region
                    counts[type(child)] = counts.get(type(child), 0) + 1
            for cls, n in counts.items():
                if n >= MIN_REPEATS and isinstance(getattr(cls, "forward", None), types.FunctionType):
                    found[cls] = max(found.get(cls, 0), n)
                    inside.append(f"{path}." if path else "")
    return found


@contextlib.contextmanager
def marked(model: torch.nn.Module):
    """The forwards of the model's repeated module classes marked as nested compile regions
    while the block runs; the classes as they were afterwards."""
    saved = []
    try:
        for cls, n in (repeated_classes(model) if _stamps_out() else {}).items():
            fn = cls.forward
            # a copy carries the marks (the original function stays unmarked); dynamo keys its
            # reuse on the code object, which the copy shares
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__kwdefaults__, copy.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
            copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
            saved.append((cls, "forward" in cls.__dict__, cls.__dict__.get("forward")))
            # one reuse entry per layer at most: dynamo raises past max_reuse_entries
            cls.forward = torch.compiler.nested_compile_region(copy, max_reuse_entries=max(8, n))
        yield bool(saved)
    finally:
        for cls, own, fn in reversed(saved):
            if own:
                cls.forward = fn
            else:
                del cls.forward


def _stamps_out() -> bool:
    """Whether dynamo reuses a region's trace: its reuse entries came with `max_reuse_entries`.
    Torch 2.11's traces every marked call anew, slower than inlining it (Qwen3-1.7B on the GPU
    host: 11.6-15.1 s marked against 8.5-10.2 s plain), so there nothing is marked."""
    return "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters


class NotStamped(Exception):
    """A region whose copies cannot be stamped out of one trace: the capture runs unmarked."""


def inline_regions(gm: fx.GraphModule) -> int:
    """Replace every invoke_subgraph call in gm by its subgraph's nodes; the number replaced."""
    graph, done = gm.graph, 0
    used = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.invoke_subgraph:
            continue
        body_node, operands = node.args[0], node.args[2:]
        body = getattr(gm, body_node.target)
        inner = body.graph
        if body_node.target not in used and _data_dependent(inner):
            raise NotStamped(f"{body_node.target} has sizes that depend on the data")
        used.add(body_node.target)
        env: dict = {}
        placeholders = [n for n in inner.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise NotStamped(f"invoke_subgraph {node.name}: {len(operands)} operands for "
                             f"{len(placeholders)} inputs of {body_node.target}")
        env.update(zip(placeholders, operands))
        move = _path_move(node, inner)
        outputs = None
        with graph.inserting_before(node):
            for n in inner.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = n.args[0]
                    continue
                if n.op == "get_attr":
                    raise NotStamped(f"invoke_subgraph {node.name}: its subgraph reads attribute {n.target}")
                copy = graph.node_copy(n, lambda a: env[a])
                stack = copy.meta.get("nn_module_stack")
                if stack and move:
                    copy.meta["nn_module_stack"] = _moved(stack, *move)
                env[n] = copy
        results = [env[o] if isinstance(o, fx.Node) else o
                   for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
        for user in list(node.users):
            if user.op == "call_function" and user.target.__name__ == "getitem" and len(user.args) == 2:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
            else:
                raise NotStamped(f"invoke_subgraph {node.name} is used whole by {user.name}")
        graph.erase_node(node)
        # dynamo's subgraphs keep sizes the layer's code asked for and nothing reads, which its
        # outer graph drops: dropped too (only those: an unread in-place op is not dead)
        for copy in reversed(list(env.values())[len(placeholders):]):
            if not copy.users and _unread_size(copy):
                graph.erase_node(copy)
        done += 1
    for n in list(graph.nodes):
        if n.op == "get_attr" and n.target in used and not n.users:
            graph.erase_node(n)
    for name in used:
        if hasattr(gm, name):
            delattr(gm, name)
    gm.recompile()
    return done


def _data_dependent(graph: fx.Graph) -> bool:
    """Whether a subgraph makes sizes from data (an MoE layer's torch.where): each copy would
    share the first trace's unbacked symbols, where a plain capture gives each its own."""
    return any(free_unbacked_symbols(n.meta.get("example_value")) for n in graph.nodes)


def _unread_size(node: fx.Node) -> bool:
    """A size or an element of one: `x.size()`, `size[1]`."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "call_method" and node.args[0].target == "size")


def _path_move(call: fx.Node, inner: fx.Graph):
    """(path traced, path called): the module path the subgraph's nodes were traced under (the
    first call's layer) and the one this call runs, from the call node's own module stack."""
    called = _last_path(call.meta.get("nn_module_stack"))
    depth = len(call.meta.get("nn_module_stack") or {})     # the called layer's place in a stack
    traced = None
    for n in inner.nodes:
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        if len(stack) >= depth > 0:     # (the subgraph's stacks run from the model's root)
            traced = _path(stack[depth - 1])
            break
    if called is None or traced is None or called == traced:
        return None
    return traced, called


def _path(entry):
    return entry[0] if isinstance(entry, tuple) else str(entry)


def _last_path(stack):
    return _path(list(stack.values())[-1]) if stack else None


def _moved(stack: dict, traced: str, called: str) -> dict:
    out = {}
    for key, entry in stack.items():
        path = _path(entry)
        if path == traced or path.startswith(traced + ".") or path.startswith(traced + "["):
            path = called + path[len(traced):]
            key = f"{key}:{called}"     # a module of its own per layer (the key names a module)
            entry = (path, *entry[1:]) if isinstance(entry, tuple) else path
        out[key] = entry
    return out
