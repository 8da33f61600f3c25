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

import math
from dataclasses import dataclass, field

import torch


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
        out = f"host memory {_fmt_bytes(self.total)} ({per:.1f} B/param): {parts}"
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


def host_memory(plan, compute_dtype, on_gpu: bool, optimizer_mode: str, workers: str = "threads",
                on_devices: float = 0.0) -> HostMemory:
    params = plan.captured.params
    trainable = [p for p in params if p.requires_grad]
    masters = sum(p.numel() * p.element_size() for p in params)
    # the optimizer's share on the devices keeps its state there (about: whole parameters)
    state = round(sum(p.numel() for p in trainable) * (1 - on_devices)) * ADAMW_STATE_BYTES
    copies = 0
    # working copies: what GPUs upload from, what delayed mode's steps read, and what worker
    # processes read (shared memory) where CPU worker threads would read the parameters
    if on_gpu or optimizer_mode == "delayed" or workers == "processes":
        for p in params:
            itemsize = (compute_dtype or p.dtype).itemsize if p.is_floating_point() else p.element_size()
            copies += p.numel() * itemsize * (2 if optimizer_mode == "delayed" and p.requires_grad else 1)
    layout = grad_layout(plan)
    # runner.working_dtype: graphs the dynamo backend captured on real tensors run as they are
    grad_dtype = planned_grad_dtype(plan.captured, compute_dtype, optimizer_mode)
    itemsize = grad_dtype.itemsize
    param_grads = sum(p.numel() * p.element_size() for p in trainable) if optimizer_mode == "exact" else 0
    by_name = {n.name: n for n in plan.gm.graph.nodes}
    per_micro = sum(plan.value_bytes(by_name.get(name)) for st in plan.stages for name in host_values(st))
    alive = 2 if optimizer_mode == "delayed" else 1
    carried = 0
    if optimizer_mode == "delayed":
        from ..runtime.submission import carried_rows
        carried = itemsize * sum(math.prod(shape) for shape in carried_rows(plan, layout).values())
    from ..runtime.flat import FlatStepper
    flat = sum(_flat_numels(trainable))
    widened = 0
    if itemsize < GRAD_ITEMSIZE and on_devices < 1:   # runtime/flat.py: FlatStepper widens a slice of the flat masters
        widened = GRAD_ITEMSIZE * min(FlatStepper.WIDEN, flat)
    return HostMemory(masters, layout.nbytes(1, itemsize), state, copies, int(per_micro) * plan.num_microbatches * alive,
                      sum(p.numel() for p in params), param_grads=param_grads, carried_rows=carried, widened=widened,
                      steps_alive=alive, grad_layout=layout, grad_dtype=grad_dtype,
                      device_optimizer=device_optimizer_bytes(params, on_devices, plan.num_devices),
                      device_share=on_devices)
