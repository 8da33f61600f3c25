"""Compiled plan pieces (stage programs, compute graphs, whole `Stage`s) as bytes for another
process: `dumps(obj)`, `loads(data)`.

Why: stage jobs are to run in one worker process per device, which holds nothing of the main
process's (forked from a launcher that only imported rpcompile: Note [worker launcher]), so the
plan's pieces must pickle. Plain pickle fails on them: torch.fx unpickles a
GraphModule by re-tracing its code symbolically, and our programs call plain Python functions
(`ops.compute(job, mb, graph, ...)`, `ops.fetch_value`) that cannot run on Proxies; torch 2.13
pickles no `OpOverload` (aten ops, our `torch.ops.rpcompile.*`); node meta holds fake tensors.

So a GraphModule, at any depth, travels as what rebuilds it without tracing: its base class and
class name, its nodes (node references as names; type annotations only where they pickle), the
attributes its get_attr/call_module nodes name (child GraphModules, tensors: recursively) and
its module `meta` (entries that pickle; `rp_*` ones must). `loads` rebuilds it with
`Graph.create_node`: same names, same code. Op overloads travel by name.

Node meta is dropped except what is read after a plan is built:
- `nn_module_stack`: the runner cuts compute graphs at repeated blocks from it (regions.py),
  reading the module paths only. So each entry goes as (module path, the class's qualified
  name): loading a plan imports none of the model's modules (transformers: 3.9 s and 128 MiB a
  worker on the sandbox), and a class a worker could not import (from `__main__`, local) is no
  different.
- `rp_*` (Note [rp_* node meta] in passes) and `is_wrapped` (torch.fx's code generation).
Fake values (`example_value`, `val`, ...) stay behind, so `runtime.fake.trace_job` needs the
original plan. A SymInt, fake tensor or fx Node still reachable, or anything else that does not
pickle, is a PortableError; inside a graph it names the graph, the node or attribute, and what.
"""
from __future__ import annotations

import io
import pickle
import sys

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor

from . import ops as _ops   # noqa: F401  (registers torch.ops.rpcompile.* before a program unpickles)

_KEPT_META = ("nn_module_stack", "is_wrapped")   # besides every key starting with "rp_"


class PortableError(pickle.PicklingError):
    """A plan piece holds something that cannot be sent to a worker; the message says where."""


def dumps(obj) -> bytes:
    """obj (a GraphModule, a Stage, any structure holding them) as bytes for `loads`."""
    buf = io.BytesIO()
    try:
        _Pickler(buf).dump(obj)
    except Exception as e:
        # Find the node or attribute that failed: pickle again, each node's parts separately.
        try:
            _Pickler(_Discard(), diagnose=True).dump(obj)
        except PortableError as located:
            raise located from e
        except Exception:
            pass
        raise PortableError(f"cannot send {type(obj).__name__} to another process: {e}") from e
    return buf.getvalue()


def loads(data: bytes):
    """The object `dumps` made, GraphModules rebuilt without tracing."""
    return pickle.loads(data)


class _Discard:
    def write(self, b):
        return len(b)


class _Pickler(pickle.Pickler):
    """Pickles GraphModules as their nodes (no re-tracing on load) and op overloads by name.
    diagnose: pickle each node's target, args, kwargs and kept meta, and each attribute,
    on its own, and raise a PortableError naming the first that fails."""

    def __init__(self, file, diagnose=False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.diagnose = diagnose

    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):
            state = _graph_module_state(obj)
            if self.diagnose:
                _check_state(obj, state)
            return _rebuild_graph_module, state
        if isinstance(obj, OpOverload):
            return _op_overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, OpOverloadPacket):
            ns, name = obj._qualified_op_name.split("::")
            return _op_overload, (ns, name, None)
        if isinstance(obj, HigherOrderOperator):
            return _higher_order_op, (obj._name,)
        if isinstance(obj, torch.types.py_sym_types):
            raise pickle.PicklingError(f"a symbolic value ({type(obj).__name__} {obj}) cannot be sent to another "
                                       "process; it belongs to the capture's shape environment")
        if isinstance(obj, FakeTensor):
            raise pickle.PicklingError("a fake tensor cannot be sent to another process (capture-time metadata)")
        if isinstance(obj, fx.Node):
            raise pickle.PicklingError(f"a torch.fx.Node ({obj.name}) outside its graph's node list cannot be sent "
                                       "to another process")
        return NotImplemented


# --- GraphModules --------------------------------------------------------------------------
class _Ref:
    """A reference to the node of that name, in a node's args or kwargs."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _map(a, fn):
    """fn applied to the leaves of a node argument, as torch.fx.node.map_aggregate does it
    (tuples, namedtuples, lists, dicts, slices), with plain lists and dicts out."""
    if isinstance(a, tuple):
        t = tuple(_map(x, fn) for x in a)
        return type(a)(*t) if hasattr(a, "_fields") else t
    if isinstance(a, list):
        return [_map(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: _map(v, fn) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map(a.start, fn), _map(a.stop, fn), _map(a.step, fn))
    return fn(a)


def _to_ref(a):
    return _Ref(a.name) if isinstance(a, fx.Node) else a


_BY_REFERENCE: dict = {}


def _by_reference(obj) -> bool:
    """Whether pickle can find obj (a class) by its module and qualified name in a spawned
    process: module-level, and not in `__main__` (a notebook's, or a script's main module)."""
    ok = _BY_REFERENCE.get(obj)
    if ok is None:
        ok = _BY_REFERENCE[obj] = _found_by_name(obj)
    return ok


def _found_by_name(obj) -> bool:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or module not in sys.modules:
        return False
    found = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


def _module_stack(stack):
    """nn_module_stack with each module class as its qualified name."""
    if not isinstance(stack, dict):
        return stack
    out = {}
    for key, entry in stack.items():
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], type):
            entry = (entry[0], f"{entry[1].__module__}.{entry[1].__qualname__}")
        out[key] = entry
    # the same dict where nothing changed: nodes copied from one another share it, and so does the pickle
    return stack if all(out[k] is v for k, v in stack.items()) else out


def _node_meta(node: fx.Node) -> dict:
    meta = {}
    for key, value in node.meta.items():
        if key.startswith("rp_"):
            meta[key] = value
        elif key in _KEPT_META:
            meta[key] = _module_stack(value) if key == "nn_module_stack" else value
    return meta


_TYPE_PICKLES: dict = {}


def _type_expr(t):
    """A node's type annotation, or None where it does not pickle."""
    if t is None:
        return None
    try:
        ok = _TYPE_PICKLES[t]
    except (KeyError, TypeError):
        try:
            pickle.dumps(t)
            ok = True
        except Exception:
            ok = False
        try:
            _TYPE_PICKLES[t] = ok
        except TypeError:
            pass
    return t if ok else None


def _base_class(gm: fx.GraphModule) -> type:
    """GraphModule, or the subclass gm was made from (fx gives every instance a class of its
    own, `GraphModuleImpl`, named after class_name)."""
    for cls in type(gm).__mro__:
        if cls.__qualname__.split(".")[-1] != "GraphModuleImpl":
            return cls
    return fx.GraphModule


def _graph_module_state(gm: fx.GraphModule) -> tuple:
    """(base class, class name, training, graph class, codegen, nodes, attributes, meta)."""
    graph = gm.graph
    nodes, attrs = [], {}
    for n in graph.nodes:
        nodes.append((n.op, n.name, n.target, _map(n.args, _to_ref), _map(n.kwargs, _to_ref),
                      _type_expr(n.type), _node_meta(n)))
        if n.op == "call_module" and n.target not in attrs:
            attrs[n.target] = gm.get_submodule(n.target)
        elif n.op == "get_attr" and n.target not in attrs:
            attrs[n.target] = _get_attr(gm, n.target)
    graph_cls = type(graph) if type(graph) is not fx.Graph and _by_reference(type(graph)) else None
    codegen = graph._codegen if type(graph._codegen) is not fx.graph.CodeGen else None
    return (_base_class(gm), type(gm).__name__, gm.training, graph_cls, codegen, nodes, attrs,
            _module_meta(gm))


def _get_attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _module_meta(gm) -> dict:
    """gm.meta: rp_* entries (they must pickle), other entries where they pickle."""
    meta = {}
    for key, value in getattr(gm, "meta", {}).items():
        if not str(key).startswith("rp_"):
            try:
                _Pickler(_Discard()).dump(value)
            except Exception:
                continue
        meta[key] = value
    return meta


def _rebuild_graph_module(base, class_name, training, graph_cls, codegen, nodes, attrs, meta):
    graph = graph_cls() if graph_cls is not None else fx.Graph()
    if codegen is not None:
        graph._codegen = codegen
    env = {}

    def node_of(a):
        return env[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs, type_expr, node_meta in nodes:
        node = graph.create_node(op, target, _map(args, node_of), _map(kwargs, node_of), name=name,
                                 type_expr=type_expr)
        if node.name != name:
            raise RuntimeError(f"rebuilding {class_name}: node {name!r} came back named {node.name!r}")
        node.meta = node_meta
        env[name] = node
    gm = base(attrs, graph, class_name)
    gm.meta = meta
    gm.training = training
    return gm


def _describe(target) -> str:
    if isinstance(target, str):
        return target
    try:
        return fx.node._get_qualified_name(target)
    except Exception:
        return repr(target)


def _check_state(gm, state) -> None:
    """Raise a PortableError naming the first node part or attribute of gm that does not pickle."""
    base, class_name, _, graph_cls, codegen, nodes, attrs, meta = state

    def check(value, where, attr=None):
        try:
            _Pickler(_Discard(), diagnose=True).dump(value)
        except PortableError as e:   # inside a child GraphModule: its message says where
            raise PortableError(f"{class_name}.{attr} -> {e}") from e
        except Exception as e:
            raise PortableError(f"{class_name}: {where} does not pickle ({type(e).__name__}: {e})") from e

    check(base, "its GraphModule class")
    check(codegen, "its graph's code generator")
    for op, name, target, args, kwargs, _, node_meta in nodes:
        what = f"node {name!r} ({op} {_describe(target)})"
        check(target, f"{what}: its target")
        check(args, f"{what}: its args")
        check(kwargs, f"{what}: its kwargs")
        for key, value in node_meta.items():
            check(value, f"{what}: meta[{key!r}]")
    for target, value in attrs.items():
        users = [name for op, name, t, *_ in nodes if op in ("get_attr", "call_module") and t == target]
        check(value, f"attribute {target!r} ({type(value).__name__}, read by node {users[0]!r})", attr=target)
    for key, value in meta.items():
        check(value, f"module meta[{key!r}]")


# --- ops by name ---------------------------------------------------------------------------
def _op_overload(namespace, name, overload):
    """torch.ops.<namespace>.<name>[.<overload>] (an OpOverload, or its packet)."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return packet if overload is None else getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise pickle.UnpicklingError(
            f"no operator torch.ops.{namespace}.{name}{'' if overload is None else '.' + overload} in this process "
            f"(import the module that registers it before loading): {e}") from e


def _higher_order_op(name):
    return getattr(torch.ops.higher_order, name)
