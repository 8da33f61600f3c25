"""What a plan is held to: each device's memory budget and the host's. A model's plans share
them (Notes [device budget measured once] below and [host room] in passes/host_memory.py): its
PlanCache keeps a ModelBudgets, which gives each new plan its Budgets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .host_memory import default_host_budget


@dataclass(frozen=True)
class Budgets:
    """One plan's budgets (compile_graph's `budgets`; the default: each device's measured now,
    the host's memory unchecked)."""
    # each device's bytes as the model's first plan measured them; None: measured for this plan
    device: Optional[int] = None
    host: Optional[int] = None          # bytes the plan's host memory may take; None: unchecked
    host_given: bool = False            # host is Config.host_memory_budget (not the host's available memory)
    # a later plan: the HostMemory of the model's first train plan, which allocated the host's
    # buffers; this one shares them and keeps its budget (only its activations grow)
    host_first: Any = None
    # the attached optimizer's name where it steps on the host only (its share is then 0), for the host's errors
    host_only: Optional[str] = None

    @classmethod
    def of_host(cls, config, params, copies: int = 0, **fields) -> "Budgets":
        """A first train plan's: Config.host_memory_budget, or what the host has available now
        (default_host_budget), with `copies` bytes of working copies the process holds, which
        the plan counts, counted free."""
        given = config.host_memory_budget is not None
        host = config.host_memory_budget if given else default_host_budget(params, copies)
        return cls(host=host, host_given=given, **fields)


class ModelBudgets:
    """The budgets a model's plans keep: each device's as its first plan measured it, and the
    host's as its first train plan was made within."""

    def __init__(self, config):
        self.config = config
        self.device: Optional[int] = None
        self.host_first = None       # the first train plan's HostMemory (None: none yet, or no host budget)

    def for_plan(self, params, first_train: bool, host_only: Optional[str] = None, copies: int = 0) -> Budgets:
        """A new plan's budgets: the first train plan's host budget is measured (with `copies`
        bytes, the working copies a call made before it, counted free: Note [calls read the
        newest copies] in runtime/modes.py); a later plan's is the first train plan's."""
        if first_train:
            return Budgets.of_host(self.config, params, copies, device=self.device, host_only=host_only)
        first = self.host_first
        return Budgets(device=self.device, host=None if first is None else first.budget,
                       host_given=first is not None and self.config.host_memory_budget is not None,
                       host_first=first, host_only=host_only)

    def keep(self, plan, first_train: bool) -> None:
        """Keep what a new plan measured: each device's budget (the model's first plan) and the
        host memory of its first train plan."""
        if self.device is None:
            self.device = plan.device_budget
        if first_train:
            self.host_first = plan.host_memory if plan.host_memory.budget is not None else None


# Note [device budget measured once]: by default (Config.memory_budget=None) a device's budget is
# 0.9 of its free memory, measured when the model's first plan is made, and every later plan of
# the model keeps that figure. Measured again, it would leave out what the model itself holds
# by then (the optimizer's share, resident weights, the caching allocator's blocks): on one H200,
# Llama-3.1-8B's train plan at 32 rows of 2048 tokens measured 125.2 GiB and put 60.4 GiB of
# the optimizer there; a call at 4096 tokens, which that plan could not serve, measured 5.18 GiB
# of free memory and stopped with a PlanningError that asked for memory_budget="88.35GiB" and
# said no length fit at all, though 16 rows of 4096 tokens trained with the first plan. What
# other code allocates on the devices after the first plan is not seen: Config.memory_budget then.
def device_budget(config, budgets: Budgets) -> Optional[int]:
    """Each device's budget for a plan: Config.memory_budget, the model's measured one, or 0.9 of
    the devices' free memory now (None on CPU devices: unlimited)."""
    if config.memory_budget is not None:
        return config.memory_budget
    if budgets.device is not None:
        return budgets.device
    return free_memory_budget(config)


def free_memory_budget(config) -> Optional[int]:
    if config.on_gpu:
        free = min(torch.cuda.mem_get_info(d)[0] for d in config.devices)
        return int(free * 0.9)
    return None
