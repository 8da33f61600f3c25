"""What a capture's forward read besides tensors, and whether a later call's model agrees
(Note [what the forward read]); `frozen`: a key of a value by what it holds (also the loss_fn's:
Note [loss_fn in the key] in compiled.py)."""
from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import types
from typing import Optional

import torch

# Note [what the forward read]: a capture bakes in every Python value the forward read that is
# no tensor and no argument: a module's `Dropout.p`, a `scale` or a flag it branches on, a config
# field (`config.output_hidden_states`), a global of the user's module, a loss_fn object's
# `label_smoothing`, whether a module has hooks. The plan key held none of them, so a value
# changed after the first call kept the old capture, silently: Dropout.p annealed from 0.3 to 0
# still dropped (tests/test_plan_key.py: loss 0.764 against eager's 0.784, gradients off by 0.37
# of the largest), a forward hook registered after the first step never ran, output_hidden_states
# set later returned None. torch.compile captures again there because TorchDynamo guards on the
# values it read; rpcompile now keys on exactly those. Inside the capture's backend the guards
# Dynamo installed (TracingContext.guards_context.dynamo_guards, torch 2.11 and 2.13 alike) name
# each value read by its source, an expression such as L['model']._modules['drop'].p. Those rooted
# at the model, at the loss_fn or at a global of the user's own modules, whose kind compares a
# plain value, a type, an identity, a function's code or a length (a hooks dict's: _READ_KINDS),
# are kept as paths (Reads); tensor guards are not (the capture read fake copies), nor guards on
# classes, code, libraries' globals or the call's arguments (the key holds those). One generated
# function reads them all, the paths' shared prefixes once: a call whose values differ from a
# capture's is not served by it but captures anew, and says which value changed (plan_cache.py).
# A 36-layer Qwen3 reads 4,463 values (3,277 of them hooks dicts): 0.5 ms a call on a CI machine,
# 27 us for 2 layers. The values compared are those the model holds after the capture; one that
# differs from what the trace read (a flag rpcompile sets only while it traces, Note [model's own
# checkpointing]; a counter the forward increments, whose increment dynamo replays once) is left
# out: no later call could match it, and each would capture again.
# Keying on a fingerprint of every module's scalar attributes instead would also capture again at
# each change of a value the forward never reads (a step counter kept for logging: a capture every
# step). That is the fallback where Dynamo's guards cannot be read (another torch's internals, or
# none named the model): every module's and model.config's plain attributes, whose change captures
# anew with a warning that names the attribute, so such a counter can be found.
_READ_KINDS = {"CONSTANT_MATCH": "value", "EQUALS_MATCH": "value", "TYPE_MATCH": "type", "ID_MATCH": "id",
               "BUILTIN_MATCH": "id", "FUNCTION_MATCH": "id", "CLOSURE_MATCH": "code",
               "EMPTY_NN_MODULE_HOOKS_DICT": "len", "SEQUENCE_LENGTH": "len"}
_ROOT = re.compile(r"L\['(model|call)'\]|G\['(__import_\w+)'\]")
_SEGMENT = re.compile(r"\.(__closure__\[\d+\]\.cell_contents|__dict__|[A-Za-z_]\w*)|\[('(?:[^'\\]|\\.)*'|-?\d+)\]")
_TENSOR_TABLES = {"_parameters", "_buffers", "'_parameters'", "'_buffers'"}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_FROZEN_LEN = 4096      # a longer container is no key by value (frozen): each call would copy it


class Unfreezable(TypeError):
    """A value frozen() cannot make a key of: nothing equal to it can be told apart by value."""


def frozen(value, _depth=0):
    """A hashable stand-in for `value` that is equal for equal values: containers (tuples, lists,
    dicts, sets), dataclass instances, SimpleNamespaces, functools.partial objects, plain
    functions (their code, closure values and defaults) and modules with no parameters, buffers,
    submodules or hooks (their type and attributes) by what they hold; any other hashable value
    as itself; raises Unfreezable for anything else (an unhashable object with no structure to
    compare, a container of more than _FROZEN_LEN items)."""
    if _depth > 16:
        raise Unfreezable("nested too deeply")
    if isinstance(value, (tuple, list, dict, set, frozenset)) and len(value) > _FROZEN_LEN:
        raise Unfreezable(f"a {type(value).__name__} of {len(value)} items")   # (kept by identity: cheaper at each call)
    if isinstance(value, _PLAIN) or isinstance(value, type):
        return value
    d = _depth + 1
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(frozen(v, d) for v in value))
    if isinstance(value, dict):     # (in order: what the forward iterates over, it does in order)
        return (type(value), tuple((frozen(k, d), frozen(v, d)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(frozen(v, d) for v in value))
    if isinstance(value, functools.partial):
        return (functools.partial, frozen(value.func, d), frozen(value.args, d), frozen(value.keywords, d))
    if isinstance(value, types.FunctionType):
        try:
            cells = tuple(c.cell_contents for c in value.__closure__ or ())
        except ValueError:     # (an empty cell: a function not yet defined)
            return value
        return (types.FunctionType, value.__code__, frozen(cells, d), frozen(value.__defaults__, d),
                frozen(value.__kwdefaults__, d))
    if isinstance(value, torch.nn.Module):    # (one with no state but its attributes, as a loss module)
        tables = {k: v for k, v in vars(value).items() if k.startswith("_") and isinstance(v, dict)}
        if any(v is not None for t in tables.values() for v in t.values()):    # (a buffer registered as None is none)
            return value
        return (type(value), tuple((k, frozen(v, d)) for k, v in vars(value).items() if k not in tables))
    if dataclasses.is_dataclass(value):
        return (type(value), tuple((f.name, frozen(getattr(value, f.name), d)) for f in dataclasses.fields(value)))
    if isinstance(value, types.SimpleNamespace):
        return (type(value), frozen(vars(value), d))
    try:
        hash(value)
    except TypeError:
        raise Unfreezable(type(value).__name__) from None
    return value


def _freeze_or_keep(value):
    """frozen(value), or where it cannot be, the value itself compared by identity."""
    try:
        return frozen(value)
    except Unfreezable:
        return ("id", id(value))


# (torch 2.11 names an attribute of an object with its own __getattribute__, a transformers
# config's, so: the value is the attribute's)
_GETATTRIBUTE = re.compile(r"object\.__getattribute__\(([^()]*?), '([A-Za-z_]\w*)'\)")


def _parse_path(name: str, loss_root: Optional[str], modules: dict):
    """(root, segments) of a guard's source expression rooted at the model, at the loss_fn
    (loss_root: the expression of wrap's cell that holds it) or at a global of one of `modules`
    (root "G:" and dynamo's alias of the module); None for any other."""
    while "object.__getattribute__(" in name:
        plain = _GETATTRIBUTE.sub(r"\1.\2", name)
        if plain == name:
            return None
        name = plain
    if loss_root is not None and name.startswith(loss_root):
        root, rest = "loss_fn", name[len(loss_root):]
    else:
        m = _ROOT.match(name)
        if m is None or m.group(1) == "call" or (m.group(2) and m.group(2) not in modules):
            return None
        root, rest = ("model" if m.group(1) else f"G:{m.group(2)}"), name[m.end():]
    segments, pos = [], 0
    while pos < len(rest):
        m = _SEGMENT.match(rest, pos)
        if m is None:
            return None
        attr = m.group(1) or m.group(2)
        if attr in _TENSOR_TABLES or (attr.startswith("__") and not attr.startswith(("__closure__", "__dict__"))):
            return None
        segments.append(m.group(0))
        pos = m.end()
    return root, tuple(segments)


def _readable(root: str, segments, modules: dict) -> str:
    """model._modules['drop'].p -> model.drop.p"""
    text = (modules[root[2:]].__name__ if root.startswith("G:") else root) + "".join(segments)
    text = re.sub(r"(?:\._modules|\.__dict__\['_modules'\])\['([^']*)'\]", r".\1", text)
    text = re.sub(r"\.__dict__\['([^']*)'\]", r".\1", text)
    return re.sub(r"\.__closure__\[(\d+)\]\.cell_contents", r".<closure \1>", text)


def _reader(paths, kinds):
    """One function L -> tuple of the values at `paths` ((root, segments)), each as its kind
    compares it; prefixes that several paths share are read once."""
    counts: dict = {}
    for root, segs in paths:
        for i in range(1, len(segs)):
            counts[(root, segs[:i])] = counts.get((root, segs[:i]), 0) + 1
    lines, names, outs = [], {}, []
    for (root, segs), kind in zip(paths, kinds):
        expr = f"M[{root[2:]!r}]" if root.startswith("G:") else f"L[{root!r}]"
        for i in range(1, len(segs)):
            prefix = (root, segs[:i])
            if counts[prefix] < 2:
                expr += segs[i - 1]
                continue
            if prefix not in names:
                names[prefix] = f"v{len(names)}"
                lines.append(f"    {names[prefix]} = {expr}{segs[i - 1]}")
            expr = names[prefix]
        expr += segs[-1] if segs else ""
        outs.append({"value": expr, "frozen": f"F({expr})", "type": f"type({expr})", "id": f"id({expr})",
                     "code": f"id({expr}.__code__)", "len": f"len({expr})"}[kind])
    body = "\n".join(lines + [f"    return ({', '.join(outs)}{',' if outs else ''})"])
    scope = {"F": _freeze_or_keep, "type": type, "id": id, "len": len, "__builtins__": {}}
    exec(compile(f"def read(L, M):\n{body}\n", "<rpcompile reads>", "exec"), scope)
    return scope["read"]


class Reads:
    """The values a capture read (Note [what the forward read]), and whether a call's agree."""

    def __init__(self, paths, kinds, scope, source: str, modules=None):
        self.source = source                 # "dynamo guards" or "module attributes" (the fallback)
        self.modules = modules or {}         # dynamo's alias -> a module whose globals are read
        kept = []
        for path, kind in zip(paths, kinds):     # each path alone: one that fails is left out
            v = _value_at(scope, path, kind, self.modules)
            if v is _MISSING:       # (an expression this reader cannot follow)
                continue
            if isinstance(v, torch.Tensor) or (kind in ("id", "code") and not path[1]):
                continue    # (the model and the loss_fn themselves: the plan key says which they are)
            if kind == "value" and not isinstance(v, _PLAIN + (type,)):
                kind = "frozen"     # (a tuple, a list, a dict, an object: compared by what it holds, at the time)
            kept.append((path, kind, v))
        self.paths = [p for p, _, _ in kept]
        self.kinds = [k for _, k, _ in kept]
        self.names = [_readable(*p, self.modules) for p in self.paths]
        self._read = _reader(self.paths, self.kinds)
        # (an object matched by identity stays alive, so that its id is no other object's)
        self._alive = [_value_at(scope, p, "value", self.modules) for p, k, _ in kept if k in ("id", "code", "frozen")]
        self.values = self._read(scope, self.modules) if kept else ()
        self.types = tuple(map(type, self.values))

    def __len__(self):
        return len(self.paths)

    def drop_changed(self, scope) -> "Reads":
        """Leave out the values that `scope` reads otherwise than the trace did (see the Note)."""
        now = self._values_each(scope)
        keep = [i for i, v in enumerate(now) if v is not _MISSING and _same(v, self.values[i])]
        if len(keep) < len(self.paths):
            self.paths = [self.paths[i] for i in keep]
            self.kinds = [self.kinds[i] for i in keep]
            self.names = [self.names[i] for i in keep]
            self._read = _reader(self.paths, self.kinds)
            self.values = tuple(self.values[i] for i in keep)
            self.types = tuple(map(type, self.values))
        return self

    def holds(self, scope) -> bool:
        """Whether the call's values are the capture's (scope: {"model": ..., "loss_fn": ...})."""
        try:
            now = self._read(scope, self.modules)
        except Exception:   # noqa: BLE001 - an attribute gone: not the model this capture read
            return False
        return now == self.values and tuple(map(type, now)) == self.types

    def changes(self, scope) -> list:
        """What differs from the capture's values, a phrase each ("model.drop.p is 0.0 where the
        model was captured with 0.3")."""
        out = []
        for name, kind, was, v in zip(self.names, self.kinds, self.values, self._values_each(scope)):
            if v is _MISSING:
                out.append(f"{name} is gone, which the model was captured with")
            elif not _same(v, was):
                if kind in ("id", "code"):
                    out.append(f"{name} is another object than the model was captured with")
                elif kind == "type":
                    out.append(f"{name} is a {v.__name__} where the model was captured with a {was.__name__}")
                else:
                    out.append(f"{f'len({name})' if kind == 'len' else name} is {v!r} where the model was captured "
                               f"with {was!r}")
        return out

    def _values_each(self, scope) -> list:
        return [_value_at(scope, path, kind, self.modules) for path, kind in zip(self.paths, self.kinds)]


_MISSING = object()
_CELL = re.compile(r"\.__closure__\[(\d+)\]\.cell_contents")


def _value_at(scope, path, kind, modules):
    """The value at one path as its kind compares it (what _reader reads, one path at a time);
    _MISSING where it cannot be read."""
    root, segments = path
    try:
        obj = modules[root[2:]] if root.startswith("G:") else scope[root]
        for seg in segments:
            cell = _CELL.fullmatch(seg)
            if cell:
                obj = obj.__closure__[int(cell.group(1))].cell_contents
            elif seg.startswith("."):
                obj = getattr(obj, seg[1:])
            else:
                obj = obj[_subscript(seg)]
        if kind == "code":
            return id(obj.__code__)
        return {"value": obj, "type": type(obj), "id": id(obj), "len": len(obj) if kind == "len" else None,
                "frozen": _freeze_or_keep(obj) if kind == "frozen" else None}[kind]
    except Exception:   # noqa: BLE001 - an attribute gone, or an expression this reader cannot follow
        return _MISSING


@functools.lru_cache(maxsize=4096)
def _subscript(seg: str):
    """The key of a path's `[...]` segment (the paths of a model's reads repeat the same few:
    parsing each again: 19 of the 850 seconds py-spy sampled in the suite's captures)."""
    return ast.literal_eval(seg[1:-1])


def _same(a, b) -> bool:
    return type(a) is type(b) and (a is b or a == b)


def guard_reads(tracing, scope, loss_root: Optional[str], namespace: dict) -> Optional[Reads]:
    """Reads of the Dynamo guards on the model's and the loss_fn's values; None where they cannot
    be read (Note [what the forward read]). namespace: the globals of the function traced."""
    guards = tracing.guards_context.dynamo_guards
    # (dynamo names a module whose globals an inlined function reads by an alias it adds to the
    # traced function's globals, ours: the user's own modules are kept, not libraries' or ours)
    modules = {alias: mod for alias, mod in list(namespace.items())
               if alias.startswith("__import_") and isinstance(mod, types.ModuleType) and _users_module(mod)}
    paths, kinds, seen = [], [], set()
    for g in guards:
        kind = _READ_KINDS.get(g.inner_create_fn().__name__)
        name = g.name
        if kind is None or not isinstance(name, str):
            continue
        path = _parse_path(name, loss_root, modules)
        if path is None or (path, kind) in seen:
            continue
        seen.add((path, kind))
        paths.append(path)
        kinds.append(kind)
    if not any(root == "model" for root, _ in paths):     # (no guard named the model: not read as expected)
        return None
    return Reads(paths, kinds, scope, "dynamo guards", modules)


def _users_module(mod) -> bool:
    """A module of the user's own code (a script, its modules), not a library's nor rpcompile's."""
    path = getattr(mod, "__file__", None)
    if not path:
        return mod.__name__ == "__main__"
    from .capture import OWN_DIR, library_of
    return library_of(path) is None and not os.path.realpath(path).startswith(OWN_DIR + os.sep)


def reads_after(reads: Optional[Reads], model, scope) -> Optional[Reads]:
    """The capture's Reads, from the model as the capture left it: Dynamo's less what changed
    since the trace read it, else the fallback; None where neither can be made (no check, as
    before the Note)."""
    try:
        return reads.drop_changed(scope) if reads is not None else _attribute_reads(model, scope)
    except Exception:   # noqa: BLE001
        return None


def _attribute_reads(model, scope) -> Reads:
    """The fallback: every module's plain attributes, and the model config's."""
    paths = []
    for name, mod in model.named_modules():
        segs = tuple(f"._modules[{part!r}]" for part in name.split(".")) if name else ()
        paths += [("model", segs + (f".{k}",)) for k, v in vars(mod).items()
                  if isinstance(v, _PLAIN) and k.isidentifier()]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        paths += [("model", (".config", f".{k}")) for k, v in vars(config).items()
                  if isinstance(v, _PLAIN) and k.isidentifier()]
    return Reads(paths, ["value"] * len(paths), scope, "module attributes")
