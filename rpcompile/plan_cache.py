"""The plans of a compiled model: which capture and which plan serve a call.

Note [plans per length]: calls are grouped by what a plan cannot vary over (mode, argument
structure, dtypes, ranks, constants, every module's training mode, which parameters train);
sizes are left to the captures. Per group, a list of captures; a call uses the first capture
whose symbolic shapes and guards its sizes agree with (shapes.py), or captures anew (Note
[dynamic lengths]).

A capture's first plan was cut at the capture's sizes ("costed at" in `print(cm.plan)`). At
another size the same cut can need more device memory (activations grow with the length), so
before a plan serves new sizes its jobs are re-costed there by substitution into the cost
pass's symbolic expressions (passes/at_sizes.py): a plan whose jobs all fit the memory budget
serves; where none of the capture's plans fits, the passes run again on the same capture at
the new sizes (no dynamo), which gives more, smaller stage jobs and the LM head split as a
capture at those sizes would (Note [shards by memory] in passes/lm_head.py), or a PlanningError when no
cut fits (saying the longest length that does: Note [longest length] in passes/longest.py).
The choice is memoised per size, so a steady step costs one dict lookup.

A capture also serves only calls whose model (and loss_fn) hold the values its forward read, as
it read them (Note [what the forward read] in reads.py): `scope` names the call's model and
loss_fn. Where a capture's sizes agree but such a value changed, the call captures anew and
says which value changed: a value changed at every step captures at every step, and the
captures a group keeps are bounded (Note [captures kept]).
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch

from .passes.at_sizes import job_memory_at
from .passes.budgets import ModelBudgets
from .passes.host_memory import host_bytes_at
from .shapes import InputShapes


@dataclass
class _Capture:
    captured: object
    shapes: InputShapes
    plans: list                                   # plans of this capture, the first at its own sizes
    chosen: dict = field(default_factory=dict)    # planning sizes -> the plan that serves them
    used: int = 0                                 # when a call last used it (Note [captures kept])


# Note [constant arguments]: a call's argument that is not a tensor (an int, a float, a string) is
# part of its call group's key: the capture reads it as a constant (`step=t` in train_step(ids,
# labels, step=t), an int num_items_in_batch). A new value each step made a new group each step,
# captured and planned anew (0.19 s a step for a two-layer MLP that takes 2 ms), silently, and kept
# every group with its plans and compiled programs, without end. The groups whose keys differ only
# in such values form a family: the first call that changes one says which argument and what to
# do, once, and a family keeps at most Config.captures_kept groups, dropping the least recently
# used as Note [captures kept] drops captures.
# Note [captures kept]: every capture of a call group was kept, with its plans, and the runner's
# compiled stage programs (with Inductor, their kernels), loss counters and worker processes'
# copies of the plans, all keyed by plan: a Dropout's p annealed at every step captured at every
# step and kept every capture, without end. torch.compile bounds its recompiles of a frame
# (torch._dynamo.config.recompile_limit, 8) and says so when the bound is hit; here a group keeps
# at most Config.captures_kept (also 8) captures, and a new one past that drops the least recently
# used, whose plans the runner lets go of everything it keeps for (`release`:
# GraphRunner.release_plans). The order the captures are tried in stays that of their making, so
# which capture serves a call does not change with use. A value that alternates between a few
# settings (two dropout rates, a flag set and cleared) keeps hitting its captures; one changed at
# every step still captures at every step, and is said once, at the first capture the bound
# drops, not at each step after it.
class PlanCache:
    def __init__(self, config, release=None):
        self.config = config
        self.release = release       # plans -> None: what is kept for them goes (Note [captures kept])
        self._groups: dict = {}      # key -> [_Capture], in the order they were made
        self._dropping: set = set()  # keys of the groups whose bound dropped a capture (said once)
        self._uses = itertools.count(1)
        self.least_share = 0.0       # a plan made beside a smaller share of the optimizer no longer serves
        self.budgets = ModelBudgets(config)   # what the model's plans are held to (passes/budgets.py)
        self.scope = None            # {"model": ..., "loss_fn": ...} of the call looked up (Captured.reads)
        self._families: dict = {}    # family -> {group key: the call's constants} (Note [constant arguments])
        self._said: set = set()      # families whose changed argument was said (once)

    def reserve(self, share: float) -> None:
        """From now on the plans reserve `share` of the optimizer on the devices: those made beside
        less are planned again at their next use (Note [a call's share chosen again], compiled.py)."""
        self.least_share = share
        for caps in self._groups.values():
            for c in caps:
                c.chosen.clear()

    def plans(self) -> list:
        return [p for caps in self._groups.values() for c in caps for p in c.plans]

    def captures(self) -> int:
        return sum(len(caps) for caps in self._groups.values())

    def lookup(self, key, leaves, capture, compile, family=None):
        """The plan for a call: capture() -> Captured and compile(captured, at) -> Plan make new ones.
        family: (the key with the call's non-tensor arguments left out, {argument: its value}), for
        Note [constant arguments]."""
        if family is not None and key not in self._groups:
            self._new_group(key, *family)
        group = self._groups.setdefault(key, [])
        stale = None
        for c in group:
            sizes = c.shapes.bind(leaves)
            if sizes is None:
                continue
            reads = c.captured.reads
            if reads is not None and self.scope is not None and not reads.holds(self.scope):
                stale = c
                continue
            c.used = next(self._uses)
            return self._plan_at(c, sizes, compile)
        changes = stale.captured.reads.changes(self.scope) if stale is not None else []
        kept = self.config.captures_kept
        if key not in self._dropping:
            if len(group) >= kept:
                self._dropping.add(key)
                _warn_dropping(changes, kept)
            elif changes:
                _warn_changed(changes, len(group) + 1, kept)
        cap = capture()
        plan = compile(cap, None)
        c = _Capture(cap, InputShapes(cap, plan.batch.symbols), [plan], used=next(self._uses))
        group.append(c)
        while len(group) > kept:
            self._drop(group, min(group, key=lambda old: old.used))
        return self._plan_at(c, c.shapes.accept(leaves), compile)

    def _new_group(self, key, family, constants: dict) -> None:
        """Note [constant arguments]: say the first time a family's call changes an argument, and
        keep at most Config.captures_kept of its groups."""
        members = self._families.setdefault(family, {})
        if members and family not in self._said:
            last = next(reversed(members.values()))
            changed = [f"{name} is {value}, where an earlier call passed {last[name]}"
                       for name, value in constants.items() if name in last and last[name] != value]
            if changed:
                self._said.add(family)
                _warn_at_caller(f"rpcompile: {_changed(changed)}. A call's argument that is not a tensor is a constant "
                                "of its capture, so a call with a new value captures and plans the model again (at "
                                f"most {self.config.captures_kept} such captures are kept: Config.captures_kept). A "
                                "value changed at every step captures at every step: pass it as a tensor "
                                "(torch.tensor(value)), which the graph takes as an input, or keep it the same. "
                                "This is not said again.")
        members[key] = constants
        while len(members) > self.config.captures_kept:    # (captures_kept >= 1: another member is there)
            old = min((k for k in members if k != key), key=lambda k: max((c.used for c in self._groups[k]), default=0))
            del members[old]
            group = self._groups.pop(old)
            for c in list(group):
                self._drop(group, c)

    def _drop(self, group: list, c: _Capture) -> None:
        group.remove(c)
        if self.release is not None:
            self.release(c.plans)

    def _plan_at(self, c: _Capture, sizes: dict, compile):
        at = self._planning_sizes(c.plans[0], sizes)
        sig = tuple(sorted(at.items()))
        plan = c.chosen.get(sig)
        if plan is None:
            plan = next((p for p in c.plans if self._fits(p, at)), None)
            if plan is None:
                plan = compile(c.captured, at)
                c.plans.append(plan)
            c.chosen[sig] = plan
            lengths = {s: v for s, v in at.items() if s not in _batch_names(plan)}
            if lengths and lengths not in plan.served:
                plan.served.append(lengths)
        return plan

    def _planning_sizes(self, plan, sizes: dict) -> dict:
        """Call sizes as a plan costs them: a batch symbol is the rows of the largest microbatch."""
        out = {}
        for name, v in sizes.items():
            if name in _batch_names(plan):
                v = math.ceil(v / max(1, min(plan.num_microbatches, v)))
            out[name] = v
        return out

    def _fits(self, plan, at: dict) -> bool:
        if plan.optimizer_share < self.least_share:
            return False
        if all(plan.bindings.get(s) == v for s, v in at.items()):
            return True
        bindings = {**plan.bindings, **at}
        if plan.memory_budget is not None and max(job_memory_at(plan, self.config, bindings)) > plan.memory_budget:
            return False
        return self._host_fits(plan, at)

    def _host_fits(self, plan, at: dict) -> bool:
        """Whether the plan's host memory at `at` fits the first train plan's host budget (Note
        [host room] in passes/host_memory.py): its activations grow with the sizes."""
        first = self.budgets.host_first
        if first is None or plan.host_memory is None:
            return True
        return host_bytes_at(plan, self.config.optimizer_mode, at) <= first.budget


def _warn_changed(changes: list, n: int, kept: int) -> None:
    """Say which value the forward read changed since the capture, whose change captures anew."""
    if not changes:
        return
    _warn_at_caller(f"rpcompile: {_changed(changes)}; the forward reads it as a constant, so this call captures the "
                    f"model again ({n} captures kept for calls like it, of at most {kept}: Config.captures_kept). A "
                    f"value changed at every step captures at every step: {_REMEDY}.")


def _warn_dropping(changes: list, kept: int) -> None:
    """Say once that a group's bound drops captures (Note [captures kept])."""
    why = (f"{_changed(changes)}, which the forward reads as a constant" if changes
           else "none of the captures kept serves this call's sizes")
    _warn_at_caller(f"rpcompile: {why}, and {kept} captures are kept for calls like it already "
                    f"(Config.captures_kept), so this call captures the model again and the least recently used "
                    f"capture is dropped with its plans and compiled stage programs; a call that needs it captures "
                    f"again. Each later capture of these calls drops one too, and is not said again: {_REMEDY}.")


_REMEDY = ("keep such a value in a tensor (a buffer the forward reads), which the graph takes as an input, or change "
           "it less often")


def _changed(changes: list) -> str:
    more = f" (and {len(changes) - 1} more changes)" if len(changes) > 1 else ""
    return f"{changes[0]}{more}"


# frames of rpcompile's own and torch's (nn.Module.__call__) files, between a call and its warning
_NOT_THE_CALLER = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                   os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _warn_at_caller(message: str) -> None:
    """warnings.warn, pointing at the line that called rpcompile (cm.train_step(...) or cm(...),
    through nn.Module.__call__): the first frame outside rpcompile and torch. (Python 3.12's
    skip_file_prefixes does this; 3.11 has only a stacklevel, counted here.)"""
    frame, level = sys._getframe(), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def _batch_names(plan) -> set:
    return {s.name for s in plan.batch.symbols} if plan.batch is not None else set()
