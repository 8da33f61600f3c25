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
says which value changed: a value changed at every step captures at every step.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

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


class PlanCache:
    def __init__(self, config):
        self.config = config
        self._groups: dict = {}      # key -> [_Capture]
        self.least_share = 0.0       # a plan made beside a smaller share of the optimizer no longer serves
        self.budgets = ModelBudgets(config)   # what the model's plans are held to (passes/budgets.py)
        self.scope = None            # {"model": ..., "loss_fn": ...} of the call looked up (Captured.reads)

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

    def lookup(self, key, leaves, capture, compile):
        """The plan for a call: capture() -> Captured and compile(captured, at) -> Plan make new ones."""
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
            return self._plan_at(c, sizes, compile)
        if stale is not None:
            _warn_changed(stale.captured.reads.changes(self.scope), len(group) + 1)
        cap = capture()
        plan = compile(cap, None)
        c = _Capture(cap, InputShapes(cap, plan.batch.symbols), [plan])
        group.append(c)
        return self._plan_at(c, c.shapes.accept(leaves), compile)

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


def _warn_changed(changes: list, n: int) -> None:
    """Say which values the forward read changed since the capture, whose change captures anew."""
    if not changes:
        return
    more = f" (and {len(changes) - 1} more changes)" if len(changes) > 1 else ""
    warnings.warn(f"rpcompile: {changes[0]}{more}; the forward reads it as a constant, so this call captures the "
                  f"model again ({n} captures kept for calls like it). A value changed at every step captures at "
                  "every step: change it less often, or keep it in a tensor (a buffer the forward reads), which the "
                  "graph takes as an input.", stacklevel=5)


def _batch_names(plan) -> set:
    return {s.name for s in plan.batch.symbols} if plan.batch is not None else set()
