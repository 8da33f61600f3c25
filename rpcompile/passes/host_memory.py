"""The host memory a step of a plan needs, by kind (what `cm.plan` prints), and the layout of
the host buffers the runtime allocates for it, so that what is planned is what is allocated.

Per parameter: the master (the user's tensor), the optimizer's state (AdamW: two fp32
moments; the optimizer is not known at compile time, so AdamW is assumed and said), the
working copies the devices upload from (pinned, in the compute dtype, on GPUs; two of them in
delayed mode), and the host gradient buffers (GradLayout: each backward job's gradients in one
flat piece; one set in every mode, Note [one gradient set] in runtime/grads.py; bf16 where
the devices work in bf16 and the attached optimizer reads them, else fp32, Note
[working-dtype gradients]). In
exact mode `param.grad` is the user's tensor besides. Per
step: what the jobs write to the host (`host_values`: the forward jobs' activations and
checkpoints, the others' gradients of activations), per microbatch times the microbatches, for
each step alive at once (two in delayed mode, where a step runs beside the last one's backward
jobs: Note [overlapped steps] in runtime/modes.py; each has its slots, Note [slot sets] in
runtime/shared.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from .partition import PlanningError


ADAMW_STATE_BYTES = 8      # exp_avg and exp_avg_sq in fp32, per trainable parameter
GRAD_ITEMSIZE = 4          # fp32 host gradients (they accumulate in fp32 on the devices)


def host_grad_dtype(working_dtype, optimizer_reads: bool) -> torch.dtype:
    """The dtype of the host gradient set, for the plan and the runner alike (Note
    [working-dtype gradients]): bf16 where the devices work in bf16 and the attached optimizer
    reads the set, else fp32."""
    return torch.bfloat16 if optimizer_reads and working_dtype == torch.bfloat16 else torch.float32


def planned_grad_dtype(captured, compute_dtype, optimizer_mode: str) -> torch.dtype:
    """host_grad_dtype as a plan counts it: the working dtype is the compute dtype where the graphs
    were captured on copies in it (runner.working_dtype), and the optimizer reads the set outside
    exact mode."""
    return host_grad_dtype(compute_dtype if getattr(captured, "on_copies", False) else None,
                           optimizer_mode != "exact")


@dataclass
class GradLayout:
    """Where the parameter gradients of a step lie in one flat fp32 host buffer.

    Each stage that makes parameter gradients owns the contiguous piece `stages[s]` =
    (start, stop), so its job downloads them with one copy; inside it, `keys[s]` lists
    (key, offset, shape) (key: a parameter index, or (index, first row, end row) for rows of
    it), in `stage.grad_params` order except that the row pieces of a parameter that has only
    row pieces, all of them in this stage, lie one after the other in row order: they are its
    whole gradient, in place (`whole_rows` maps its index to (offset, shape)). Any other parameter
    whose gradient comes in row pieces only (a vocabulary-split head that is not tied, its
    shards in several stages) is summed into a buffer of its own: `row_sums` maps its index to
    its shape. (A tied weight's rows are added into its whole gradient.)
    """

    stages: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)
    row_sums: dict = field(default_factory=dict)
    whole_rows: dict = field(default_factory=dict)
    numel: int = 0

    @property
    def signature(self) -> tuple:
        """What identifies the layout: plans with equal signatures can share buffers."""
        return tuple((s, tuple((k, off, tuple(shape)) for k, off, shape in keys)) for s, keys in self.keys.items())

    def nbytes(self, sets: int = 1, itemsize: int = GRAD_ITEMSIZE) -> int:
        """Bytes of `sets` flat buffers of `itemsize` bytes an element and the row-sum buffers
        (fp32, shared by the sets)."""
        rows = sum(math.prod(shape) for shape in self.row_sums.values())
        return itemsize * sets * self.numel + GRAD_ITEMSIZE * rows


def _rows_in_place(params, stages) -> set:
    """Parameters with row gradients only, all in one stage and tiling their rows exactly."""
    rows: dict = {}            # index -> [(stage, start, stop)]
    whole = set()
    for st in stages:
        for key in getattr(st, "grad_params", []):
            if isinstance(key, tuple):
                rows.setdefault(key[0], []).append((st.index, key[1], key[2]))
            else:
                whole.add(key)
    out = set()
    for i, parts in rows.items():
        if i in whole or len({s for s, _, _ in parts}) != 1:
            continue
        spans = sorted((a, b) for _, a, b in parts)
        if spans[0][0] == 0 and spans[-1][1] == params[i].shape[0] and \
                all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:])):
            out.add(i)
    return out


def grad_layout(plan) -> GradLayout:
    params = plan.captured.params
    layout = GradLayout()
    whole = set()
    rows_only = set()
    in_place = _rows_in_place(params, plan.stages)
    for st in plan.stages:
        keys = list(getattr(st, "grad_params", []))
        if not keys:
            continue
        # an in-place parameter's row pieces together, in row order, where its first one was
        ordered, done = [], set()
        for key in keys:
            if isinstance(key, tuple) and key[0] in in_place:
                if key[0] not in done:
                    done.add(key[0])
                    ordered += sorted((k for k in keys if isinstance(k, tuple) and k[0] == key[0]),
                                      key=lambda k: k[1])
            else:
                ordered.append(key)
        start = layout.numel
        placed = []
        for key in ordered:
            if isinstance(key, tuple):
                i, a, b = key
                shape = (b - a, *params[i].shape[1:])
                rows_only.add(i)
                if i in in_place and a == 0:
                    layout.whole_rows[i] = (layout.numel, tuple(params[i].shape))
            else:
                shape = tuple(params[key].shape)
                whole.add(key)
            placed.append((key, layout.numel, shape))
            layout.numel += math.prod(shape)
        layout.stages[st.index] = (start, layout.numel)
        layout.keys[st.index] = placed
    layout.row_sums = {i: tuple(params[i].shape) for i in sorted(rows_only - whole - in_place)}
    return layout


def _flat_numels(params) -> list:
    """Sizes of the parameters the flat optimizer moves into its buffers (FlatMasters.flatten)."""
    return [p.numel() for p in params if p.requires_grad and p.is_floating_point() and p.numel() > 1]


def device_optimizer_bytes(params, share: float, num_devices: int) -> int:
    """Bytes each device keeps for the optimizer's share on the devices (Note [optimizer state on
    the devices] in runtime/flat.py): the fp32 masters and AdamW's two moments of about share /
    num_devices of the flat parameters (whole parameters: one more of the largest), a gradient
    slice being widened, and beside it the bf16 cast of a slice of working copies coming down
    (Note [chunks within a piece] in runtime/submission.py)."""
    if not share:
        return 0
    from ..runtime.flat import FlatMasters, FlatStepper
    flat = _flat_numels(params)
    if not flat:
        return 0
    # (devices differ by at most a block: Note [optimizer state on the devices])
    per_device = math.ceil(share * sum(flat) / max(1, num_devices)) + min(sum(flat), FlatMasters.BLOCK + max(flat))
    return per_device * (GRAD_ITEMSIZE + ADAMW_STATE_BYTES) + min(FlatStepper.WIDEN, per_device) * (2 + GRAD_ITEMSIZE + 2)


# Note [optimizer share by room]: the optimizer on the devices (Config.optimizer_on_devices) made
# delayed mode faster where the host's update was what steps waited for, and took its state off
# the host: Qwen3-1.7B on 4 H200s 111,914 tokens/s against 96,975 with every update on the host,
# host memory 33.8 against 50.0 GiB; Llama-3.1-8B 30,562 against 30,420, 119.0 against 175.9 GiB
# (benchmarks/RESULTS.md, twenty-sixth session). Where the devices have the room, there is no
# reason to leave it on the host; where they have not, the jobs need it. So by default
# (optimizer_on_devices=None) the first plan on GPUs chooses the share: solved with nothing
# reserved, it gives the optimizer at most ROOM_SHARE of what its largest job leaves of the budget
# (the rest stays for prefetching weights and for what the estimates miss), in 64ths, never a
# share too small to outweigh the block a device may hold beyond it (a 24 GiB card would give
# 6 GiB for 0.2 GiB of Qwen3-1.7B's state), and plans the resident weights beside what is left.
# Later plans reserve that share; one that does not fit beside it (a longer sequence) is made
# without it, and the state goes back to the host first (CompiledModel._compile,
# FlatStepper.bring_home), so a length that trains with every update on the host trains by
# default too. Where the host's update of what is left would set the pace, a larger share may
# take the jobs' room instead (Note [optimizer share by pace]).
ROOM_SHARE = 0.5


def share_by_room(params, num_devices: int, room: int) -> float:
    """The largest share, in 64ths, whose device bytes (device_optimizer_bytes) fit in
    ROOM_SHARE of `room`, the bytes each device has beside its largest job; 0 if none. A share
    whose part of a device is smaller than the block and parameter a device may hold beyond it
    (what device_optimizer_bytes adds) is not taken: it would reserve more than it moves."""
    flat = _flat_numels(params)
    if not flat:
        return 0.0
    fits = [n for n in range(1, 65) if _outweighs_the_block(flat, n / 64, num_devices)
            and device_optimizer_bytes(params, n / 64, num_devices) <= ROOM_SHARE * room]
    return fits[-1] / 64 if fits else 0.0


def _outweighs_the_block(flat: list, share: float, num_devices: int) -> bool:
    """Whether a share's part of a device (of the flat sizes `flat`) is at least the block and
    parameter a device may hold beyond it (what device_optimizer_bytes adds): a smaller one
    would reserve more than it moves."""
    from ..runtime.flat import FlatMasters
    return share * sum(flat) / num_devices >= FlatMasters.BLOCK + max(flat)


# Note [optimizer share by pace]: in delayed mode the optimizer steps beside the next train step,
# so a step takes the longer of the two. Where the jobs fill the devices the room leaves no share,
# and a host update slower than the jobs sets the pace. Measured (2 H200s, 32 cores,
# Llama-3.1-8B at a 4-GPU run's load per GPU: 32,768 tokens, M=2, replicas): with no share (the
# room's) the optimizer took 2.95 s a step beside 1.44 s of jobs (estimated; busy 48%), 10,828
# tokens/s; with a share of 0.5 set, the jobs re-cut beside it (estimated 1.51 s), 1.90 s and
# 16,284 tokens/s, busy 96-99%. So where the host's update would be clearly the longer (more
# than PACE_MARGIN times the jobs) the plan puts the whole update on the devices, the jobs re-cut
# beside what it reserves, where that step, the longer of its jobs and its update
# (`optimizer_seconds`), is the shorter; only where the whole does not fit beside the jobs does
# it weigh the smallest share whose update keeps up with the jobs (`pace_shares`). A share
# between leaves a part of every chunk to the host and measured slower than the whole though
# its jobs are estimated as fast (same workload, one run each, 43rd session): the share of 0.73
# that this rule first chose (jobs 1.54 s, update 1.44 s estimated) 14,811 and 14,790 tokens/s,
# steps 2.16 s, busy 74-76%; 0.5 15,652; the whole (jobs 1.57 s) 18,073 and 18,185, steps
# 1.73-1.75 s, busy 94-97%, host peak 87.3 against 104.3 GiB. The margin: the 2-GPU bar's
# workload of that model (65,536 tokens, M=4) is estimated at 2.74 s of jobs and 2.97 s of
# update and measured at 2.85 s of each (busy 98%, 21,566 tokens/s): too close for these figures
# to re-cut by. The seconds an element costs, from the runs above: on the host 2.95 s / 8.03e9
# elements (widening its bf16 gradient, the fused AdamW, the working copy's refresh: ~40 B of
# memory traffic); stepped on a device, as the optimizer's thread sees it (the gradient up, the
# masters and working copy down), (1.90 - 2.95 / 2) / (8.03e9 / 2), as the whole's 0.88 s a step
# (its thread's stepping and refreshing) gives too. A host with more memory bandwidth does
# better; the choice only needs which of the two sets the pace. Planned here for 125.3 GiB H200s
# (CPU-made plans: benchmarks/runs/share_by_pace/h200_plans.py), Llama-3.1-8B at 4 GPUs (65,536
# tokens, M=4) takes the whole beside 4 replicas, where the room gave none (update 2.97 s);
# Qwen3-1.7B's plans and the other Llama ones are unchanged.
HOST_UPDATE_S = 0.37e-9
DEVICE_UPDATE_S = 0.11e-9
PACE_MARGIN = 1.25


def optimizer_seconds(params, share: float) -> float:
    """Estimated seconds of one optimizer update of the flat parameters, `share` of them
    stepped on the devices (Note [optimizer share by pace])."""
    return sum(_flat_numels(params)) * ((1 - share) * HOST_UPDATE_S + share * DEVICE_UPDATE_S)


def pace_shares(params, num_devices: int, jobs_s: float, least: float) -> list:
    """Shares (in 64ths, above `least`) to weigh, in this order, where the host's update would set
    the pace (take more than PACE_MARGIN times `jobs_s`): all of it, then the smallest whose update
    takes at most `jobs_s` (Note [optimizer share by pace]); none where a share's part of a device
    would be smaller than what a device may hold beyond it (as share_by_room)."""
    flat = _flat_numels(params)
    if not flat or optimizer_seconds(params, least) <= PACE_MARGIN * jobs_s:
        return []
    keeps_up = next((n / 64 for n in range(1, 65) if optimizer_seconds(params, n / 64) <= jobs_s), 1.0)
    return [s for s in sorted({keeps_up, 1.0}, reverse=True) if s > least and _outweighs_the_block(flat, s, num_devices)]


@dataclass
class HostMemory:
    masters: int
    grads: int                 # one set of host gradient buffers (GradLayout)
    optimizer_state: int
    working_copies: int
    activations: int
    num_params: int
    param_grads: int = 0       # exact mode: `param.grad`, which the user holds
    carried_rows: int = 0      # delayed mode: gradient rows copied out of their piece (runtime/submission.py)
    widened: int = 0           # bf16 gradients: the fp32 buffer the optimizer widens a slice into
    grad_layout: GradLayout = field(default_factory=GradLayout, repr=False)
    grad_dtype: torch.dtype = torch.float32   # of the host gradient set (host_grad_dtype)
    device_optimizer: int = 0  # per device: masters and state of the optimizer's share there (not host memory)
    device_share: float = 0.0  # that share (Config.optimizer_on_devices, or the plan's choice)

    steps_alive: int = 1       # steps whose activations are on the host at once
    budget: Optional[int] = None   # the host budget the plan was made within (Note [host room]), or None

    @property
    def grad_itemsize(self) -> int:
        return self.grad_dtype.itemsize

    @property
    def grad_label(self) -> str:
        """The set's dtype as the plan prints it."""
        return "bf16" if self.grad_dtype == torch.bfloat16 else "fp32"

    @property
    def total(self) -> int:
        return (self.masters + self.param_grads + self.grads + self.carried_rows + self.widened
                + self.optimizer_state + self.working_copies + self.activations)

    def rows(self) -> list:
        return [("master weights", self.masters), ("param.grad (exact mode)", self.param_grads),
                ("gradients", self.grads), ("gradient rows carried to a later chunk", self.carried_rows),
                ("gradient slices widened for the optimizer", self.widened),
                ("optimizer state (AdamW assumed)", self.optimizer_state),
                ("working copies for upload", self.working_copies),
                (f"activations and checkpoints ({self.steps_alive} step{'s' if self.steps_alive > 1 else ''})",
                 self.activations)]

    def summary(self) -> str:
        from ..plan import _fmt_bytes
        per = self.total / max(1, self.num_params)
        parts = ", ".join(f"{name} {_fmt_bytes(b)}" for name, b in self.rows() if b)
        within = f" within a host budget of {_fmt_bytes(self.budget)}" if self.budget is not None else ""
        out = f"host memory {_fmt_bytes(self.total)} ({per:.1f} B/param){within}: {parts}"
        if self.device_optimizer:
            out += (f"; on each device besides the jobs, {_fmt_bytes(self.device_optimizer)} of fp32 masters and "
                    f"optimizer state (Config.optimizer_on_devices: a share of {self.device_share:g})")
        return out


def host_values(st) -> list:
    """What a job writes to host memory per microbatch: a forward job's outputs (activations
    and checkpoints), a fused or backward job's gradients of activations and inputs (its
    grad_inputs, which hold no weight rows: passes/codegen.py)."""
    if st.kind == "fwd":
        return list(st.outputs)
    return list(getattr(st, "grad_inputs", []))


def host_activations(plan, steps_alive: int, bindings=None) -> int:
    """Bytes the jobs of `steps_alive` steps of the plan write to the host (host_values), at the
    plan's sizes or at `bindings` (a call at other sizes the plan serves: plan_cache.py)."""
    by_name = {n.name: n for n in plan.gm.graph.nodes}
    at = None if bindings is None else {**plan.bindings, **bindings}
    per_micro = sum(plan.value_bytes(by_name.get(name), at) for st in plan.stages for name in host_values(st))
    return int(per_micro) * plan.num_microbatches * steps_alive


def host_bytes_at(plan, optimizer_mode: str, bindings: dict) -> int:
    """checked_bytes of the plan's host memory at `bindings` (a later call's sizes): its buffers
    as planned, its activations as they are there (Note [host room])."""
    hm = plan.host_memory
    return checked_bytes(hm, optimizer_mode) - hm.activations + host_activations(plan, hm.steps_alive, bindings)


def per_parameter(params, compute_dtype, on_gpu: bool, optimizer_mode: str, workers: str, on_devices: float,
                   grad_dtype: torch.dtype, num_devices: int) -> HostMemory:
    """What a plan's host memory holds per parameter, whatever its stage cut: everything but
    the activations and the carried rows, the gradient set as the trainable parameters' whole
    gradients (GradLayout's pieces tile them; host_memory puts its layout's bytes in)."""
    trainable = [p for p in params if p.requires_grad]
    masters = sum(p.numel() * p.element_size() for p in params)
    # the optimizer's share on the devices keeps its state there (about: whole parameters)
    state = round(sum(p.numel() for p in trainable) * (1 - on_devices)) * ADAMW_STATE_BYTES
    from ..runtime.weights import own_copy
    copies = 0
    # working copies: what GPUs upload from, what delayed mode's steps read, and what worker
    # processes read (shared memory) where CPU worker threads would read the parameters
    # (a frozen parameter in its working dtype is its own, in shared memory for worker processes:
    # Note [frozen weights in place])
    if on_gpu or optimizer_mode == "delayed" or workers == "processes":
        for p in params:
            if own_copy(p, compute_dtype):
                continue
            itemsize = (compute_dtype or p.dtype).itemsize if p.is_floating_point() else p.element_size()
            copies += p.numel() * itemsize * (2 if optimizer_mode == "delayed" and p.requires_grad else 1)
    itemsize = grad_dtype.itemsize
    param_grads = sum(p.numel() * p.element_size() for p in trainable) if optimizer_mode == "exact" else 0
    from ..runtime.flat import FlatStepper
    flat = sum(_flat_numels(trainable))
    widened = 0
    if itemsize < GRAD_ITEMSIZE and on_devices < 1:   # runtime/flat.py: FlatStepper widens a slice of the flat masters
        widened = GRAD_ITEMSIZE * min(FlatStepper.WIDEN, flat)
    return HostMemory(masters, itemsize * sum(p.numel() for p in trainable), state, copies, 0,
                      sum(p.numel() for p in params), param_grads=param_grads, widened=widened,
                      steps_alive=2 if optimizer_mode == "delayed" else 1, grad_dtype=grad_dtype,
                      device_optimizer=device_optimizer_bytes(params, on_devices, num_devices),
                      device_share=on_devices)


def host_memory(plan, compute_dtype, on_gpu: bool, optimizer_mode: str, workers: str = "threads",
                on_devices: float = 0.0, budget=None) -> HostMemory:
    params = plan.captured.params
    # runner.working_dtype: graphs the dynamo backend captured on real tensors run as they are
    grad_dtype = planned_grad_dtype(plan.captured, compute_dtype, optimizer_mode)
    out = per_parameter(params, compute_dtype, on_gpu, optimizer_mode, workers, on_devices, grad_dtype,
                         plan.num_devices)
    layout = out.grad_layout = grad_layout(plan)
    out.grads = layout.nbytes(1, grad_dtype.itemsize)
    out.activations = host_activations(plan, out.steps_alive)
    if optimizer_mode == "delayed":
        from ..runtime.submission import carried_rows
        out.carried_rows = grad_dtype.itemsize * sum(math.prod(shape) for shape in carried_rows(plan, layout).values())
    out.budget = budget
    return out


# Note [host room]: a plan whose host memory is more than the host has is killed by the
# system part-way through its first step (pinned memory cannot be paged out): Llama-3.1-8B in
# delayed mode on one H200 plans 134.9 GiB (18.0 B/param; 142.1 GiB measured at its peak), and
# the one-GPU machines lent here have 125.8 GiB. So the model's first train plan (the one that
# allocates the host buffers; later plans share them) is made within a host budget
# (Config.host_memory_budget; by default what the host has available then, the system's or its
# cgroup's, plus what the parameters already hold, less HOST_MARGIN and HOST_SHARE of the host's
# memory for what the process allocates besides and what the system needs: the Llama run above
# peaked 7.2 GiB above its plan, and one planned to 8 GiB below the 125.8 GiB host's available
# memory reached 117 GiB in its first step, where the benchmarks stop a run). Where the plan
# chooses the optimizer's share on the devices, the share is at least the smallest, in 64ths,
# whose host memory fits (least_host_share: each parameter stepped on a device holds its 8 bytes
# of AdamW state there, not on the host), the jobs cut again beside it where they do not fit (as
# for a share by pace). Where that cannot fit (a share fixed by the config, or exact mode; not
# even the whole's state; no room on the devices beside the jobs) the plan stops with a
# HostMemoryError (a PlanningError) that says what the plan needs, what the host has, and what
# to change, before a buffer is allocated. In exact mode the optimizer's state is the user's
# optimizer's, which rpcompile does not allocate: it is warned of, not counted. A later plan
# that does not fit beside a share the host needed (a longer sequence) stops with its
# PlanningError instead of bringing the state home (CompiledModel._compile).
# Later calls are held to the first train plan's budget: the buffers it sized are shared, but the
# activations and checkpoints a step leaves on the host grow with its tokens (the step sets grow
# to the largest step they served: Note [slot sets], runtime/shared.py). Planned on the CPU for one
# H200 within this host's 103.4 GiB, Llama-3.1-8B's first plan (32 rows of 2048 tokens) puts 4.0
# GiB of them there; the same rows at 4096 tokens 16.0 GiB (115.4 GiB in all), at 8192 88.0 GiB:
# the system would have killed the process at the first longer batch, hours into a run. So a
# plan serves other sizes only where its activations there fit (PlanCache._host_fits), a plan
# made for them is checked as the first (host_memory_pass, with Budgets.host_first: passes/
# budgets.py), and a call that fits neither stops with a HostMemoryError before it runs, saying
# the longest length at the call's rows whose activations fit as that plan cuts the model (a
# bisection over host_bytes_at); no share moves (the first plan fixed it).

# what the default host budget leaves of the host: HOST_MARGIN, and HOST_SHARE of its memory
HOST_MARGIN = 8 << 30
HOST_SHARE = 0.1


def host_memory_now(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> Optional[tuple]:
    """(bytes of host memory this process may still take, the bytes it may take in all): the
    system's MemAvailable and MemTotal, or less where a cgroup (v2 memory.max, or v1
    memory.limit_in_bytes) limits it (its limit, less what it uses, plus the page cache it may
    reclaim); None where neither can be read."""
    found = []
    try:
        with open(meminfo) as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("MemAvailable:", "MemTotal:"))}
        found.append((info["MemAvailable"], info["MemTotal"]))
    except (OSError, ValueError, IndexError, KeyError):
        pass
    for limit, usage, stat, cache in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                      ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                       "memory/memory.stat", "total_inactive_file")):
        try:
            with open(os.path.join(cgroup, limit)) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 1 << 60:      # (v1 writes "unlimited" as a page-rounded 2^63)
                continue
            with open(os.path.join(cgroup, usage)) as f:
                used = int(f.read())
            reclaimable = 0
            with open(os.path.join(cgroup, stat)) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == cache:
                        reclaimable = int(value)
            found.append((max(0, int(text) - used + reclaimable), int(text)))
        except (OSError, ValueError):
            continue
    return (min(a for a, _ in found), min(t for _, t in found)) if found else None


def held_host_bytes(params) -> int:
    """Host bytes the parameters hold already (the plan's masters, where they are on the host)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values() if p.device.type == "cpu")


def default_host_budget(params, copies: int = 0) -> Optional[int]:
    """Config.host_memory_budget's default (Note [host room]); `copies`: bytes of working copies
    the process holds now (a call's, before the first train step), which the plan's own figure
    stands for (Note [calls read the newest copies] in runtime/modes.py). None where the host's
    memory cannot be read."""
    now = host_memory_now()
    if now is None:
        return None
    free, total = now
    free += copies
    return free + held_host_bytes(params) - min(HOST_MARGIN + int(HOST_SHARE * total), free // 4)


def checked_bytes(hm: HostMemory, optimizer_mode: str) -> int:
    """What of a plan's host memory the budget holds it to: all of it, but the optimizer state
    in exact mode (the user's optimizer's, which rpcompile does not allocate)."""
    return hm.total - (hm.optimizer_state if optimizer_mode == "exact" else 0)


def least_host_share(at, optimizer_mode: str, budget: int) -> Optional[float]:
    """The smallest share of the optimizer on the devices, in 64ths, whose host memory before
    the stage cut (`at(share)`, a per_parameter HostMemory) fits `budget`; None if not even
    the whole's does."""
    return next((n / 64 for n in range(65) if checked_bytes(at(n / 64), optimizer_mode) <= budget), None)


class HostMemoryError(PlanningError):
    """The plan's host memory does not fit its host budget (Note [host room]); `needed` and
    `budget` are in bytes."""

    def __init__(self, message: str, needed: int, budget: int):
        super().__init__(message)
        self.needed, self.budget = needed, budget
        self.cut = None     # (passes/__init__.py: bytes the cut took, where planning again may fit)


def host_memory_error(hm: HostMemory, budgets, optimizer_mode: str, why: str) -> HostMemoryError:
    """The error of a plan whose host memory does not fit its budget (Note [host room]; budgets:
    the plan's passes/budgets.Budgets, a later plan's with the first train plan's HostMemory,
    whose sizes grew the activations)."""
    from ..plan import _fmt_bytes
    budget, given, host_only, first = budgets.host, budgets.host_given, budgets.host_only, budgets.host_first
    now = "at the model's first train step" if first is not None else "now"
    origin = ("Config.host_memory_budget" if given else
              f"what the host had available {now} with the parameters, less {_fmt_bytes(HOST_MARGIN)} and "
              f"{HOST_SHARE:.0%} of the host's memory (Config.host_memory_budget=None)")
    state = hm.optimizer_state if optimizer_mode != "exact" else 0
    fixes = []
    if first is not None:
        fixes.append("shorter sequences or fewer of them a step (the activations and checkpoints on the host grow "
                     "with the tokens a step)")
        fixes.append("the longest batch as the first train step of a new compiled model (its plan sizes the host's "
                     "buffers for it and, with optimizer_on_devices=None, moves what it must of the optimizer's state "
                     "to the GPUs)")
    if optimizer_mode == "exact":
        fixes.append("optimizer_mode='delayed' or 'overlapped' with cm.attach_optimizer(opt): rpcompile then steps "
                     "the optimizer and can keep its state (12 B a parameter for AdamW) on the GPUs")
    elif state and host_only and first is None:
        fixes.append(f"an optimizer the plan can step on the GPUs (torch.optim.AdamW, Adam or SGD; {host_only} "
                     "is stepped parameter by parameter on the host)")
    elif state and first is None:
        fixes.append("optimizer_on_devices=None (the plan moves what it must of the optimizer's state to the GPUs) "
                     "or 1.0, with more GPU memory for it (Config.memory_budget, more GPUs)")
    if optimizer_mode == "delayed":
        fixes.append(f"optimizer_mode='overlapped' (one working copy instead of two: "
                     f"{_fmt_bytes(hm.working_copies // 2)} less)")
    fixes.append("train fewer parameters (LoRA, frozen layers)")
    fixes.append("Config.host_memory_budget=... if more host memory is free than the system reports")
    needed = checked_bytes(hm, optimizer_mode)
    if optimizer_mode == "exact":      # (the user's optimizer's state: not counted)
        hm = dataclasses.replace(hm, optimizer_state=0)
    message = (f"rpcompile: the plan needs {_fmt_bytes(needed)} of host memory, {_fmt_bytes(needed - budget)} more "
               f"than the {_fmt_bytes(budget)} it may take ({origin}): {why}. Its {hm.summary()}. To fit, use "
               + "; or ".join(fixes) + ".")
    return HostMemoryError(message, needed, budget)
