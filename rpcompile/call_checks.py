"""What a compiled model's call is checked for before anything runs: each check raises an
InputError that says what is wrong and how to fix it, and nothing has changed yet."""
from __future__ import annotations

import inspect
import threading

import torch

from .errors import InputError


class FirstParameters:
    """Note [parameters replaced after the first call]: the plans, the host buffers (gradient
    sets, working copies, flat masters) and the devices' copies are made for the parameters the
    first call found. A module or Parameter replaced after it (`model.lm_head = ...`,
    `load_state_dict(..., assign=True)`, `resize_token_embeddings`) or a parameter given another
    shape or dtype (`model.to(torch.bfloat16)`) went unnoticed: the old plan kept training the old
    tensors, which the user no longer sees (a silently wrong loss, no gradient on the new
    parameters), or failed inside a stage job. So each call compares the parameters with the first
    call's, by identity, shape, dtype and device, and a change is an InputError that says to
    compile the model again (a new CompiledModel starts from the parameters as they are).

    Note [parameters on the host]: rpcompile keeps the parameters in host memory and moves what
    each stage job reads to its device itself, so a parameter elsewhere is an InputError at the
    first call: a model made on the meta device (accelerate's init_empty_weights) failed in its
    first stage job ("Cannot copy out of meta tensor"), and one moved to a GPU by habit
    (`model.cuda()`, `device_map="cuda"`) is not what the host buffers are made for."""

    def __init__(self):
        self.first = None       # (name, parameter, shape, dtype, device) the first call found

    def check(self, params) -> None:
        now = [(name, p, p.shape, p.dtype, p.device) for name, p in params]
        if self.first is None:
            _refuse_off_host(now)
            self.first = now
            return
        old = self.first
        if len(now) == len(old) and all(a[1] is b[1] and a[2:] == b[2:] for a, b in zip(now, old)):
            return
        before = {name: rest for name, *rest in old}
        changes: dict = {}          # what changed -> the names it changed for
        for name, p, shape, dtype, device in now:
            q, qshape, qdtype, qdevice = before.pop(name, (None, None, None, None))
            what = ("is new" if q is None else "is a new Parameter" if p is not q else
                    f"changed shape {tuple(qshape)} -> {tuple(shape)}" if shape != qshape else
                    f"changed dtype {qdtype} -> {dtype}" if dtype != qdtype else
                    f"moved {qdevice} -> {device}" if device != qdevice else None)
            if what:
                changes.setdefault(what, []).append(name)
        for name in before:
            changes.setdefault("is gone", []).append(name)
        said = [f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} {what}"
                for what, names in changes.items()]
        more = f"; and {len(said) - 4} more changes" if len(said) > 4 else ""
        raise InputError(
            f"the model's parameters changed since the first call of this compiled model: {'; '.join(said[:4])}"
            f"{more}. Its plans, host buffers and device copies are made for the parameters that call found "
            "(a module or Parameter replaced, load_state_dict(..., assign=True), resize_token_embeddings or "
            "model.to(dtype) after it). Compile the model again, rpcompile.compile(model, config), and give the "
            "optimizer the new parameters; or make such changes before the first call.")


def _refuse_off_host(params) -> None:
    """Note [parameters on the host]."""
    off: dict = {}
    for name, p, *_, device in params:
        if device.type != "cpu":
            off.setdefault(device, []).append(name)
    if not off:
        return
    said = "; ".join(f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} on {device}"
                     for device, names in off.items())
    meta = any(d.type == "meta" for d in off)
    fix = ("A model made on the meta device has no weights yet: load them onto the CPU first "
           "(from_pretrained(...) without device_map, or model.to_empty(device='cpu') and load_state_dict)"
           if meta else "Leave the model on the CPU (no model.cuda() or device_map='cuda'), or move it back "
           "with model.to('cpu') before compiling")
    raise InputError(f"the model's parameters must be in host memory (CPU): {said}. rpcompile keeps them "
                     f"there and moves what each stage job reads to Config.devices itself. {fix}.")


def no_autocast() -> None:
    """Note [no ambient autocast]: a call under the caller's torch.autocast was captured under it
    (the graph's dtypes autocast's) while the stage jobs ran in worker threads and processes, which
    a thread's autocast does not reach, and the plan served later calls whatever their autocast: a
    plain call after an autocast one returned autocast's logits, one after a plain call ignored it,
    train_step landed between the two. rpcompile casts on its own (Config(dtype=...): bf16 on GPUs
    by default, fp32 masters), so autocast around a call is an InputError that says so."""
    on = [t for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)]
    if on:
        raise InputError(
            f"the compiled model was called under torch.autocast ({', '.join(on)}): its stage jobs run in "
            "worker threads and processes, which your thread's autocast does not reach. rpcompile casts on its "
            "own: Config(dtype=torch.bfloat16) computes in bf16 (the default on GPUs) beside fp32 master "
            "weights. Call the model outside torch.autocast.")


def binds(model, args, kwargs) -> None:
    """The call's arguments bind to the model's forward, as Python checks an eager call (dynamo's
    trace of `model(ids, input_ids=ids)` ran, where eager raises a TypeError)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):      # no signature to check against (a C function, say)
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"{type(model).__name__}.forward does not take these arguments: {e}") from None


class OneCall:
    """Note [one call at a time]: a step's state (the plan's runner, its host gradient set, the
    step's microbatches) is the compiled model's, one at a time. Two threads calling train_step at
    once ran without an error and lost one batch's gradients (the other's came out twice). A call
    that finds another running is an InputError; calls one after another from any thread are fine.
    Use: `with one_call:` around a call."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            raise InputError("a call of this compiled model is already running (in another thread, or this call "
                             "came from inside it): train_step and calls run one at a time. Call it from one "
                             "thread, or hold a lock of your own around the calls.")
        return self

    def __exit__(self, *exc):
        self._lock.release()
        return False
