"""CompiledModel: what `rpcompile.compile(model)` returns."""
from __future__ import annotations

import functools
import os
import time
import types
import weakref
from typing import Callable, Optional

import torch
from torch.utils import _pytree as pytree

from .adapter_state import adapter_layers, adapter_state
from .call_checks import FirstParameters, OneCall, binds, no_autocast
from .capture import capture_call, flatten_call
from .config import Config
from .errors import InputError
from .passes import PlanningError, compile_graph
from .passes.batch import LOSS_TARGET, leaf_names
from .passes.host_memory import HostMemoryError
from .plan_cache import PlanCache
from .reads import Unfreezable, frozen
from .runner import GraphRunner
from .runtime import timeline
from .runtime.trace import write_chrome_trace

_TARGET = LOSS_TARGET


# loss_fn values told apart by identity alone, each kept with its capture (Note [loss_fn in the
# key]): beyond this many a call with another is refused
_KEPT_BY_IDENTITY = 16


class CompiledModel(torch.nn.Module):
    """A model whose calls run as pipelined stage jobs over the devices of a Config.

    `train_step(...)` runs forward and backward over the microbatches and adds the gradients
    into each parameter's `.grad` (host); `cm(...)` runs the model and is differentiable.
    """

    def __init__(self, model: torch.nn.Module, config: Optional[Config] = None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"rpcompile.compile takes a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config or Config()
        self.runner = GraphRunner(self.config)
        self._plans = PlanCache(self.config, release=self.runner.release_plans)   # (Note [captures kept])
        self._last_plan = None
        self._parameters_seen = FirstParameters()
        self._one_call = OneCall()
        self._read_hooks: dict = {}     # id(model or optimizer) -> its synchronizing hooks' handles
        self._adapter_layers = None     # peft's adapter layers, found at the first call
        self._kept_loss_fns: dict = {}  # loss_fn values the plan keys name by id (Note [loss_fn in the key])
        self._microbatches = None       # Config.num_microbatches at the first train plan (Note [microbatches fixed])
        dump = self.config.dump_dir or os.environ.get("RPCOMPILE_DUMP")
        self._dump_dir = dump

    # --- plans -----------------------------------------------------------------------------
    def _call_kwargs(self, kwargs):
        # Training never reads a KV cache; transformers models make one unless told not to.
        cfg = getattr(self.model, "config", None)
        if cfg is not None and getattr(cfg, "use_cache", None) is not None and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        return kwargs

    def _key(self, mode, leaves, spec, extra, params):
        # Sizes are not part of the key: the captures of a key check them (Note [plans per length]).
        sig = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                sig.append(("T", leaf.dtype, leaf.dim(), leaf.requires_grad))
            else:
                sig.append(("C", repr(leaf)))
        # Freezing or unfreezing parameters changes which gradients the stages compute.
        trainable = tuple(p.requires_grad for _, p in params)
        if self._adapter_layers is None:
            self._adapter_layers = adapter_layers(self.model)
        # Every module's train/eval mode, not the model's alone: a submodule put in eval mode (a
        # frozen BatchNorm, layers without dropout) kept the plan captured in train mode, its
        # batch statistics and dropout (gradients 0.65 of the largest off eager's, silently)
        training = tuple(m.training for m in self.model.modules())
        # (Note [adapter state in the key] in adapter_state.py)
        return (mode, spec, tuple(sig), training, trainable, extra, adapter_state(self._adapter_layers))

    def _loss_fn_key(self, loss_fn):
        """Note [loss_fn in the key]: the key held id(loss_fn) alone, and a loss_fn freed after its
        call left its id to the next one: `train_step(..., loss_fn=make_loss(c))` with a new closure
        each step (or a bound method, `loss_fn=self.loss`, a new object at each access) could get
        another function's plan, silently its loss and gradients (c=2 trained with c=1's). The key
        holds what the function computes by: a plain function's code, closure values and defaults
        (a lambda written in the training loop is a new object each step, the same function: one
        capture serves them all, where keying the object captured again every step and kept each
        capture), a bound method's function and object, a functools.partial's function and
        arguments, and any other callable itself (equal ones share the plan). Values are taken by
        what they hold where that is their equality (reads.frozen: lists, dicts, sets, tuples,
        dataclass instances, nested functions and partials; a loss module with no parameters or
        submodules, nn.CrossEntropyLoss(label_smoothing=0.1), as its type and plain attributes):
        a closure made each step over an equal dict of weights serves from the first capture, where
        keying the unhashable dict by id captured again every step and kept every capture. A value
        with no such key (an unhashable object of no known structure) is keyed by id and kept
        alive, so that its id names no other; a new one each step captures again each step, each
        capture in a call group of its own, which the bound on a group's captures (Note [captures
        kept] in plan_cache.py) does not reach, so past _KEPT_BY_IDENTITY such values a call with
        another is refused with what to pass instead (a count, not which of them their user still
        holds: a reference count says that differently from one Python to the next). (What
        the capture read of the loss_fn, an attribute of a loss object, is checked at each call
        besides: Note [what the forward read] in reads.py.)"""
        if loss_fn is None:
            return None
        return self._value_key(loss_fn, "loss_fn")

    def _value_key(self, value, what: str, depth: int = 0):
        """Part of a loss_fn key (Note [loss_fn in the key]) for `value` (`what` names it)."""
        try:
            return frozen(value)
        except Unfreezable:
            pass
        # (whose parts are keyed each as it can be: the unhashable ones by identity)
        if depth < 4 and isinstance(value, functools.partial):
            return ("partial", self._value_key(value.func, what, depth + 1),
                    tuple(self._value_key(a, f"{what}'s argument", depth + 1) for a in value.args),
                    tuple((k, self._value_key(v, f"{what}'s {k}=", depth + 1)) for k, v in value.keywords.items()))
        if depth < 4 and isinstance(value, types.MethodType):
            return ("method", value.__func__, self._value_key(value.__self__, f"{what}.__self__", depth + 1))
        if depth < 4 and isinstance(value, types.FunctionType):
            code = value.__code__
            cells = tuple(self._value_key(c.cell_contents, f"{what}'s {name!r}", depth + 1)
                          for name, c in zip(code.co_freevars, value.__closure__ or ()))
            return ("function", code, cells, self._value_key(value.__defaults__, f"{what}'s defaults", depth + 1),
                    self._value_key(value.__kwdefaults__, f"{what}'s defaults", depth + 1))
        if id(value) not in self._kept_loss_fns:
            if len(self._kept_loss_fns) >= _KEPT_BY_IDENTITY:
                raise InputError(
                    f"{what} is a {type(value).__name__}, which rpcompile can neither hash nor compare by what it holds, "
                    f"so each new one is captured anew, and {len(self._kept_loss_fns)} such values are kept with their "
                    "captures. Pass the same object each step, or values rpcompile compares by what they hold (numbers, "
                    "strings, tuples, lists, dicts, dataclasses), or pass it in the target "
                    "(target={'labels': y, 'weight': w}) and read it there.")
            self._kept_loss_fns[id(value)] = value
        return ("id", id(value))

    def _plan(self, mode, args, kwargs, loss_fn=None):
        if self._last_plan is None:
            timeline.mark("first call")
            timeline.mark_long_collections()
            # worker processes start beside the capture, told the model's modules (Note [early workers])
            self.runner.prestart(sorted({type(m).__module__ for m in self.model.modules()} - {"__main__"}))
        no_autocast()
        params = list(self.model.named_parameters())
        self._parameters_seen.check(params)
        leaves, spec = flatten_call(args, kwargs)
        self._refuse_new_microbatches()
        key = self._key(mode, leaves, spec, self._loss_fn_key(loss_fn), params)
        config = self.config

        captured_s = []

        # Note [no planning beside a step's jobs]: in delayed mode a train step returns before its
        # backward jobs end, and a capture or plan made meanwhile (a call at a new length to
        # evaluate, a new length to train) ran its cost pass's FlopCounterMode, whose module
        # tracker hooks every module of the process, while worker threads ran those jobs' autograd:
        # a job failed ("A leaf node was passed to _will_engine_execute_node ...") and the step was
        # lost. So a new capture or plan waits for the step's jobs first (a failure of theirs is
        # raised here, as by any next call); calls that reuse a plan do not wait.
        def capture():
            self.runner.settle()
            binds(self.model, args, {k: v for k, v in kwargs.items() if k != _TARGET})
            wrap = _with_loss(loss_fn) if loss_fn is not None else None
            t0 = time.perf_counter()
            cap = capture_call(self.model, args, kwargs, dtype=config.compute_dtype, wrap=wrap,
                               device=config.devices[0], unbatched=config.unbatched_inputs,
                               dynamic_lengths=config.dynamic_lengths, loss_fn=loss_fn)
            captured_s.append(time.perf_counter() - t0)
            timeline.mark("captured", captured_s[-1])
            timeline.mark_compile_seconds()     # (the capture's TorchDynamo trace, by phase)
            return cap

        def compile(cap, at):
            self.runner.settle()        # Note [no planning beside a step's jobs]
            t0 = time.perf_counter()
            plan = self._compile(cap, mode, 0 if loss_fn is not None else None, at)
            timeline.mark("planned", time.perf_counter() - t0)
            if captured_s:          # this call captured: the capture's first plan
                plan.compile_seconds = {"dynamo_capture": captured_s.pop(), **plan.compile_seconds}
            if self._dump_dir:
                plan.dump(os.path.join(self._dump_dir, mode))
            return plan

        # captured and planned with gradients on whatever the caller's mode (Note [plans made with
        # gradients on]): the train and call plans of a key share the capture
        # (the values the captures' forward read are checked on this model and loss_fn: Note [what
        # the forward read] in reads.py)
        self._plans.scope = {"model": self.model, "loss_fn": loss_fn}
        try:
            with torch.inference_mode(False), torch.enable_grad():
                plan = self._plans.lookup(key, leaves, capture, compile, family=_family(key, args, kwargs))
        finally:
            self._plans.scope = None    # (kept, it would keep the call's loss_fn alive)
        self._last_plan = plan
        return plan, leaves

    def _refuse_new_microbatches(self) -> None:
        """Note [microbatches fixed]: the model's first train plan fixes how many microbatches a
        batch is split into (runner.num_microbatches: Config.num_microbatches, or more where that
        plan split finer, Note [finer microbatches] in passes/__init__.py), and every later plan
        splits as it does: its host buffers, held to that plan's budget (Note [host room]), and
        the optimizer's share on the devices are chosen for it. `cm.config.num_microbatches`
        changed after that plan was silently ignored: the old count went on. Planning everything
        anew at the new count is what compiling the model again does, so a changed count is an
        InputError that says so (and changing it back goes on as before)."""
        asked, now = self._microbatches, self.config.num_microbatches
        if asked is None or now == asked:
            return
        raise InputError(
            f"cm.config.num_microbatches was changed from {asked} to {now!r} after the first train step of this compiled "
            f"model, whose plans, host buffers and optimizer share are made for {asked} (the first train plan fixes "
            f"the count). To train with {now!r} microbatches, compile the model again with it: "
            f"cm = rpcompile.compile(model, Config(..., num_microbatches={now!r})) (and attach the optimizer to the "
            f"new one); or set cm.config.num_microbatches back to {asked}.")

    # Note [plans made with gradients on]: a first call under torch.no_grad() or
    # torch.inference_mode() (an evaluation before training) captured the model without autograd,
    # and that capture served the key's later plans: a train step's had no loss output (a
    # KeyError at that step and every later one), and a differentiable call's backward left every
    # .grad None, silently. The grad mode is no part of the key: the capture is made with
    # gradients on, and the runtime decides per call whether a gradient flows (GraphRunner.call).
    #
    # Note [a call's share chosen again]: the model's first plan chooses the optimizer's share on
    # the devices (Note [optimizer share by room] in passes/host_memory.py), and a forward call's
    # plan chooses by its room only: it costs no train step that the update could slow (Note
    # [optimizer share by pace]). Where a user's first call is a forward one (a loss before
    # training, a sanity check), training kept that share: planned here for four 125.3 GiB H200s,
    # Llama-3.1-8B's forward call (65,536 tokens, M=4) leaves no room, so its train plan got none
    # beside 4 replicas, where it takes the whole update when it comes first (at that load per GPU
    # on 2 H200s, 10,828 against 18,391 tokens/s). Nothing places the share before the first train
    # step (the modes flatten the masters at its start), so the first train plan chooses again; a
    # larger share than the call's makes the plans made beside less plan again at their next use
    # (PlanCache.reserve), since their jobs may not fit beside it.
    def _compile(self, cap, mode, loss_output, at):
        """compile_graph beside the optimizer's share on the devices that the plans reserve; a
        share the plan chose itself (Config.optimizer_on_devices=None) that leaves a new plan no
        room comes back to the host first (Note [optimizer share by room] in passes/host_memory.py);
        one a forward call's plan chose, the first train plan chooses again (Note [a call's share
        chosen again])."""
        runner = self.runner
        opt = runner.overlapped
        host_only = None if opt is None or opt.stepper.elementwise else type(opt.stepper.optimizer).__name__
        if host_only:      # stepped per parameter, on the host: nothing to place on the devices
            runner.optimizer_share, runner.share_of_a_call = 0.0, False
        again = mode == "train" and runner.share_of_a_call
        # the first train plan may split finer; the plans after it split as it does (Note [finer microbatches])
        first_train = mode == "train" and runner.num_microbatches is None
        # the first train plan allocates the host buffers, later ones share them, held to its
        # budget: only their activations grow (Note [host room]); the working copies a call made
        # before it are the plan's, or go at its first step (Note [calls read the newest copies])
        copies = runner.host_weights.nbytes() if first_train else 0
        budgets = self._plans.budgets
        first = dict(num_microbatches=runner.num_microbatches, split_finer=first_train,
                     budgets=budgets.for_plan(cap.params, first_train, host_only, copies))
        try:
            plan = compile_graph(cap, self.config, mode, loss_output=loss_output, at=at,
                                 on_devices=None if again else runner.optimizer_share, **first)
        except PlanningError as e:
            # (not where the host has no room for the state: Note [host room] in passes/host_memory.py)
            if (self.config.optimizer_on_devices is not None or not runner.optimizer_share
                    or isinstance(e, HostMemoryError) or runner.host_share):
                raise
            # planned before the state moves: a plan the host has no room for leaves it where it is
            plan = compile_graph(cap, self.config, mode, loss_output=loss_output, at=at, on_devices=0.0, **first)
            runner.optimizer_share = 0.0
            if opt is not None:
                self.synchronize()
                opt.bring_home()
        budgets.keep(plan, first_train)
        if first_train:
            runner.num_microbatches, runner.host_share = plan.num_microbatches, plan.host_share
            self._microbatches = self.config.num_microbatches     # (Note [microbatches fixed])
        if runner.optimizer_share is None or again:     # the first plan chose it: every later one reserves it
            if again and plan.optimizer_share > runner.optimizer_share:
                self._plans.reserve(plan.optimizer_share)
            runner.optimizer_share = plan.optimizer_share
            runner.share_of_a_call = mode != "train"
        return plan

    @property
    def plan(self):
        """The plan of the last call (train_step or forward); None before the first."""
        return self._last_plan

    @property
    def stages(self):
        return self._last_plan.stages if self._last_plan is not None else []

    @property
    def last_trace(self):
        """The executed schedule of the last step: dicts with device, stream, name, start_s,
        end_s, stage, role, job and microbatch (None before the first step)."""
        return self.runner.last_trace()

    @property
    def setup_timeline(self):
        """What this process and its worker processes finished in the first steps, and when
        (Note [setup timeline] in runtime/timeline.py): [{"t", "where", "what", "seconds"}],
        t in seconds after the first mark. The marks are the process's: every compiled model's."""
        return timeline.setup_timeline()

    @property
    def last_placements(self):
        """(job index, stage index, role, device index) of every job of the last run."""
        return self.runner.executor.placements

    @property
    def last_schedule(self):
        """The schedule of the last run (runtime/schedule.py): `print(cm.last_schedule)` shows
        its jobs as stage, role and device, e.g. `0F@0 1F@1 2FB@0 3B@1` (None before the first)."""
        return self.runner.executor.last_schedule

    def host_buffer_bytes(self) -> dict:
        """Bytes of the host buffers rpcompile allocated for this model and keeps across steps, by
        the kind `print(cm.plan)` names them ("working copies", "gradients", "gradient rows
        carried to a later chunk"): what the plan's host memory says, allocated (the parameters,
        their `.grad` and the optimizer's state are yours, and a step's activations come and go)."""
        return self.runner.host_buffer_bytes()

    def dump(self, path: str) -> None:
        """Write every plan's stage graphs (.py), plan.json, plan.txt and, after a step, the
        executed schedule as a Chrome/Perfetto trace (schedule.trace.json)."""
        modes = {}
        for plan in self._plans.plans():
            modes.setdefault(plan.mode, []).append(plan)
        for mode, plans in modes.items():
            for i, plan in enumerate(plans):
                plan.dump(os.path.join(path, mode if i == 0 else f"{mode}_{i}"))
        trace = self.last_trace
        if trace is not None:
            os.makedirs(path, exist_ok=True)
            write_chrome_trace(trace, os.path.join(path, "schedule.trace.json"))

    # --- optimizer -------------------------------------------------------------------------
    def attach_optimizer(self, optimizer, *, lr_scheduler=None, max_grad_norm=None, chunks: int = 32):
        """Overlapped and delayed modes (Config(optimizer_mode="overlapped" / "delayed")):
        rpcompile steps `optimizer` itself, in a host thread, right after each train_step's
        gradients land; the next step's jobs wait only for the parameters they read (Note
        [overlapped optimizer]), or in delayed mode not at all (Note [delayed optimizer]). Clipping by
        global norm (`max_grad_norm`) happens there too, and `lr_scheduler.step()` as train_step
        returns, so do not call them (or `optimizer.step()`) yourself; call `cm.synchronize()`
        before reading parameters or optimizer state. A step's update steps by
        `optimizer.param_groups` as they are when its train_step returns: a learning rate set then
        reaches the next step's update, as in eager (Note [hyperparameters per submission]).
        It is stepped a chunk of parameters at a time (`chunks` in overlapped mode, the gradient
        buffer's pieces in delayed mode), with only the step's gradients (what `.grad` holds is
        neither applied nor cleared): an optimizer whose update of one parameter reads others'
        gradients (a norm over all of them) sees its chunk's only; step such an optimizer in
        exact mode. Attaching another optimizer (or the same one again) takes over from the next
        step; in delayed mode the one step of delay starts again there: the next two steps
        compute at the parameters as they are at the attach."""
        from .runtime.optimizer import OverlappedOptimizer
        if self.config.optimizer_mode == "exact":
            raise InputError("attach_optimizer is for Config(optimizer_mode='overlapped' or 'delayed'); in exact "
                             "mode call optimizer.step() yourself after train_step")
        # (driven from a thread, a chunk at a time, with no closure and no metric: refused here
        # rather than failing a step later in a stage job's name)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise InputError("attach_optimizer: LBFGS steps with a closure that re-evaluates the model, which the "
                             "optimizer thread cannot give; use optimizer_mode='exact' and call optimizer.step(closure)")
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise InputError("attach_optimizer: ReduceLROnPlateau steps on a metric the optimizer thread does not "
                             "have; call its step(metric) yourself after cm.synchronize() instead of attaching it")
        self.synchronize()
        self.runner.attach(OverlappedOptimizer(optimizer, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm,
                                               chunks=chunks, state_devices=self.config.devices))
        self._synchronize_before_reads(optimizer)

    def _synchronize_before_reads(self, optimizer) -> None:
        """`state_dict()` and `load_state_dict()` of the model and of the attached optimizer call
        `synchronize()` first: they read or write the parameters and optimizer state, which the
        optimizer thread may still be stepping, and whose host masters may be stale (Note [masters
        kept on the devices], runtime/flat.py)."""
        ref = weakref.ref(self)

        def sync(*_):
            cm = ref()
            if cm is not None:
                cm.synchronize()
        for obj in (self.model, optimizer):
            if id(obj) not in self._read_hooks:
                self._read_hooks[id(obj)] = (obj.register_state_dict_pre_hook(sync),
                                             obj.register_load_state_dict_pre_hook(sync))

    def synchronize(self) -> None:
        """Wait for the last step's jobs (delayed mode returns before its backward jobs end:
        Note [overlapped steps]) and the overlapped optimizer's pending work (exact mode: none)."""
        self.runner.settle()
        if self.runner.overlapped is not None:
            self.runner.overlapped.synchronize()

    # --- running ---------------------------------------------------------------------------
    def train_step(self, *args, target=None, loss_fn: Optional[Callable] = None, grad_scale=None,
                   **kwargs) -> torch.Tensor:
        """Forward and backward of one batch; gradients are added into `.grad`. Returns the loss.

        grad_scale: a number to multiply the gradients by, or a `torch.amp.GradScaler("cpu")`
        whose current scale is used (fp16 training: then `scaler.step(opt); scaler.update()`);
        the returned loss is not scaled."""
        loss_fn = loss_fn or self.config.loss_fn
        kwargs = self._call_kwargs(kwargs)
        if loss_fn is not None:
            if target is None:
                raise InputError("a loss_fn is set, so train_step needs target=...: loss_fn(model(...), target)")
            kwargs = {**kwargs, _TARGET: target}
        elif target is not None:
            raise InputError("train_step got target=... but no loss_fn: give Config(loss_fn=...) or loss_fn=...")
        if self.config.optimizer_mode != "exact" and self.runner.overlapped is None:
            raise InputError(f"Config(optimizer_mode={self.config.optimizer_mode!r}) needs "
                             "cm.attach_optimizer(optimizer) before train_step")
        if self.runner.overlapped is not None and grad_scale is not None and grad_scale != 1:
            # the attached optimizer would step the scaled gradients: nothing unscales them
            raise InputError(f"grad_scale with Config(optimizer_mode={self.config.optimizer_mode!r}): the attached "
                             "optimizer steps the gradients as they land, so scaled ones would be applied as they "
                             "are. Loss scaling (fp16) needs optimizer_mode='exact' with scaler.step(optimizer)")
        with self._one_call:
            plan, leaves = self._plan("train", args, kwargs, loss_fn)
            if grad_scale is None:
                grad_scale = 1.0
            elif hasattr(grad_scale, "scale"):   # a GradScaler: scale() also starts its bookkeeping
                grad_scale = float(grad_scale.scale(torch.ones(())))
            return self.runner.train_step(plan, leaves, grad_scale=float(grad_scale))

    def forward(self, *args, **kwargs):
        """Run the model; differentiable w.r.t. its parameters (`out.loss.backward()` fills .grad)."""
        kwargs = self._call_kwargs(kwargs)
        with self._one_call:
            plan, leaves = self._plan("call", args, kwargs)
            # (training: the loss's backward runs ahead, Note [the loss's backward ahead] in runner.py)
            return self._rebuild(plan, self.runner.call(plan, leaves, ahead=self.model.training))

    @staticmethod
    def _rebuild(plan, outputs):
        cap = plan.captured
        values = [outputs[idx] if kind == "out" else idx for kind, idx in cap.out_leaves]
        return pytree.tree_unflatten(values, cap.out_spec)


def _family(key: tuple, args, kwargs):
    """(key without the values of the call's non-tensor arguments, {argument: value}): Note
    [constant arguments] in plan_cache.py."""
    mode, spec, sig, *rest = key
    names = leaf_names(args, kwargs)
    constants = {names[i]: s[1] for i, s in enumerate(sig) if s[0] == "C"}
    return (mode, spec, tuple(s if s[0] == "T" else ("C",) for s in sig), *rest), constants


def _with_loss(loss_fn):
    """What is captured when a loss_fn is given: loss_fn(model(...), target)."""
    def wrap(mod, *a, **k):
        target = k.pop(_TARGET)
        return loss_fn(mod(*a, **k), target)
    return wrap
