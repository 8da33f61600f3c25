"""Capture: TorchDynamo (fullgraph=True) turns a model call into one torch-IR GraphModule.

Two ways in share this file:
- `capture_call(model, args, kwargs, ...)` for `rpcompile.compile`: the model is traced on
  *fake* copies of its parameters, buffers and inputs in the compute dtype, so capturing a
  32B model costs no memory and no compute, and dtype casts in the model code (RMSNorm's
  upcast and cast back) are traced in the dtype that really runs. The copies report the
  device the stages run on (Note [capture device]).
- `from_dynamo(gm, example_inputs)` for `torch.compile(model, backend="rpcompile")`: dynamo
  hands us the graph and the real inputs.

Either way every placeholder gets `meta["rp_kind"]` in {"param", "buffer", "input", "sym"}
and `meta["rp_index"]` (its index among the captured params, buffers or call leaves).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import sysconfig
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .errors import CaptureError, InputError, RPCompileError
from .lora_params import traceable_lora_params
from .passes.graph_utils import call_leaf_name, is_impure, output_values, size_hint
from .reads import guard_reads, reads_after

_capture_ids = itertools.count()


@dataclass
class Captured:
    """A captured graph and how its placeholders and outputs map to the user's objects."""

    gm: fx.GraphModule
    params: list            # host parameters (the user's nn.Parameter objects), deduplicated
    param_names: list
    buffers: list           # host buffers (module attributes)
    buffer_names: list
    capture_device: torch.device                       # the device type the graph's constants name
    in_spec: Any = None     # pytree spec of (args, kwargs) for rpcompile.compile calls
    out_spec: Any = None    # pytree spec of the model output; None: flat graph outputs
    out_leaves: list = field(default_factory=list)     # ("out", i) or ("const", value)
    batch_size: Optional[int] = None                   # batch size at capture (None: the dynamo backend's)
    on_copies: bool = False  # traced on copies in the compute dtype (capture_call), not on real inputs
    shape_env: Any = None    # dynamo's ShapeEnv: the size symbols' ranges and guards (shapes.py)
    costs: dict = field(default_factory=dict)   # the cost pass's results by graph (Note [costs per capture] in passes/cost.py)
    node_costs: dict = field(default_factory=dict)   # its measurements by node signature (the same Note)
    pass_texts: dict = field(default_factory=dict)   # graph texts of the rewriting passes, for re-plans (passes/__init__.py)
    reads: Any = None        # the values the forward read, which a call must agree with (Note [what the forward read])

    def placeholders(self):
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


# Note [capture device]: the copies the model is traced on are fake tensors (no storage) that
# report the device the stage jobs run on, not "meta". Model code branches on the device:
# transformers' MoE layers count tokens per expert with torch.histc on floats on CPU and on
# ints elsewhere (histc has no CPU kernel for ints), and list indexing such as x[..., [-2], :]
# builds its index tensor on the indexed tensor's device, which fake tensor propagation accepts
# for a CPU or CUDA tensor but not for a meta one. Traced on the real device type, the graph
# takes the branches that run.
class _FakeCopies:
    """Makes storage-less copies of tensors, on `device`, floating ones in `dtype`."""

    def __init__(self, device, dtype):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.mode = FakeTensorMode()
        self.device, self.dtype = torch.device(device), dtype

    def __call__(self, t: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
        dt = self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype
        with self.mode:
            if contiguous:   # call inputs: the runner hands every microbatch over contiguous
                return torch.empty(t.shape, dtype=dt, device=self.device)
            return torch.empty_strided(t.shape, t.stride(), dtype=dt, device=self.device)


class _SwapToCopies:
    """Temporarily replace every parameter and buffer of a module tree by a fake copy.

    Note [plain tensor attributes kept]: a forward may cache a tensor in a plain attribute
    (transformers' longrope RoPE, Phi-3.5's, sets `self.long_inv_freq` at its first call).
    Traced, dynamo replays that assignment with the capture's meta tensor: the model's next eager
    call failed ("Cannot copy out of meta tensor"), and so did rpcompile's next capture, which
    read it as a constant. The plain tensor attributes are put back as they were (one made while
    tracing is removed): the graph computes what forward caches, at every call."""

    def __init__(self, model: torch.nn.Module, copy: _FakeCopies):
        self.model, self.copy = model, copy
        self.copy_of: dict[int, torch.Tensor] = {}   # id(host tensor) -> its copy
        self.host_of: dict[int, tuple] = {}          # id(copy) -> (kind, host tensor, name)
        self._undo = []

    def __enter__(self):
        # the plain tensor attributes (Note [plain tensor attributes kept])
        self._plain = [(mod, {k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)})
                       for mod in self.model.modules()]
        for mod_name, mod in self.model.named_modules(remove_duplicate=False):
            for kind, table in (("param", mod._parameters), ("buffer", mod._buffers)):
                for name, t in list(table.items()):
                    # (a copy already: a module, or its table of parameters, registered under two
                    # names is met twice; copying the copy made the capture read fake tensors)
                    if t is None or id(t) in self.host_of:
                        continue
                    fqn = f"{mod_name}.{name}" if mod_name else name
                    if id(t) not in self.copy_of:
                        m = self.copy(t)
                        if kind == "param":
                            m = torch.nn.Parameter(m, requires_grad=t.requires_grad)
                        self.copy_of[id(t)] = m
                        self.host_of[id(m)] = (kind, t, fqn)
                    self._undo.append((table, name, t))
                    table[name] = self.copy_of[id(t)]
        return self

    def __exit__(self, *exc):
        # what forward assigned anew while tracing (`_refuse_reassigned`)
        self.reassigned = [(self.host_of[id(self.copy_of[id(t)])][2], table.get(name)) for table, name, t in self._undo
                           if table.get(name) is not self.copy_of[id(t)]]
        for table, name, t in reversed(self._undo):
            table[name] = t
        self._undo.clear()
        for mod, before in self._plain:
            for k, v in list(vars(mod).items()):
                if isinstance(v, torch.Tensor) and before.get(k) is not v:
                    if k in before:
                        setattr(mod, k, before[k])
                    else:
                        delattr(mod, k)
        self._plain = []


def _refuse_reassigned(cap: "Captured", reassigned: list, dummies) -> None:
    """A parameter or buffer that forward assigns a new tensor (`self.b = self.b + 1`): putting the
    host tensor back after tracing lost the assignment, which every call makes: the buffer never
    changed, silently. (`self.b += 1` is assigned too, dynamo's result of an in-place operator,
    which the graph makes on the buffer itself: that one is updated.) An assignment of the tensor
    itself (CTRL's `self.pos_encoding = self.pos_encoding.to(device, dtype)` at the dtype and
    device it has) changes nothing and is let be (Note [no-op reassignments])."""
    position = {id(d): i for i, d in enumerate(dummies) if isinstance(d, torch.Tensor)}
    out_nodes = output_values(cap.gm.graph)
    for fqn, value in reassigned:
        nodes = [n for n in cap.placeholders() if n.meta.get("rp_name") == fqn]
        if any(is_impure(u) for n in nodes for u in n.users):
            continue
        at = position.get(id(value))
        if at is not None and _same_tensor_of(out_nodes[at], nodes):
            continue
        raise CaptureError(f"the model assigns a new tensor to {fqn} in its forward (as `self.x = self.x + 1`); "
                           f"rpcompile keeps parameters and buffers as the objects they are, so update it in "
                           f"place instead (`self.x.add_(1)`, `self.x.copy_(new)`)")


# Note [no-op reassignments]: dynamo replays a forward's `self.b = <tensor>` after tracing with the
# graph output it made for the value, a new (fake) tensor even where eager's `.to` returned the
# buffer itself. A value that is the placeholder reached through ops that return their input
# unchanged at its dtype, device, shape and strides (`to`, `contiguous`, `detach`) is that case.
_RETURNS_SELF = {"to", "contiguous", "detach", torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.detach}


def _same_tensor_of(node, placeholders) -> bool:
    def like(a, b):
        a, b = a.meta.get("example_value"), b.meta.get("example_value")
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and a.shape == b.shape and a.stride() == b.stride())
    while isinstance(node, fx.Node) and node not in placeholders:
        if node.op not in ("call_method", "call_function") or node.target not in _RETURNS_SELF or not (
                node.args and isinstance(node.args[0], fx.Node) and like(node, node.args[0])):
            return False
        node = node.args[0]
    return isinstance(node, fx.Node)


# Note [recorded outputs]: transformers (5.x) records hidden states, attentions and MoE router
# logits (output_router_logits, which an MoE's load-balancing loss reads) with forward hooks that
# a model's first call asking for them installs, under a threading.Lock that TorchDynamo cannot
# trace: torch.compile(model, fullgraph=True) of a fresh model fails there, and works once the
# model has run eagerly. rpcompile never runs the model eagerly (it may not fit), so before a
# capture it installs those hooks on every transformers model of the tree, as that first call
# would; they do nothing unless a call records. Not only where the call or a config asks
# (an output_* argument): a vision-language model asks its vision tower for the hidden states of
# its vision_feature_layer inside its own forward (LLaVA, Mistral 3: transformers'
# select_hidden_states), which nothing in the call or the configs shows (a CaptureError at the
# lock, "not in your code").
OUTPUT_RECORDERS = "transformers.utils.output_capturing"     # the module of those hooks


def _install_output_recorders(model: torch.nn.Module) -> None:
    import sys
    recorders = sys.modules.get(OUTPUT_RECORDERS)
    install = getattr(recorders, "maybe_install_capturing_hooks", None)
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if install is None or pretrained is None:
        return
    for m in model.modules():
        if isinstance(m, pretrained):
            install(m)


def _sym_expr(x) -> Optional[sympy.Expr]:
    return x.node.expr if isinstance(x, torch.SymInt) else None


def _mark_sym(node: fx.Node, ex) -> None:
    """A size placeholder: rp_kind "sym" and its sympy expression."""
    node.meta["rp_kind"] = "sym"
    node.meta["rp_expr"] = _sym_expr(ex) if isinstance(ex, torch.SymInt) else sympy.Integer(ex)


def _dummy_outputs(gm: fx.GraphModule):
    """Meta tensors shaped like the graph outputs: what the capture call returns, computing nothing."""
    vals = []
    for a in output_values(gm.graph):
        ev = a.meta.get("example_value") if isinstance(a, fx.Node) else a
        if isinstance(ev, torch.Tensor):
            vals.append(torch.empty([size_hint(s) for s in ev.shape], dtype=ev.dtype, device="meta"))
        elif isinstance(ev, torch.SymInt):
            vals.append(size_hint(ev))
        else:
            vals.append(ev)
    return vals


_LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def _log_calls() -> set:
    """Logging, warning and print functions: no-ops while capturing (Note [log calls])."""
    fns = {print, warnings.warn, warnings.warn_explicit}
    fns.update(getattr(logging, name) for name in _LOG_LEVELS)
    # Logger methods, with those libraries add to the class (transformers' warning_once,
    # info_once, warning_advice).
    for name, fn in vars(logging.Logger).items():
        if callable(fn) and (name in _LOG_LEVELS or name.split("_")[0] in _LOG_LEVELS):
            fns.add(fn)
    return fns


# Note [model's own checkpointing]: `model.gradient_checkpointing_enable()`, common in
# fine-tuning scripts, makes a transformers layer run under torch.utils.checkpoint, which dynamo
# traces as a higher-order op that refuses the layer's side effects ("HOP: Unsafe side effect"):
# a CaptureError that never named the checkpointing. rpcompile plans its own recompute, so the
# capture traces the layers as they run without it (each module's `gradient_checkpointing` flag,
# transformers 4 and 5, off while tracing and set back after); the values are the same.
# Its companion `enable_input_require_grads()` (which peft calls with gradient checkpointing on,
# and in prepare_model_for_kbit_training) hooks the input embeddings with
# `output.requires_grad_(True)`, so checkpointed layers over frozen embeddings get a gradient:
# dynamo refuses that ("returning intermediate with requires_grad_()"), a CaptureError that named
# neither. The hook changes no value and rpcompile's gradients need it not: it is off too.
_INPUT_GRAD_HOOKS = ("make_inputs_require_grads",)


@contextlib.contextmanager
def _checkpointing_off(model):
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    hooked = [(m, dict(m._forward_hooks)) for m in model.modules()
              if any(getattr(h, "__name__", None) in _INPUT_GRAD_HOOKS for h in m._forward_hooks.values())]
    for m in on:
        m.gradient_checkpointing = False
    for m, hooks in hooked:
        for k, h in hooks.items():
            if getattr(h, "__name__", None) in _INPUT_GRAD_HOOKS:
                del m._forward_hooks[k]
    try:
        yield
    finally:
        for m in on:
            m.gradient_checkpointing = True
        for m, hooks in hooked:
            m._forward_hooks.clear()
            m._forward_hooks.update(hooks)


# Note [sizes in messages]: dynamo formats a size in a string (an f-string, str.format) by
# evaluating it, which guards the size to its value at capture: transformers' vision-language
# models build the message of their feature-count check eagerly, f"... features: {n}" with n the
# image features' rows (pixel_values' dim 0 times the tokens per image), and the check itself
# discards the message while tracing. The batch of pixel_values was fixed at capture (an
# InputError: "the captured graph fixed that size") where eager and every microbatch's rows
# agree. Dynamo already keeps a string of a size it cannot evaluate (an unbacked one) as a
# deferred format; while capturing, a symbolic size is formatted that way too, so a message
# costs no guard. Dynamo does not read a deferred string's value: a model that uses it (a dict
# key, a branch) should stop the capture (a CaptureError) rather than fix the size silently.
@contextlib.contextmanager
def _sizes_formatted_lazily():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    lazy = getattr(torch._dynamo.variables.lazy, "LazySymNodeFormatString", None)
    if lazy is None:        # (another torch: sizes are formatted as it does)
        yield
        return
    real = lazy.__repr__

    def deferred(self):
        size = getattr(self.sym_node_var, "sym_num", None)
        expr = getattr(getattr(size, "node", None), "expr", None)
        if isinstance(expr, sympy.Expr) and expr.free_symbols:
            raise GuardOnDataDependentSymNode(expr, "rpcompile: a size formatted while capturing")
        return real(self)

    lazy.__repr__ = deferred
    try:
        if not _formats_deferred():     # (torch 2.11: the error leaves the trace; sizes are formatted as it does)
            lazy.__repr__ = real
        yield
    finally:
        lazy.__repr__ = real


def _discard(message) -> None:
    pass


@functools.cache
def _formats_deferred() -> bool:
    """Whether this torch keeps a string of a size it cannot evaluate as a deferred format (2.13
    does; 2.11 lets the error out of the trace), tried once on a probe while `deferred` is in
    place (Note [sizes in messages])."""
    def probe(x):
        _discard(f"rows {x.shape[0]}")     # (a message built and never read, as the models' checks do)
        return x + 1
    try:
        fn = types.FunctionType(probe.__code__.replace(co_name="rp_format_probe"), probe.__globals__)
        torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)(torch.ones(3))
        return True
    except Exception:   # noqa: BLE001 - any failure: format as this torch does
        return False


# Note [log calls]: dynamo stops at a call of logging.Logger methods, logging.warning,
# warnings.warn or print (a graph break), and model code is full of them, often in a library
# (transformers' loss_function logs with logger.warning_once). The capture traces the model on
# fake copies only to get its graph, so such a call has nothing to say: dynamo's
# ignore_logging_functions makes each a no-op while tracing, and the run never makes it.
# Note [side effects unlogged]: dynamo's default side_effect_replay_policy ("info") keeps the user
# stack of every attribute a forward writes (transformers' output recorders, caches, counters) and
# formats each into a log message, read only under TORCH_LOGS="side_effects"; it was a tenth of a
# two-layer Qwen3's capture (1.22 s against 1.09 s, median of ten on CPU). "silent" replays the same
# side effects without the messages. A policy the user set, or that log turned on, is kept.
@contextlib.contextmanager
def _capture_config():
    ignored = set(torch._dynamo.config.ignore_logging_functions) | _log_calls()
    patch = {"ignore_logging_functions": ignored}
    if getattr(torch._dynamo.config, "side_effect_replay_policy", None) == "info" and not _side_effects_logged():
        patch["side_effect_replay_policy"] = "silent"
    # torch 2.11 logs its config with compile metrics and cannot sort a set of functions: every
    # capture printed "Unexpected exception logging compilation metrics" (2.13 leaves the set out).
    metrics_log = logging.getLogger("torch._dynamo.metrics_context")
    was = metrics_log.disabled
    metrics_log.disabled = True
    try:
        with torch._dynamo.config.patch(**patch):
            yield
    finally:
        metrics_log.disabled = was


def _side_effects_logged() -> bool:
    log = getattr(getattr(torch._dynamo, "side_effects", None), "side_effects_log", None)
    return log is None or log.isEnabledFor(logging.DEBUG)


_LIBRARY_DIRS = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                      sysconfig.get_paths()["stdlib"]})
OWN_DIR = os.path.dirname(os.path.realpath(__file__))


def library_of(filename: str) -> Optional[str]:
    """The installed package (or "the Python standard library") a source file belongs to, None
    for the user's own code."""
    path = os.path.realpath(filename)
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1:]
            return rest[0].removesuffix(".py") if rest else marker
    if any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS):
        return "the Python standard library"
    if path.startswith(os.path.dirname(torch.__file__) + os.sep):
        return "torch"
    return None


def _model_frames(err: Exception) -> list:
    """The model's frames (outermost first) where capture stopped: dynamo's user stack, else the
    traceback of an error raised while tracing; rpcompile's own frames left out."""
    stack = getattr(err, "real_stack", None)
    if not stack:
        stack = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
        stack = [f for f in stack if library_of(f.filename) != "torch"]
    return [f for f in stack if not os.path.realpath(f.filename).startswith(OWN_DIR + os.sep)]


def _where(frame) -> str:
    line = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}(){line}"


def _raised_by_model(err: Exception) -> Optional[str]:
    """What the model's own code raised while dynamo traced it ("ValueError('...')"), or None.

    Note [the model's own exceptions]: a model that raises on its arguments (transformers'
    "You must specify exactly one of input_ids or inputs_embeds" for a misspelt `input_id=`) made
    dynamo stop with "Observed exception", which the capture explained as a graph break in a
    library to report there. Dynamo keeps the raised exception, as text, in the context of its
    error: the capture says that the model raised it and where, and that the call's arguments
    are what to check (an InputError)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, torch._dynamo.exc.ObservedException):
            text = str(err).strip()
            text = text[len("raised exception "):] if text.startswith("raised exception ") else text
            # torch 2.11 keeps the class alone: "ExceptionVariable(<class 'ValueError'>)"
            return re.sub(r"^ExceptionVariable\(<class '(?:[\w.]*\.)?(\w+)'>\)$", r"\1", text) or None
        err = err.__cause__ or err.__context__
    return None


def _explain_dynamo_error(err: Exception, names=()) -> RPCompileError:
    """A CaptureError that says where the capture stopped, whether that is the user's code or a
    library's, and what rpcompile needs there; an InputError where the model itself raised
    (Note [the model's own exceptions]). `names`: the call's keyword arguments."""
    msg = str(err).strip()
    kind = type(err).__name__
    gb_type = getattr(err, "gb_type", None)
    frames = _model_frames(err)
    raised = _raised_by_model(err) if gb_type == "Observed exception" else None
    failed = _fake_call_failure(err, msg, raised)
    if raised and not failed:
        where = f" at {_where(frames[-1])}" if frames else ""
        called = f" (called with {', '.join(f'{n}=' for n in names)})" if names else ""
        return InputError(f"the model raised {raised}{where} while rpcompile traced this call{called}. The model's "
                          "own code raised it, as it would when called eagerly with these arguments: check them "
                          "(their names, shapes and dtypes). If the same call runs eagerly, please report it to "
                          "rpcompile.")
    if failed:
        where = f" at {_where(frames[-1])}" if frames else ""
        called = f" (called with {', '.join(f'{n}=' for n in names)})" if names else ""
        return InputError(f"an operation of the model failed on this call's arguments{where}: {failed} (while "
                          f"rpcompile traced the call{called}). Called eagerly with these arguments the model fails "
                          "the same way: check them (their names, shapes and dtypes). If the same call runs eagerly, "
                          "please report it to rpcompile.")
    built = _module_built_in_forward(err, frames)
    if built:
        return built
    mine = [f for f in frames if library_of(f.filename) is None]
    need = ("rpcompile captures the forward (and the loss) as one graph, as torch.compile(model, "
            "fullgraph=True) does, so every line it runs must be traceable: no .item() or Python branch on "
            "a tensor's values, no call dynamo cannot trace.")
    if not frames:
        hint = f"{need} Find the call named above, in forward() or the loss."
    elif library_of(frames[-1].filename) is None:
        hint = (f"It stopped in your code, at {_where(frames[-1])}. {need} Change that line: compute the "
                "value with tensor ops (torch.where instead of an if on a tensor), or move the call out of forward().")
    else:
        lib = library_of(frames[-1].filename)
        hint = (f"It stopped inside {lib}, not in your code, at {_where(frames[-1])}")
        hint += (f", reached from your code at {_where(mine[-1])}." if mine else ".")
        hint += (f" {need} The call is in the code of {lib}, so what can change is how the model is built or "
                 f"called. If torch.compile(model, fullgraph=True) captures the model, rpcompile should too: "
                 f"please report it to rpcompile. If not, another option of {lib} (another attention or experts "
                 f"implementation in the model's config, say) or another version of it may avoid the call; the "
                 f"break is a bug to report to {lib}.")
    head = f"{kind}: {gb_type}" if gb_type else kind
    return CaptureError(f"could not capture the model as one graph ({head}): {msg}\n{hint}")


def _module_built_in_forward(err, frames) -> Optional[CaptureError]:
    """Note [modules built in forward]: a forward that builds a module (BigBird's, which swaps in
    new full-attention modules on rows too short for its block-sparse attention) stops dynamo at
    the nn.Parameter that the module's __init__ makes, inside torch: the capture named torch's
    linear.py as the place and the break as torch's bug. The place is the model's line that
    builds the module; what to change is where the model builds it."""
    if "torch.nn.Parameter()" not in str(getattr(err, "gb_type", "") or ""):
        return None
    at = next((i for i, f in enumerate(frames) if f.name == "__init__"), None)
    builder = next((f for f in reversed(frames[:at]) if library_of(f.filename) != "torch"), None) if at else None
    if builder is None:
        return None
    called = next((f for f in reversed(frames[:at]) if f.name == "forward"), None)
    via = f" (reached from {_where(called)})" if called is not None and called is not builder else ""
    lib = library_of(builder.filename)
    whose = "your code" if lib is None else f"the code of {lib}"
    return CaptureError(
        f"the model builds a module in its forward, at {_where(builder)}{via}, in {whose}. rpcompile captures the "
        "forward as one graph, as torch.compile(model, fullgraph=True) does, and the parameters it trains must "
        "exist before: a module made while tracing has none of its own. Build modules in __init__. A library's "
        "model that builds one on a call it cannot serve as configured (BigBird's block-sparse attention on "
        "rows too short for it switches to full attention) trains once configured not to need the switch (a "
        "config option, BigBird's attention_type='original_full'), or after one eager call on a small batch "
        "before rpcompile.compile has made it.")


def _fake_call_failure(err, msg: str, raised: Optional[str] = None) -> Optional[str]:
    """The error an operation raised on the traced call's fake values (dynamo's TorchRuntimeError
    "RuntimeError when making fake tensor call": a shape or dtype the arguments got wrong, as
    labels of fewer columns than the ids, float ids), as "RuntimeError: ..."; None for another
    failure. It was a graph break to report, its message in the middle of 3 KB. torch 2.14 raises
    some of these (float ids in an embedding) in the model's frame instead, an observed exception
    whose text (`raised`, from _raised_by_model) wraps the operation's error in the repr of a
    RuntimeError("Dynamo failed to run FX node with fake tensors: ... got RuntimeError(...)")."""
    if raised and "Dynamo failed to run FX node with fake tensors" in raised:
        found = re.search(r"got (\w+)\((['\"])(.*)\2\)", raised, re.S)
        return f"{found.group(1)}: {found.group(3)}".replace("\\'", "'") if found else None
    if not isinstance(err, torch._dynamo.exc.TorchRuntimeError):
        return None
    found = re.search(r"got (\w+)\((['\"])(.*?)\2\)\n", msg, re.S)
    return f"{found.group(1)}: {found.group(3)}" if found else None


def flatten_call(args, kwargs):
    """Leaves and spec of a call; checks every leaf is a tensor or a plain constant."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    for i, leaf in enumerate(leaves):
        if not (isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device))):
            raise InputError(
                f"argument leaf {i} has type {type(leaf).__name__}: rpcompile takes tensors, numbers, "
                f"strings, None and nested tuples/lists/dicts of them. Convert it to a torch.Tensor.")
    return leaves, spec


EMPTY_BATCH = "the batch has no rows (dim 0 of the batched arguments is 0): call with at least one row"


def batch_size_of(leaves) -> Optional[int]:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return leaf.shape[0]
    return None


def _refuse_short_rows(leaves, labels, batch, batched, unbatched) -> None:
    """Note [batched inputs] (passes/batch.py): a tensor argument whose other sizes are a batched
    one's but whose dim 0 is neither the batch size nor 1 (an attention mask of 3 rows beside 4
    rows of ids) was taken as unbatched and every microbatch read its first rows, silently
    (eager fails on it)."""
    from .passes.batch import is_unbatched
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    rows: dict = {}
    for i in tensors:
        if batched(i):
            rows.setdefault(tuple(leaves[i].shape[1:]), i)
    for i in tensors:
        leaf = leaves[i]
        if (leaf.dim() >= 2 and leaf.shape[0] not in (1, batch) and tuple(leaf.shape[1:]) in rows
                and not is_unbatched(labels[i], unbatched)):
            other = rows[tuple(leaf.shape[1:])]
            raise InputError(f"{labels[i]} has {leaf.shape[0]} rows ({tuple(leaf.shape)}) where {labels[other]} has "
                             f"{batch} ({tuple(leaves[other].shape)}): give every batched argument the batch's rows, "
                             f"or name {labels[i]!r} in Config(unbatched_inputs=[...]) if it is not batched")


def capture_call(model: torch.nn.Module, args, kwargs, *, dtype, device="cpu",
                 wrap=None, dynamic_batch: bool = True, unbatched=(), dynamic_lengths: bool = False,
                 loss_fn=None) -> Captured:
    """Capture `wrap(model, *args, **kwargs)` (default: model(*args, **kwargs)) on fake copies
    on `device` (the device the stages run on: Note [capture device]). `loss_fn`: the loss
    function `wrap` calls, whose values read are kept beside the model's (Note [what the forward
    read]).

    Dim 0 of every tensor argument whose dim 0 is the batch size is dynamic (Note [batched
    inputs] in passes/batch.py), except those `unbatched` names (Config.unbatched_inputs); with
    dynamic_lengths, so is every dim of the sequence length's size (Note [dynamic lengths] in
    lengths.py)."""
    from .lengths import length_dims
    from .passes.batch import LOSS_TARGET, is_unbatched, leaf_names
    leaves, in_spec = flatten_call(args, kwargs)
    labels = leaf_names(args, kwargs)
    batch = batch_size_of(leaves)
    if batch == 0:      # (a reshape deep in the model failed on it)
        raise InputError(EMPTY_BATCH)

    def batched(i):
        leaf = leaves[i]
        return (dynamic_batch and batch is not None and batch > 1 and leaf.dim() >= 1 and leaf.shape[0] == batch
                and not is_unbatched(labels[i], unbatched))
    _refuse_short_rows(leaves, labels, batch, batched, unbatched)

    lengths = length_dims(leaves, batch, batched) if dynamic_lengths else {}
    copies = _FakeCopies(device, dtype)
    meta_leaves = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            m = copies(leaf, contiguous=True)
            if leaf.requires_grad and m.is_floating_point():
                m.requires_grad_(True)
            for d in ([0] if batched(i) else []) + lengths.get(i, []):
                torch._dynamo.maybe_mark_dynamic(m, d)
            meta_leaves.append(m)
        else:
            meta_leaves.append(leaf)
    meta_args, meta_kwargs = pytree.tree_unflatten(meta_leaves, in_spec)
    call = wrap or (lambda mod, *a, **k: mod(*a, **k))

    # (Reads are read from the scope, which got lets go after the capture: dynamo's cache keeps the
    # backend, and the scope would keep the loss_fn's closure values alive)
    scope = {"model": model, "loss_fn": loss_fn}
    got = {"scope": scope}
    cells = [c.cell_contents for c in (getattr(wrap, "__closure__", None) or ())]
    at = next((i for i, c in enumerate(cells) if loss_fn is not None and c is loss_fn), None)
    loss_root = None if at is None else f"L['call'].__closure__[{at}].cell_contents"

    # Note [a backend that lets the model go]: dynamo keeps every backend it was given, for good
    # (torch._dynamo.eval_frame.cached_backends, emptied by torch._dynamo.reset() alone), so the
    # backend holds nothing of the capture once it is done: not the traced function (whose
    # closure holds the model: a compiled model dropped kept its model, and its parameters, for the
    # life of the process), and `got` is emptied after the capture.
    namespace = globals()     # (the traced function's, where dynamo adds the aliases it reads by)

    def backend(gm, example_inputs):
        got["gm"], got["inputs"] = gm, list(example_inputs)
        tracing = torch._guards.TracingContext.try_get()
        got["shape_env"] = tracing.fake_mode.shape_env if tracing is not None and tracing.fake_mode else None
        try:        # (read here, before dynamo replays the forward's side effects on the model)
            got["reads"] = guard_reads(tracing, got["scope"], loss_root, namespace) if tracing is not None else None
        except Exception:   # noqa: BLE001 - another torch's guards: the fallback
            got["reads"] = None
        got["dummies"] = dummies = _dummy_outputs(gm)
        return lambda *a: dummies

    def traced(*a, **k):
        return call(model, *a, **k)

    # A fresh code object per capture: dynamo caches compiled frames per code object, and a
    # hit would skip our backend.
    n = next(_capture_ids)
    fn = types.FunctionType(traced.__code__.replace(co_name=f"rp_capture_{n}"), traced.__globals__,
                            f"rp_capture_{n}", traced.__defaults__, traced.__closure__)
    named = kwargs if isinstance(kwargs, dict) else {}
    _install_output_recorders(model)
    names = [k for k in named if k != LOSS_TARGET]
    with _SwapToCopies(model, copies) as swap, _capture_config(), _sizes_formatted_lazily(), \
            traceable_lora_params(model), _checkpointing_off(model):
        try:
            out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*meta_args, **meta_kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            got.clear()
            raise _explain_dynamo_error(e, names) from None
        except Exception as e:  # errors raised by model code while tracing
            got.clear()
            raise _explain_dynamo_error(e, names) from e
        finally:
            got.pop("scope", None)
    if "gm" not in got:
        raise CaptureError("dynamo returned without calling the rpcompile backend (the model produced no graph)")
    gm, example_inputs, shape_env, dummies = got["gm"], got["inputs"], got["shape_env"], got["dummies"]
    reads = reads_after(got.get("reads"), model, scope)
    got.clear()             # (Note [a backend that lets the model go])
    id_to_leaf = {id(m): i for i, m in enumerate(meta_leaves) if isinstance(m, torch.Tensor)}

    params, param_names, buffers, buffer_names = [], [], [], []
    index_of: dict[int, int] = {}
    cap = Captured(gm, params, param_names, buffers, buffer_names, copies.device,
                   in_spec=in_spec, batch_size=batch, on_copies=True, shape_env=shape_env, reads=reads)
    for node, ex in zip(cap.placeholders(), example_inputs):
        if isinstance(ex, (torch.SymInt, int)):
            _mark_sym(node, ex)
            continue
        if id(ex) in swap.host_of:
            kind, host, fqn = swap.host_of[id(ex)]
            lst, names = (params, param_names) if kind == "param" else (buffers, buffer_names)
            if id(host) not in index_of:
                index_of[id(host)] = len(lst)
                lst.append(host)
                names.append(fqn)
            node.meta["rp_kind"], node.meta["rp_index"] = kind, index_of[id(host)]
            node.meta["rp_name"] = names[index_of[id(host)]]
        elif id(ex) in id_to_leaf:
            node.meta["rp_kind"], node.meta["rp_index"] = "input", id_to_leaf[id(ex)]
            node.meta["rp_leaf_name"] = labels[id_to_leaf[id(ex)]]
            # Dynamo may report meta inputs as requiring grad; the user's tensor says.
            node.meta["rp_requires_grad"] = bool(leaves[id_to_leaf[id(ex)]].requires_grad)
        else:
            # (a loss_fn's closed-over tensor, nn.CrossEntropyLoss(weight=w)'s: no module to register it on)
            loss_fn = (" (a loss_fn's: pass it in the target instead, target={'labels': y, 'weight': w}, and "
                       "read it there)" if wrap is not None else "")
            raise CaptureError(f"placeholder {node.name} is neither a parameter, a buffer nor an input of "
                               f"the call (a tensor created outside forward and closed over?): register it "
                               f"as a buffer of the module or pass it as an argument{loss_fn}")
    _refuse_reassigned(cap, swap.reassigned, dummies)
    _map_outputs(cap, out, dummies)
    return cap


def _map_outputs(cap: Captured, out, dummies):
    """Record the model output's pytree, its tensor leaves matched to graph outputs by identity."""
    out_leaves, cap.out_spec = pytree.tree_flatten(out)
    position = {id(d): i for i, d in enumerate(dummies) if isinstance(d, torch.Tensor)}
    cap.out_leaves = []
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in position:
                raise CaptureError("an output tensor of the model is not an output of the captured graph "
                                   "(dynamo rewrote it); return plain tensors from forward()")
            cap.out_leaves.append(("out", position[id(leaf)]))
        else:
            cap.out_leaves.append(("const", leaf))


def from_dynamo(gm: fx.GraphModule, example_inputs) -> Captured:
    """Wrap the graph a dynamo backend receives (real example inputs) as a Captured."""
    params, param_names, buffers, buffer_names = [], [], [], []
    cap = Captured(gm, params, param_names, buffers, buffer_names, torch.device("cpu"))
    for i, (node, ex) in enumerate(zip(cap.placeholders(), example_inputs)):
        source_name = dynamo_source_name(node)
        if isinstance(ex, (torch.SymInt, int)):
            _mark_sym(node, ex)
        elif isinstance(ex, torch.nn.Parameter):
            node.meta["rp_kind"], node.meta["rp_index"] = "param", len(params)
            node.meta["rp_name"] = source_name
            params.append(ex)
            param_names.append(source_name)
        elif "_buffers" in source_name:
            node.meta["rp_kind"], node.meta["rp_index"] = "buffer", len(buffers)
            node.meta["rp_name"] = source_name
            buffers.append(ex)
            buffer_names.append(source_name)
        else:
            node.meta["rp_kind"], node.meta["rp_index"] = "input", i
            node.meta["rp_requires_grad"] = bool(getattr(ex, "requires_grad", False))
            node.meta["rp_leaf_name"], node.meta["rp_module_state"] = dynamo_input_name(source_name)
        if isinstance(ex, torch.Tensor) and ex.device.type != "meta":
            cap.capture_device = ex.device
    return cap


def dynamo_source_name(node: fx.Node) -> str:
    """Where dynamo reads a graph input from, "L['kwargs']['input_ids']" (the node's name where it
    does not say)."""
    arg = node.meta.get("grapharg")
    name = arg.source.name if arg is not None and arg.source is not None else node.name
    return name() if callable(name) else str(name)


def dynamo_input_name(source: str) -> tuple:
    """(readable name, whether it is module state) of a dynamo input source such as
    "L['kwargs']['input_ids']" (-> "input_ids") or "L['args'][0]._modules['emb'].norm_type"
    (module state: an attribute of a module, never a batched argument). An attribute of another
    object is an argument's: "L['stack0'].last_hidden_state", the model output a graph before a
    break returned, was taken as module state and left whole while the labels beside it were
    split (a StageError on Qwen3-MoE through the backend)."""
    module_state = source.startswith("L['self']") or bool(re.search(r"\._(modules|parameters|buffers)\[", source))
    return call_leaf_name(source), module_state
