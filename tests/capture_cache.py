"""The suite's captures, kept per pytest process: most tests build the same small transformers
models (tests/models.py) and call them with the same shapes, and a TorchDynamo capture is most of
such a test's time (1.5-2.5 s of a 2-layer Qwen3's 3-4 s on the CI's two cores). A call whose
model and inputs match an earlier capture's gets that capture bound to its own parameters and
buffers, as a re-plan of one model plans its one capture again (plan_cache.py): the graph, its
size symbols and the costs measured on it are shared; every value the graph reads is the new
model's. The first test of each model and shape captures as a user's call does; what a test
changes that the graph could depend on (a config field, a hook, a frozen parameter, train/eval,
the grad mode, an added loss function) makes it a new capture.

Only transformers models and peft models of them are kept (their config, and a peft model's
adapter configs and adapter state, say what the graph depends on); a call with a loss_fn is kept
by what the loss_fn computes by, as rpcompile's plan key holds it (reads.frozen: code, closure
values, defaults; one it cannot freeze is not kept). A model with hooks is not kept, but for
transformers' output recorders, which every capture installs. Tests of the capture itself
(errors, graph breaks, its timeline) use other models or call rpcompile.capture.capture_call
directly, which this leaves alone. RPCOMPILE_TEST_FRESH_CAPTURES=1 turns it off."""
import dataclasses

import torch
from torch.utils import _pytree as pytree

from rpcompile.adapter_state import adapter_layers, adapter_state
from rpcompile.capture import OUTPUT_RECORDERS, _install_output_recorders
from rpcompile.reads import Unfreezable, frozen


def _leaf_sig(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("t", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type, leaf.requires_grad)
    return ("v", type(leaf).__name__, repr(leaf))


def _plain_attrs(module):
    """A module's plain attributes (training, eps, dropout p, gradient_checkpointing, ...)."""
    return tuple(sorted((k, v) for k, v in vars(module).items()
                        if isinstance(v, (bool, int, float, str, type(None))) and k != _RECORDERS_INSTALLED))


# transformers' output recorders: forward hooks its models' first call installs, and every
# capture before it traces (Note [recorded outputs] in rpcompile/capture.py), so a model that has
# them (it ran eagerly, or was captured before) captures as one without them
_RECORDERS_INSTALLED = "_output_capturing_hooks_installed"


def _hooked(module) -> bool:
    """Whether `module` has a hook other than transformers' output recorders."""
    tables = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
              getattr(module, "_backward_pre_hooks", None) or {})
    return any(getattr(h, "__module__", None) != OUTPUT_RECORDERS for t in tables for h in t.values())


# torch.nn.modules.module's hooks on every module (a module's own are checked module by module)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _key(model, args, kwargs, kw):
    loss_fn = kw.get("loss_fn")
    if kw.get("wrap") is not None and loss_fn is None:
        return None
    if not type(model).__module__.startswith(("transformers.", "peft.")):
        return None
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    try:        # (a loss_fn by what it computes by, as rpcompile's plan key holds it: Note [loss_fn in the key])
        loss_key = frozen(loss_fn) if loss_fn is not None else None
    except Unfreezable:
        return None
    modules = list(model.named_modules(remove_duplicate=False))
    if any(map(_hooked, (m for _, m in modules))) or any(getattr(torch.nn.modules.module, g, None) for g in _GLOBAL_HOOKS):
        return None
    owner: dict = {}
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad, owner.setdefault(id(p), n))
                   for n, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype, owner.setdefault(id(b), n))
                    for n, b in model.named_buffers(remove_duplicate=False))
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    # (a peft model: its adapters' configs, and the state its layers branch on, Note [adapter state
    # in the key] in rpcompile/adapter_state.py)
    adapters = (repr(getattr(model, "peft_config", None)), adapter_state(adapter_layers(model)))
    return (type(model), config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None),
            tuple((n, type(m), _plain_attrs(m)) for n, m in modules), params, buffers,
            tuple(_leaf_sig(x) for x in leaves), str(spec), torch.is_grad_enabled(),
            torch.is_autocast_enabled(), torch.get_default_dtype(), loss_key, adapters,
            repr(sorted((k, repr(v)) for k, v in kw.items() if k not in ("wrap", "loss_fn"))))


def _bound(cap, model):
    """cap with model's own parameters and buffers in place of the ones it was captured with."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    if not (set(cap.param_names) <= params.keys() and set(cap.buffer_names) <= buffers.keys()):
        return None
    return dataclasses.replace(cap, params=[params[n] for n in cap.param_names],
                               buffers=[buffers[n] for n in cap.buffer_names])


def kept(capture_call):
    """capture_call, serving a capture made before for the same model and call (see above);
    `.hits` counts the captures it served."""
    store: dict = {}

    def call(model, args, kwargs, **kw):
        key = _key(model, args, kwargs, kw)
        if key is not None and key in store:
            cap = _bound(store[key], model)
            if cap is not None:
                # (as a capture does: transformers' output recorders on the model, which its
                # reads count: Note [recorded outputs] in rpcompile/capture.py)
                _install_output_recorders(model)
                call.hits += 1
                return cap
        cap = capture_call(model, args, kwargs, **kw)
        if key is not None:
            store[key] = cap
        return cap
    call.hits = 0
    return call
