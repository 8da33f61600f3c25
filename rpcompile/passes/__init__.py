"""The compiler, in order: every pass rpcompile runs between capture and runtime.

`compile_graph` runs PASSES, one after another, each a function from a CompileState to a
CompileState; after each, the state's printable form is kept (`plan.passes`, and
`cm.dump(dir)` writes them as passes/00_capture.py, 01_keep_loss_output.py, ...), so a model
that fails is a diff between two files. Most texts are rendered when first read (Note [pass
text on demand]).

    capture              the dynamo graph, copied (capture.py ran before: meta/fake copies)
    keep_loss_output     train mode: the loss is the only output (passes/outputs.py)
    normalize_loss       mean cross-entropy -> token sum + counter (passes/normalize_loss.py)
    causal_attention     an SDPA mask proved causal from sizes alone -> is_causal=True (passes/causal_mask.py)
    split_lm_head        vocabulary shards with an online log-sum-exp (passes/lm_head.py)
    annotate_costs       FLOPs and bytes per node, sympy in the size symbols (passes/cost.py)
    find_batch           which inputs are split per microbatch; planning bindings (passes/batch.py)
    cut_points           liveness, legal cuts, segment costs (passes/cut_points.py)
    solve_stages         exact DP over forward / fused / backward stages (passes/partition.py),
                         a search under the replayed schedule where steps overlap (passes/step_model.py);
                         when none fits, the longest length that does (passes/longest.py)
    split_finer          the model's first train plan: more, smaller microbatches where the jobs then
                         recompute nothing (Note [finer microbatches])
    build_stages         forward and recompute+backward graphs per stage job (passes/codegen.py)
    build_programs       per-job programs of transfer, event and compute ops, transfers ordered
                         (activations, then weights, then the next job's prefetch) (passes/codegen.py)
    describe_io          splits, size symbol sources, outputs, row checks (passes/batch.py)
    host_memory          the host bytes a step needs, by kind (passes/host_memory.py)

On GPUs the runner then compiles each stage's compute with Inductor, one repeated block (decoder
layer) at a time (passes/regions.py).

Note [rp_* node meta]: facts passes leave on fx nodes, who writes and who reads them:

    key                   written by                  read by
    rp_kind, rp_index     capture                     every pass; codegen (what a stage reads)
    rp_name               capture                     codegen (fqn of params/buffers), plan text
    rp_leaf_name          capture                     batch (input names in errors and legends)
    rp_module_state       capture (dynamo backend)    batch (module attributes are never batched)
    rp_requires_grad      capture                     codegen (which inputs get gradients)
    rp_expr               capture                     describe_io (size symbol sources)
    rp_loss (gm.meta)     normalize_loss              compile_graph (the LossScale), runner
    rp_lm_head            lm_head                     plan text, cost, partition
    rp_lm_head_part       lm_head                     plan text, cut_points (the cut limit is the body's)
    rp_param_slice(_fqn)  lm_head, codegen            codegen (a stage uploads only its rows)
    rp_cost               annotate_costs              cut_points, partition, plan rows
    rp_size_estimates     annotate_costs (gm.meta)    tests (the estimates behind data-dependent sizes)
    rp_regions(_keys)     regions (gm.meta)           regions (repeated blocks compiled once)
    rp_shard_bound        lm_head (shards apart)      regions (the arg a shard piece takes as an input)
    rp_dynamic_int, _dims regions (piece inputs)      runtime.programs.length_inputs (marked dynamic)
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import CaptureError, InputError
from ..plan import Plan, _fmt_bytes
from .batch import attach_row_checks, check_rows_apart, check_splittable, find_batch, rows_in_blocks
from .budgets import Budgets, device_budget
from .causal_mask import causal_attention
from .codegen import build_program, build_stages, written_inputs
from .cost import Hardware, annotate_costs, exchange_seconds, graph_costs, graph_key, node_value, set_costs, storage_key
from .cut_points import buffer_spans, legal_cuts, liveness, placeholder_write_spans, segment_table
from .graph_utils import clone_graph_module, is_impure, output_values, scalar_outputs, symbol_hints
from .host_memory import (HostMemoryError, checked_bytes, device_optimizer_bytes, host_bytes_at,
                          host_memory, host_memory_error, least_host_share, optimizer_seconds, pace_shares,
                          per_parameter, planned_grad_dtype, share_by_room)
from .longest import planning_error
from .normalize_loss import check_loss_splits, flat_loss_output, normalize_loss, over_rows, reads_the_batch
from .outputs import keep_loss_output, loss_leaf_index
from .partition import PlanningError, solve_stages
from .resident import settle
from .uploads import plan_upload_wait

__all__ = ["compile_graph", "CompileState", "PASSES", "PlanningError"]


@dataclass
class CompileState:
    """What the passes hand each other; each pass fills in its fields."""

    captured: Any                      # capture.Captured
    config: Any                        # Config
    mode: str                          # "train" (loss only) or "call" (all outputs)
    loss_output: Optional[int] = None  # index of the loss among the graph outputs (None: no loss)
    at: Optional[dict] = None          # symbol name -> size to plan at (None: the capture's sizes)
    num_microbatches: Optional[int] = None   # the batch is split into this many (None: the config's)
    split_finer: bool = False          # this plan may split finer (Note [finer microbatches])
    loss_output_arg: Optional[int] = None   # loss_output as compile_graph was given it (passes/longest.py re-runs passes)
    gm: Optional[fx.GraphModule] = None
    loss_scale: Any = None             # normalize_loss.LossScale
    lm_head: Any = None
    batch: Any = None                  # batch.BatchInfo
    bindings: dict = field(default_factory=dict)
    hardware: Any = None
    liveness: Any = None
    cuts: list = field(default_factory=list)
    block_cuts: Any = None             # (cuts, segments, cut_bytes) without cuts inside repeated blocks
    segments: Any = None
    cut_bytes: Any = None
    budget: Optional[int] = None
    # the optimizer's share on the devices: Config.optimizer_on_devices or what an earlier plan
    # chose; None: solve_stages chooses it (Note [optimizer share by room] in passes/host_memory.py)
    on_devices: Optional[float] = None
    reserved: int = 0                  # bytes of each device the optimizer keeps (that share)
    optimizer_s: Optional[float] = None  # the update's estimated seconds a step, where the plan chose the share
    mutated_buffers: list = field(default_factory=list)   # buffer indices the graph updates in place
    steps_overlap: bool = False        # the runtime lets train steps overlap (Plan.steps_overlap)
    early_first_upload: bool = False   # delayed mode uploads the next step's first job at the loss (Plan.early_first_upload)
    prefetch_bytes: tuple = ()         # per job, the most bytes of the next job's weights it prefetches (Plan.prefetch_bytes)
    stage_plan: Any = None             # partition.StagePlan
    replicas: int = 1                  # copies of the stage plan, one per device (Note [replicas])
    stages: list = field(default_factory=list)
    plan: Optional[Plan] = None
    on_devices_arg: Optional[float] = None   # on_devices as compile_graph was given it (split_finer solves again)
    finer: list = field(default_factory=list)   # (microbatches, estimated pace, recomputes) of each count weighed
    budgets: Budgets = field(default_factory=Budgets)   # each device's and the host's (passes/budgets.py)
    host_cut: int = 0                  # host bytes an earlier try's cut took (activations, carried rows)
    chooses_share: bool = False        # solve_stages chose the optimizer's share (on_devices was None)
    host_share: float = 0.0            # the least share of the optimizer on the devices the host budget needs

    def __post_init__(self):
        if self.num_microbatches is None:
            self.num_microbatches = self.config.num_microbatches


# Note [cuts between blocks]: Inductor compiles a stage's compute one repeated block (decoder
# layer) at a time, and identical blocks share one compiled piece (passes/regions.py). A stage
# boundary inside a layer makes two partial layers, each a piece of its own, compiled for every
# device the stage job rotates onto: most of the distinct pieces of a pipelined plan, and of the
# first steps' compile time. So where the stages are compiled, the plan whose cuts all fall
# between blocks is taken when its estimated step is at most BLOCK_CUT_SLACK slower than the
# best plan (Qwen3-1.7B shape, cost model: 1.2% slower at 4 GPUs, 2.7-3.6% at 1-2 GPUs with a
# 70 GiB budget, where the finer plan is kept).
BLOCK_CUT_SLACK = 0.02

def capture(st: CompileState) -> CompileState:
    """A private copy of the captured graph; the loss output located in it."""
    cap = st.captured
    st.gm = clone_graph_module(cap.gm)
    written = [n.meta.get("rp_leaf_name") or n.name for n in written_inputs(st.gm)] if cap.on_copies else []
    if written:     # Note [inputs written in place] (codegen.py)
        which = ", ".join(written)
        warnings.warn(f"rpcompile: the model's forward writes into its argument{'s' * (len(written) > 1)} {which} in "
                      f"place: rpcompile computes with a copy (the loss and gradients are eager's) and leaves your "
                      f"tensor as you passed it, where eager PyTorch changes it. If code after the call reads "
                      f"{which}, compute the new value outside the model or return it from forward")
    if st.loss_output is None:
        loss = loss_leaf_index(cap.out_spec, len(cap.out_leaves)) if cap.out_spec is not None else None
        if loss is not None:
            kind, idx = cap.out_leaves[loss]
            st.loss_output = idx if kind == "out" else None
    if st.loss_output is None:     # no output structure: a dynamo backend's flat outputs
        st.loss_output = flat_loss_output(st.gm)
    return st


def keep_loss_output_pass(st: CompileState) -> CompileState:
    if st.mode == "train":
        if st.loss_output is None:
            st.loss_output = _single_scalar_output(st.gm)
        loss = output_values(st.gm.graph)[st.loss_output]
        value = node_value(loss)
        if isinstance(value, torch.Tensor) and not value.requires_grad:
            # (as eager's backward refuses it; the plan had no loss output: a KeyError at the step)
            raise InputError("train_step: the loss does not depend on any parameter that requires grad (every "
                             "parameter frozen, or a peft model's adapters disabled), so there is nothing to "
                             "train; unfreeze what should train, or evaluate with cm(...) under torch.no_grad()")
        st.gm = keep_loss_output(st.gm, st.loss_output)
        st.loss_output = 0
    return st


def normalize_loss_pass(st: CompileState) -> CompileState:
    if st.loss_output is not None:
        st.gm = normalize_loss(st.gm, st.loss_output)
        st.loss_scale = st.gm.meta["rp_loss"]
    return st


def causal_attention_pass(st: CompileState) -> CompileState:
    st.gm = causal_attention(st.gm)
    return st


def split_lm_head_pass(st: CompileState) -> CompileState:
    if st.mode == "train" and st.config.lm_head_shards != 0:
        from .lm_head import split_lm_head
        jobs = jobs_budget(st.captured.params, st.on_devices, st.budgets.device, len(st.config.devices))[2]
        st.gm = split_lm_head(st.gm, num_shards=st.config.lm_head_shards,
                              max_logit_bytes=max_logit_bytes(st.config, jobs), at=_lengths_at(st))
        st.lm_head = st.gm.meta.get("rp_lm_head")
    return st


def _lengths_at(st: CompileState) -> Optional[dict]:
    """The sequence-length symbols of a re-plan's sizes (st.at), for the LM head's shard count:
    a plan at a new length splits the head as a capture at that length would (Note [shards by
    memory] in passes/lm_head.py; the 32,768-token plan of Llama-3.1-8B kept the 3 shards of its
    8,192-token capture, 5.2 GiB of fp32 logits each, and failed at 65,536 tokens under 24 GiB).
    st.at's batch symbols are rows per microbatch, not the captured batch max_logit_bytes counts,
    so they are left at the capture's."""
    if not st.at:
        return None
    from ..lengths import length_symbols, tensor_inputs
    first = next(iter(tensor_inputs(st.gm)), None)
    rows = first.meta["example_value"].shape[0] if first is not None and first.meta["example_value"].dim() else None
    batch_names = {rows.node.expr.name} if isinstance(rows, torch.SymInt) and rows.node.expr.is_Symbol else set()
    L, names = length_symbols(st.gm, st.at, batch_names)
    return dict.fromkeys(names, L) if names else None


def jobs_budget(params, share, budget: Optional[int], num_devices: int) -> tuple:
    """(each device's budget, `budget` (CompileState.budgets.device: Note [device budget
    measured once] in passes/budgets.py), or None, the bytes of it each device keeps for the
    optimizer's share on the devices (Note [optimizer state on the devices] in runtime/flat.py;
    None: not chosen yet, nothing), what is left for the stage jobs or None)."""
    if budget is None:
        return None, 0, None
    reserved = device_optimizer_bytes(params, share, num_devices) if share else 0
    return budget, reserved, max(0, budget - reserved)


def max_logit_bytes(config, jobs_budget):
    """The most fp32 logits of the whole captured batch one LM-head shard may make: a
    microbatch's share at most the stage jobs' memory budget / SHARD_SHARE (Note [shards by
    memory] in passes/lm_head.py); None without a budget."""
    from .lm_head import SHARD_SHARE
    return None if jobs_budget is None else jobs_budget * config.num_microbatches / SHARD_SHARE


def annotate_costs_pass(st: CompileState) -> CompileState:
    kept = getattr(st.captured, "costs", None)   # Note [costs per capture] (passes/cost.py)
    key = graph_key(st.gm) if kept is not None else None
    if key is not None and key in kept:
        st.gm = set_costs(st.gm, kept[key])
    else:
        st.gm = annotate_costs(st.gm, getattr(st.captured, "node_costs", None))
        if key is not None:
            kept[key] = graph_costs(st.gm)
    return st


def find_batch_pass(st: CompileState) -> CompileState:
    st.batch = find_batch(st.gm, st.captured.batch_size, st.config.unbatched_inputs)
    check_splittable(st.batch, st.num_microbatches)
    check_rows_apart(st.gm, st.batch, st.num_microbatches)
    check_loss_splits(st.loss_scale, st.batch, st.num_microbatches)
    st.bindings = _bindings(st.gm, st.batch, _planned_microbatch(st.batch, st.num_microbatches))
    if st.at:   # re-planned for another size of the same capture (Note [plans per length])
        st.bindings.update({name: v for name, v in st.at.items() if name in st.bindings})
    return st


def cut_points(st: CompileState) -> CompileState:
    st.hardware = Hardware.of(st.config)
    st.liveness = liveness(st.gm)
    st.cuts = legal_cuts(st.gm, st.liveness, st.bindings)
    st.segments, st.cut_bytes = segment_table(st.gm, st.liveness, st.cuts, st.bindings, st.hardware)
    if _stages_compiled(st.config):   # Note [cuts between blocks]: the alternative without cuts inside layers
        cuts = legal_cuts(st.gm, st.liveness, st.bindings, within_blocks=False)
        if cuts != st.cuts:
            st.block_cuts = (cuts, *segment_table(st.gm, st.liveness, cuts, st.bindings, st.hardware))
    return st


def _stages_compiled(config) -> bool:
    """Whether the runner compiles the stages with Inductor (runtime.programs.ProgramCache.use_inductor)."""
    return bool(config.on_gpu if config.compile_stages is None else config.compile_stages)


def solve_stages_pass(st: CompileState) -> CompileState:
    config = st.config
    # what the optimizer keeps on each device is not the jobs' (Note [optimizer state on the devices])
    budget_set, st.reserved, st.budget = jobs_budget(st.captured.params, st.on_devices, st.budgets.device,
                                                     len(config.devices))
    st.mutated_buffers = _mutated_buffers(st.gm)
    st.steps_overlap = _steps_overlap(st)
    N = len(config.devices)
    cut = (st.cuts, st.segments, st.cut_bytes)
    chooses = st.chooses_share = st.on_devices is None and _share_by_room_applies(st) and st.budget is not None
    least = st.host_share = _least_host_share(st, chooses)
    (st.stage_plan, st.cuts, st.segments, st.cut_bytes), st.replicas = _stage_plan(st, budget_set)
    if st.on_devices is None:
        st.on_devices = 0.0
        if chooses:
            _choose_share(st, budget_set, cut, least)
    # what is resident beside each job (Note [resident weights]); a replica's jobs all run on its device
    st.stage_plan, st.prefetch_bytes, st.early_first_upload = settle(
        st.stage_plan, st.segments, st.budget, 1 if st.replicas > 1 else N,
        may_upload_early=config.optimizer_mode == "delayed" and st.mode == "train")
    return st


def _with_spans(st: CompileState, e: PlanningError) -> PlanningError:
    """e, saying which buffers updated in place (Note [a buffer updated in place stays in one
    stage]) and which call inputs written in place (Note [inputs written in place], codegen.py)
    hold a stretch of the graph in one stage, where one spans more than a few nodes."""
    L = len(st.liveness.body)
    names = st.captured.buffer_names
    buffers = [(names[i], span) for i, span in sorted(buffer_spans(st.liveness).items())]
    inputs = [(n.meta.get("rp_leaf_name") or n.name, (min(q for q, _ in spans), max(r for _, r in spans)))
              for n, spans in placeholder_write_spans(st.liveness).items() if n.meta.get("rp_kind") == "input"]
    told = [
        (buffers, "{} (nodes {} to {} of {})",
         "The model updates buffers in place and reads them far from the update: {}. A stage holds such a buffer's "
         "update with every read of it (its value changes microbatch after microbatch), so no stage may end in "
         "between; reading it only near its update (or passing the value as an input) lets the plan cut there."),
        (inputs, "{} (written at node {}, read up to node {} of {})",
         "The model writes into its arguments in place and reads them far from the write: {}. A stage writes a copy "
         "of such an argument, and every read after the write is in that stage, so no stage may end in between; "
         "computing the new value as a new tensor (x = x * 2, not x.mul_(2)) lets the plan cut there.")]
    parts = []
    for spans, each, text in told:
        wide = [each.format(name, a, b, L) for name, (a, b) in spans if b - a > max(8, L // 20)]
        if wide:
            parts.append(text.format(", ".join(wide)))
    if not parts:
        return e
    message = " ".join([str(e), *parts])
    return PlanningError(message, min_budget=e.min_budget, stage=e.stage, max_length=e.max_length)


def _stage_plan(st: CompileState, budget_set, explain: bool = True) -> tuple:
    """((stage plan, cuts, segments, cut bytes), replicas): the faster of the pipeline over the
    devices and a copy of the one-device plan on each (Note [replicas]), under st.budget. Where
    nothing fits, the PlanningError says the longest length that does (`explain`; a search)."""
    config, hw = st.config, st.hardware
    N, M = len(config.devices), st.num_microbatches
    replicas = _replicas(st, N, M)

    def failed(e):   # with the longest length that fits (Note [longest length])
        return _with_spans(st, planning_error(st, e, rows=_rows_per_microbatch(st)) if explain else e)
    try:   # (Config.data_parallel=True: only the replicas)
        pipeline = None if config.data_parallel and replicas > 1 else _best_stage_plan(st, N, M, budget_set)
    except PlanningError as e:
        raise failed(e) from None
    if replicas > 1:   # Note [replicas]: each device runs the one-device plan over its share of the microbatches
        try:
            copy = _best_stage_plan(st, 1, math.ceil(M / replicas), budget_set)
        except PlanningError as e:
            if pipeline is None:
                raise failed(e) from None
            copy = None
        if copy is not None:
            copy_plan = copy[0]
            # copies of one microbatch each sum the host set's dtype (Note [one microbatch a copy]:
            # costed at fp32, 4-GPU Qwen3-1.7B's sum took 34 ms of an estimated 408), as copies in
            # worker processes send it (Note [copies' sums a part at a time], runtime/replicas.py)
            narrow = planned_grad_dtype(st.captured, config.compute_dtype, config.optimizer_mode).itemsize
            est = copy_plan.est_time + exchange_seconds(st.captured.params, replicas, hw,
                                                        narrow if M <= replicas or config.workers == "processes" else 4)
            if pipeline is None or est < pipeline[0].est_time:
                pipeline = (dataclasses.replace(copy_plan, est_time=est), *copy[1:])
            else:
                replicas = 1
    return pipeline, replicas


# Note [finer microbatches]: a copy of the one-device plan runs its share of the microbatches
# (Note [replicas]); at 4 GPUs and M=4 that is one microbatch of 8 rows of Llama-3.1-8B, whose
# activations, beside the 29.4 GiB of optimizer state each device keeps, leave room for a fused
# job of layers 17-31 only: the embedding and layers 0-16 run forward, are kept at their inputs
# and recomputed (measured 4x H200: 1.671 s a step, 3.40x one GPU's; the 1-GPU plan recomputes
# layers 0-10). With more, smaller microbatches the activations a job holds shrink and more of
# the model fits one fused job. Planned on the CPU for 125.3 GiB H200s: 1.353 s at M=16 against
# 1.481 s at M=4 (4 GPUs), 4.732 against 5.242 s at M=8 (1 GPU); Qwen3-1.7B's plans, one fused
# job already, are unchanged (benchmarks/runs/microbatches/). So the model's first train plan,
# where it recomputes, weighs FINER_SPLITS times as many microbatches (rows allowing), up to the
# first count that recomputes nothing, and takes the shortest step (the longer of the jobs and
# the optimizer's update) where it is FINER_MARGIN shorter than the plan's own; the plans after
# it split as it does (CompiledModel._compile), and `cm.plan` names both counts. The cost model
# does not price a smaller matrix product's lower efficiency, hence the margin.
# Measured (51st session, H200s, Llama-3.1-8B, seq 2048, one run a side from empty caches): on
# one GPU (65,536 tokens, M=4 -> 8, one fused job whose weights stay on the device) the steady
# step 5.609 -> 5.203 s, 11,437 -> 11,738 tokens/s over the timed steps, compute 5.49 -> 4.96 s,
# losses alike; with copies on 2 GPUs at a 4-GPU run's load a GPU (32,768 tokens, M=2 -> 8,
# jobs embedding-5 forward, 6-31 fused, 0-5 backward) slower, 18,631 -> 16,934 tokens/s (steps
# 1.71 -> 1.86 s): the compute fell 1.70 -> 1.57 s a GPU, but the fused job's 12 GiB of weights
# go up every step behind a 0.08 s job (exposed uploads 0.36 -> 0.49 s a GPU, busy 80 -> 69%),
# which the cost model, pricing a job as the longer of its compute and its own upload, does not
# see. So by default (Config.split_microbatches=None) only a plan for one GPU weighed finer
# counts; True weighs them on any devices (CPU devices too), False never. Each count's step
# now adds what its jobs wait for their weights beyond their priced times (Note [uploads behind
# the job before] in passes/uploads.py): planned on the CPU, the 2-GPU plan above is 1.545 s
# with its wait, M=2's 1.713 s (measured 1.71 s) and M=4's pipeline 1.450 s, which True takes
# there (one run, 18,547 tokens/s against M=2's 18,631 in another call: no gain); with True 4
# GPUs at 65,536 tokens take M=16 (1.353 s, no wait: one fused job a copy, whose next weights go up
# during the step, Note [next weights during the step] in runtime/modes.py); 2 GPUs keep M=4
# and one GPU takes M=8 as before. Not measured: the 4-GPU plan at M=16, the plan this Note set
# out to make (benchmarks/runs/microbatches/README.md); where it is faster, the default may
# weigh finer counts on any GPUs. With each device's uploads priced at its share of the host's
# (Note [host-wide uploads] in passes/cost.py) the 4-GPU plan at M=4 is 1.559 s (measured 1.671
# s), at M=16 still 1.353 s (its 16 GB of weights a device go up within its compute), 1.273 s
# with the copies' sum in bf16 (Note [copies' sums a part at a time] in runtime/replicas.py).
# What the measurements share: the one count measured faster (1 GPU, M=8) made the plan the
# whole model in one fused job, nothing recomputed, its next weights going up during the step;
# the counts measured slower or no faster (2 GPUs at 32,768 tokens, M=8 copies and M=4
# pipeline) kept several jobs a device, whose waits the estimates miss by 18-20%. So by default
# (None) plans for GPUs, any number, weigh finer counts but take only one whose plan is the whole
# model a device (_whole_a_device: one device's, or copies of it); True takes any count, False
# none. Planned on the CPU for H200s: Llama-3.1-8B at 65,536 tokens takes M=8 on one GPU (as
# before), keeps M=4 on 2 (the host's update, 2.97 s, paces every count) and takes M=16 on 4
# (1.273 s against 1.559 s: predicted, not measured: the 52nd session's 2-GPU stand-in for a
# 4-GPU copy did 11% less GPU work a step at M=16, benchmarks/runs/microbatches/README.md); at
# 32,768 tokens on 2 GPUs it keeps M=2 (True would take M=4, copies of three jobs, 1.426 s
# estimated); Qwen3-1.7B weighs nothing (one fused job at M=4 already).
FINER_SPLITS = (2, 4, 8)
FINER_MARGIN = 0.03


def split_finer_pass(st: CompileState) -> CompileState:
    """Where the plan may split finer and recomputes: the state solved at the microbatch count
    whose step is shortest, if clearly shorter (Note [finer microbatches]); st.finer says what was
    weighed."""
    if not _splits_finer(st):
        return st
    M, B = st.num_microbatches, st.batch.size
    best, best_pace = st, _pace(st)
    st.finer = [(M, best_pace, True)]
    for k in FINER_SPLITS:
        if M * k > B:
            break
        cand = dataclasses.replace(st, num_microbatches=M * k, on_devices=st.on_devices_arg, reserved=0,
                                   optimizer_s=None, block_cuts=None, finer=[])
        try:
            for _, fn, _ in _passes_between("find_batch", "split_finer"):   # (the batch's split onwards)
                cand = fn(cand)
        except PlanningError:
            continue
        except InputError:      # (its rows split apart are not eager's: Note [rows kept apart])
            break
        again, pace = cand.stage_plan.fused[0] > 0, _pace(cand)
        st.finer.append((M * k, pace, again))
        if pace < (1 - FINER_MARGIN) * best_pace and (st.config.split_microbatches or _whole_a_device(cand)):
            best, best_pace = cand, pace
        if not again:
            break
    best.finer = st.finer
    return best


def _passes_between(first: str, stop: str) -> list:
    """The PASSES from `first` up to (not including) `stop`."""
    names = [name for name, _, _ in PASSES]
    return PASSES[names.index(first):names.index(stop)]


def _splits_finer(st: CompileState) -> bool:
    """Whether this plan weighs more microbatches: the model's first train plan (compile_graph's
    split_finer), where Config.split_microbatches allows (finer_allowed), at the capture's sizes,
    with a batch to split and jobs that recompute (a fused job that does not start the model)."""
    if not st.split_finer or st.mode != "train" or st.at is not None or not finer_allowed(st.config):
        return False
    return bool(st.batch.leaves and st.batch.size and st.stage_plan.fused[0] > 0)


def finer_allowed(config) -> bool:
    """Config.split_microbatches: None (the default) on GPUs, taking only a count whose plan is the
    whole model a device (_whole_a_device, Note [finer microbatches]); True on any devices, any
    count; False never."""
    allowed = config.split_microbatches
    return allowed if allowed is not None else config.on_gpu


def _whole_a_device(st: CompileState) -> bool:
    """The solved state runs the whole model as one fused job on each device: its one device's
    plan, or copies of it (Note [replicas])."""
    return st.stage_plan.num_jobs == 1 and (st.replicas > 1 or len(st.config.devices) == 1)


def _pace(st: CompileState) -> float:
    """A solved state's step: its jobs, with what they wait for their weights beyond their priced
    times (Note [uploads behind the job before] in passes/uploads.py), or, beside them, the
    optimizer's update where the plan chose its share."""
    return max(st.stage_plan.est_time + plan_upload_wait(st), st.optimizer_s or 0.0)


def _host_at(st: CompileState, share: float, cut: Optional[int] = None):
    """The plan's host memory before the stage cut (host_memory.per_parameter) at `share`, with
    `cut` bytes (default: what an earlier try's cut took, st.host_cut) as its activations."""
    config = st.config
    grad_dtype = planned_grad_dtype(st.captured, config.compute_dtype, config.optimizer_mode)
    hm = per_parameter(st.captured.params, config.compute_dtype, config.on_gpu, config.optimizer_mode,
                       config.workers, share, grad_dtype, len(config.devices))
    hm.activations = st.host_cut if cut is None else cut
    return hm


def _host_error(st: CompileState, hm, why: str):
    """host_memory_error for this plan's budget."""
    return host_memory_error(hm, st.budgets, st.config.optimizer_mode, why)


def _least_host_share(st: CompileState, chooses: bool) -> float:
    """The least share of the optimizer on the devices whose host memory fits the plan's host
    budget (Note [host room] in passes/host_memory.py): 0 without a budget or where nothing need
    move; raises the host's PlanningError where no share the plan may take fits."""
    if st.budgets.host is None:
        return 0.0
    mode = st.config.optimizer_mode
    least = least_host_share(lambda share: _host_at(st, share), mode, st.budgets.host)
    fixed = st.on_devices or 0.0
    if least is not None and (chooses or least <= fixed):
        return least
    if mode == "exact":
        why = "in exact mode the host holds the gradients and your optimizer steps there"
    elif least is None:
        why = "not even with all of the optimizer's state on the devices"
    else:
        why = _needs_share(st, least)
    shown = least if least is not None else 1.0 if chooses else fixed
    raise _host_error(st, _host_at(st, shown), why)


def _needs_share(st: CompileState, least: float) -> str:
    fixed = (f"{st.budgets.host_only} steps on the host only" if st.budgets.host_only else
             f"Config.optimizer_on_devices={st.config.optimizer_on_devices!r}")
    return f"it would need a share of at least {least:g} of the optimizer on the devices ({fixed})"


def _choose_share(st: CompileState, budget_set, cut, least: float = 0.0) -> None:
    """The optimizer's share on the devices, for a plan that chooses it: what fits in the room
    the jobs leave (Note [optimizer share by room] in passes/host_memory.py) or, where the host's
    update would then set the pace (a train plan), the first of the larger shares pace_shares
    names whose jobs, re-cut beside it, fit and make the shorter step (Note [optimizer share by
    pace]); never less than `least`, the share the host's memory needs (Note [host room]), the
    jobs re-cut beside it where the room has less. Sets st.on_devices, st.reserved, st.budget
    and, for a re-cut, the plan; `cut` is the capture's (cuts, segments, cut bytes)."""
    params, N = st.captured.params, len(st.config.devices)
    share = share_by_room(params, N, st.budget - max(st.stage_plan.job_memory))
    reserved = device_optimizer_bytes(params, share, N)
    best = (max(st.stage_plan.est_time, optimizer_seconds(params, share)), share, reserved,
            (st.stage_plan, st.cuts, st.segments, st.cut_bytes), st.replicas)
    weigh = pace_shares(params, N, st.stage_plan.est_time, max(share, least)) if st.mode == "train" else []
    if share < least:     # (the host needs more than the room gives: any share from `least` on beats none)
        best = (math.inf, *best[1:])
        weigh = [s for s in weigh if s >= least] + ([least] if least not in weigh else [])
    # (a forward call's plan, which may choose first, costs no step the update runs beside)
    for s in weigh:
        st.reserved = device_optimizer_bytes(params, s, N)
        st.budget = budget_set - st.reserved
        if st.budget <= 0:
            continue
        st.cuts, st.segments, st.cut_bytes = cut
        try:
            planned, replicas = _stage_plan(st, budget_set, explain=False)
        except PlanningError:      # (the jobs do not fit beside it)
            continue
        pace = max(planned[0].est_time, optimizer_seconds(params, s))
        if pace < best[0]:
            best = (pace, s, st.reserved, planned, replicas)
            break
    if best[0] == math.inf:
        raise _host_error(st, _host_at(st, least),
                          f"its host memory needs a share of at least {least:g} of the optimizer on the devices "
                          f"({_fmt_bytes(device_optimizer_bytes(params, least, N))} a device), and the stage jobs "
                          f"do not fit beside it in the devices' {_fmt_bytes(budget_set)}")
    _, st.on_devices, st.reserved, planned, st.replicas = best
    st.stage_plan, st.cuts, st.segments, st.cut_bytes = planned
    st.budget = budget_set - st.reserved
    st.optimizer_s = optimizer_seconds(params, st.on_devices)


def _best_stage_plan(st: CompileState, num_devices: int, num_microbatches: int, budget_set) -> tuple:
    """(stage plan, cuts, segments, cut bytes) of the best plan for `num_devices` devices and
    `num_microbatches` microbatches a job: the cuts between blocks where that is nearly as fast
    (Note [cuts between blocks]). Raises PlanningError where nothing fits."""
    config, hw = st.config, st.hardware

    def solve(segments, cut_bytes):
        return solve_stages(segments, cut_bytes, num_devices=num_devices,
                            num_microbatches=num_microbatches, memory_budget=st.budget,
                            upload_bw=hw.upload_bw, job_overhead_s=hw.job_overhead_s(num_devices),
                            max_jobs=config.max_jobs, overlapped_steps=st.steps_overlap,
                            reserved=st.reserved, budget_set=budget_set)
    best = (solve(st.segments, st.cut_bytes), st.cuts, st.segments, st.cut_bytes)
    if st.block_cuts is not None:
        cuts, segments, cut_bytes = st.block_cuts
        try:
            plan = solve(segments, cut_bytes)
        except PlanningError:
            plan = None
        if plan is not None and plan.est_time <= (1 + BLOCK_CUT_SLACK) * best[0].est_time:
            best = (plan, cuts, segments, cut_bytes)
    return best


def _weighs_replicas(config) -> bool:
    """Whether the planner weighs replicas against the pipeline (Config.data_parallel): where
    asked to, or by default on GPUs without peer transfers (asked for, they are the pipeline's;
    CPU devices train the pipeline unless asked: they stand in for GPUs in tests, and their
    costs decide nothing)."""
    return bool(config.data_parallel or (config.data_parallel is None and config.on_gpu and not config.peer_transfers))


def _replicas(st: CompileState, num_devices: int, num_microbatches: int) -> int:
    """How many copies of the one-device plan the planner may weigh (Note [replicas]): one per
    device, where every device gets a microbatch and Config.data_parallel allows it; 1: none."""
    if not _weighs_replicas(st.config) or num_devices < 2 or num_microbatches < num_devices:
        return 1
    if st.config.workers == "processes" and st.config.repeats_a_gpu:
        return 1       # (Config refuses data_parallel=True here: NCCL takes one GPU per process)
    if st.mutated_buffers:   # the microbatches update them one after another
        if st.config.data_parallel:
            raise PlanningError(f"Config(data_parallel=True): the model updates buffers in place "
                                f"({len(st.mutated_buffers)} of them, e.g. running statistics) microbatch after "
                                "microbatch, which copies running side by side cannot do; leave data_parallel "
                                "at None or False")
        return 1
    return num_devices


def _share_by_room_applies(st: CompileState) -> bool:
    """Whether a plan chooses the optimizer's share on the devices: on GPUs where an attached
    optimizer takes the steps (overlapped, delayed). The model's first plan chooses, whatever its
    call (a forward call's plan too: every later plan reserves the share). On CPU devices the
    devices' memory is the host's."""
    return st.config.on_gpu and st.config.optimizer_mode != "exact"


def _mutated_buffers(gm) -> list:
    """Indices of the buffers the graph updates in place (running statistics): a buffer, or a
    view of it (a value of the graph sharing its storage), that an in-place node takes. The
    runtime writes back only these (Note [buffers written back] in runtime/job.py)."""
    mutated = {n.meta["rp_index"] for n in gm.graph.find_nodes(op="placeholder")
               if n.meta.get("rp_kind") == "buffer" and not isinstance(node_value(n), torch.Tensor)
               and any(is_impure(u) for u in n.users)}
    for n, index in _buffer_values(gm, _buffer_storages(gm)):
        if any(is_impure(u) for u in n.users):
            mutated.add(index)
    return sorted(mutated)


def _buffer_storages(gm, only=None) -> dict:
    """{storage: buffer index} of the tensor buffers (of those in `only`, where given)."""
    out = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        v = node_value(n)
        if n.meta.get("rp_kind") == "buffer" and isinstance(v, torch.Tensor) and (only is None or n.meta["rp_index"] in only):
            out[storage_key(v)] = n.meta["rp_index"]
    return out


def _buffer_values(gm, storages: dict):
    """(node, buffer index) for every graph value sharing a storage of `storages`: the buffer
    and its views."""
    for n in gm.graph.nodes:
        v = node_value(n)
        index = storages.get(storage_key(v)) if isinstance(v, torch.Tensor) else None
        if index is not None:
            yield n, index


def _buffers_read(gm, mutated) -> list:
    """Of the buffers the graph updates in place, those whose value a node other than their
    updates reads (`h / self.ema` after `self.ema.mul_(m)`; not BatchNorm's running statistics,
    which only the batch_norm that updates them takes): the outputs of a backward job's
    recompute depend on their value at the microbatch's start (Note [buffer values a recompute
    starts from], runtime/job.py). A view of one counts by its readers."""
    read = set()
    for n, index in _buffer_values(gm, _buffer_storages(gm, only=mutated)):
        key = storage_key(node_value(n))
        for u in n.users:
            uv = node_value(u)
            if u.op != "output" and not is_impure(u) and not (isinstance(uv, torch.Tensor) and storage_key(uv) == key):
                read.add(index)
    return sorted(read)


def _steps_overlap(st: CompileState) -> bool:
    """Whether the runtime lets this plan's steps overlap: delayed mode's train steps that update
    no buffer in place (running statistics the next step would read). The plan carries it to
    the runtime (DelayedMode.overlaps), and the solver costs plans by the replayed schedule there
    (Note [overlapped step model] in passes/step_model.py)."""
    return st.config.optimizer_mode == "delayed" and st.mode == "train" and not st.mutated_buffers


def build_stages_pass(st: CompileState) -> CompileState:
    jobs = [(kind, (st.cuts[i], st.cuts[j])) for kind, (i, j) in st.stage_plan.jobs()]
    st.stages = build_stages(st.gm, st.liveness, jobs)
    return st


def build_programs(st: CompileState) -> CompileState:
    at = st.loss_scale.output if st.loss_scale is not None else 0     # (a train plan's only output)
    for stage in st.stages:
        roles = {"fwd": ["fwd"], "fused": ["fused", "fwd", "bwd"], "bwd": ["bwd"]}[stage.kind]
        loss = next((name for name, indices in stage.graph_outputs.items() if at in indices), None)
        stage.programs = {role: build_program(stage, role, loss) for role in roles}
    return st


def describe_io(st: CompileState) -> CompileState:
    config, gm = st.config, st.gm
    plan = Plan(mode=st.mode, gm=gm, captured=st.captured, stages=st.stages, stage_plan=st.stage_plan,
                cuts=st.cuts, bindings=st.bindings, num_devices=len(config.devices),
                num_microbatches=st.num_microbatches, memory_budget=st.budget, loss_scale=st.loss_scale,
                lm_head=st.lm_head, batch=st.batch)
    _describe_io(plan)
    attach_row_checks(st.stages, st.batch, plan.sym_sources)
    plan.mutated_buffers, plan.steps_overlap = st.mutated_buffers, st.steps_overlap
    plan.buffers_at_start = [i for i in _buffers_read(gm, st.mutated_buffers)
                             if any(stage.kind == "bwd" and i in stage.buffers for stage in st.stages)]
    plan.early_first_upload, plan.prefetch_bytes = st.early_first_upload, st.prefetch_bytes
    plan.optimizer_share, plan.optimizer_est_s = st.on_devices or 0.0, st.optimizer_s
    plan.replicas, plan.finer, plan.host_share = st.replicas, list(st.finer), st.host_share
    plan.device_budget = st.budgets.device
    plan.upload_wait_s = plan_upload_wait(st)
    st.plan = plan
    return st


def host_memory_pass(st: CompileState) -> CompileState:
    config = st.config
    hm = st.plan.host_memory = host_memory(st.plan, config.compute_dtype, config.on_gpu, config.optimizer_mode,
                                           config.workers, st.plan.optimizer_share, st.budgets.host)
    if st.budgets.host is None:
        return st
    first = st.budgets.host_first
    if first is not None:      # a later plan: its activations beside the first plan's buffers (Note [host room])
        if checked_bytes(hm, config.optimizer_mode) > st.budgets.host:
            longest = _longest_host_length(st)
            raise _host_error(st, hm, f"at this call's sizes its activations and checkpoints take "
                                      f"{_fmt_bytes(hm.activations)}, where the model's first train plan, which set "
                                      f"the host's buffers, took {_fmt_bytes(first.activations)}"
                                      + (f"; at this call's rows, sequences of at most {longest} tokens fit (as "
                                         "this plan cuts the model)" if longest else ""))
        return st
    # (solve_stages fitted all but what the cut decides: the activations, the carried rows)
    if checked_bytes(hm, config.optimizer_mode) > st.budgets.host:
        why, cut = "with its activations and checkpoints", hm.activations + hm.carried_rows
        if not st.chooses_share and config.optimizer_mode != "exact":
            least = least_host_share(lambda share: _host_at(st, share, cut), config.optimizer_mode, st.budgets.host)
            if least is not None and least > st.plan.optimizer_share:
                why += "; " + _needs_share(st, least)
        e = _host_error(st, hm, why)
        if st.chooses_share and st.plan.optimizer_share < 1:
            e.cut = cut    # (compile_graph plans again, holding these back)
        raise e
    if hm.total > st.budgets.host:     # exact mode: what the user's optimizer's state would take (Note [host room])
        warnings.warn(f"rpcompile: the plan's host memory is {_fmt_bytes(hm.total)} with AdamW's state (which your "
                      f"optimizer allocates), more than the host budget of {_fmt_bytes(st.budgets.host)}: an optimizer "
                      "with less state, or optimizer_mode='delayed' or 'overlapped' with cm.attach_optimizer(opt) "
                      "(its state may then go to the GPUs), fits", stacklevel=2)
    return st


def _longest_host_length(st: CompileState) -> Optional[int]:
    """The longest sequence length, at the call's rows, at which this plan's host memory fits its
    budget (host_bytes_at each length), by bisection below the call's; None where the length is
    no size symbol or not even one token fits."""
    at = _lengths_at(st)
    if not at:
        return None

    def fits(n: int) -> bool:
        return host_bytes_at(st.plan, st.config.optimizer_mode, dict.fromkeys(at, n)) <= st.budgets.host
    lo, hi = 0, next(iter(at.values()))       # (hi does not fit: the call's own length)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo or None


# The compiler: (name, pass, what to print of the state after it). Printers: "graph" is the
# graph as Python; the others summarise the fields the pass filled in.
PASSES = [
    ("capture", capture, "graph"),
    ("keep_loss_output", keep_loss_output_pass, "graph"),
    ("normalize_loss", normalize_loss_pass, "graph"),
    ("causal_attention", causal_attention_pass, "graph"),
    ("split_lm_head", split_lm_head_pass, "graph"),
    ("annotate_costs", annotate_costs_pass, "costs"),
    ("find_batch", find_batch_pass, "batch"),
    ("cut_points", cut_points, "cuts"),
    ("solve_stages", solve_stages_pass, "stage_plan"),
    ("split_finer", split_finer_pass, "finer"),
    ("build_stages", build_stages_pass, "stages"),
    ("build_programs", build_programs, "programs"),
    ("describe_io", describe_io, "io"),
    ("host_memory", host_memory_pass, "plan"),
]


# Note [pass text on demand]: rendering every state as text took ~30% of a compile (2.5 of
# 8.2 s for the Qwen3-1.7B shape of tests/test_cost.py: stage and program graphs as Python, cost
# lines in sympy), for files only cm.dump writes. So plan.passes holds, per pass, a function
# that renders the state when the text is first read, holding the objects the text shows as the
# pass left them (the CompileState's fields are reassigned by later passes, so not the state
# itself). That is the state's text only while nothing changes those objects afterwards:
# - the graph passes up to split_lm_head (GRAPH_REWRITES) rewrite st.gm in place, so the text
#   of every state before the last of them is rendered at once (python_code: 0.08 s a state),
#   once per capture: a re-plan at a new length rewrites the same graph the same way (0.5 s of a
#   28-layer Qwen3's re-plan on CPU went to rendering them again);
# - after split_lm_head, st.gm's code is final: annotate_costs only sets node meta (rp_cost,
#   frozen NodeCosts, never replaced), the later passes and the runtime read it (codegen adds an
#   rp_param_slice_fqn meta no text shows); so split_lm_head's and annotate_costs' texts render
#   later from the same graph;
# - find_batch's BatchInfo and bindings, the cut lists and StagePlans (frozen) are replaced by
#   later passes, never changed in place; stage and program graphs are new graphs nobody rewrites
#   (the runtime retargets and compiles copies: runtime/programs.py); the fields describe_io
#   fills in are set once;
# - the plan's own text (host_memory) reads what changes after the compile (plan.served, the
#   user's parameters for the masters line): rendered at once (0.13 s).
GRAPH_REWRITES = ("keep_loss_output", "normalize_loss", "causal_attention", "split_lm_head")


class PassTexts(Sequence):
    """plan.passes: (pass name, printer, text) per pass, in order; a text given as a function
    is rendered on first read and kept (Note [pass text on demand])."""

    def __init__(self):
        self._items: list = []

    def append(self, item) -> None:
        self._items.append(item)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        name, show, text = self._items[i]
        if callable(text):
            text = text()
            self._items[i] = (name, show, text)
        return name, show, text

    def __repr__(self) -> str:
        return f"PassTexts({[name for name, _, _ in self._items]})"


def compile_graph(cap, config, mode: str, loss_output=None, at=None, on_devices="config",
                  num_microbatches=None, split_finer=False, budgets: Budgets = Budgets()) -> Plan:
    """Run PASSES over a Captured graph and return the Plan; plan.passes keeps what each printed.
    at: {symbol name: size} to plan at instead of the capture's sizes. on_devices: the optimizer's
    share on the devices to plan with (None: the plan chooses it; default: the config's).
    num_microbatches: what the batch is split into (None: the config's; a count an earlier plan
    chose); split_finer: the plan may split finer (Note [finer microbatches]). budgets: each
    device's and the host's (passes/budgets.py: a model's plans get them from its ModelBudgets;
    the default measures the devices' now and leaves the host unchecked)."""
    on_devices = config.optimizer_on_devices if on_devices == "config" else on_devices
    budgets = dataclasses.replace(budgets, device=device_budget(config, budgets))

    def state(host_cut: int = 0) -> CompileState:      # (the passes fill one in)
        return CompileState(captured=cap, config=config, mode=mode, loss_output=loss_output, at=at,
                            loss_output_arg=loss_output, on_devices=on_devices, on_devices_arg=on_devices,
                            num_microbatches=num_microbatches, split_finer=split_finer, budgets=budgets,
                            host_cut=host_cut)
    held = 0
    for attempt in range(HOST_TRIES):
        try:
            return _run_passes(state(held))
        except HostMemoryError as e:
            if e.cut is None or attempt == HOST_TRIES - 1:
                raise
            # the share was chosen before the cut put its activations on the host: again, with
            # those held back (Note [host room] in passes/host_memory.py)
            held = max(held, e.cut) + (e.needed - e.budget if e.cut <= held else 0)


# plans made for one host budget at most (each holding back more of it for the activations).
# Llama-3.1-8B planned on the CPU for one H200: budgets of 92-103 GiB took 2-3 tries, 90 GiB 4
# (the activations a plan puts on the host grow with the share it takes: more jobs, more
# checkpoints), 88 GiB stopped after 5 with nothing that fits; a try of that plan takes ~1.3 s.
HOST_TRIES = 6


def _run_passes(st: CompileState) -> Plan:
    cap, mode, loss_output = st.captured, st.mode, st.loss_output_arg
    names = [name for name, _, _ in PASSES]
    last_rewrite = max(names.index(name) for name in GRAPH_REWRITES)
    printed, seconds = PassTexts(), {}
    for i, (name, run, show) in enumerate(PASSES):
        t0 = time.perf_counter()
        st = run(st)
        seconds[name] = time.perf_counter() - t0       # (the texts rendered now are not counted)
        text = _printer(st, show)
        if i < last_rewrite:   # the same rewrites of the same capture at every length: rendered once
            key = (name, mode, loss_output)
            if key not in cap.pass_texts:
                cap.pass_texts[key] = text()
            text = cap.pass_texts[key]
        printed.append((name, show, text() if show == "plan" else text))
    st.plan.passes = printed
    st.plan.compile_seconds.update(seconds)
    return st.plan


def _printer(st: CompileState, show: str):
    """A function rendering the state after a pass as text (graphs as Python, with costs or
    stages in comments); it holds the fields the text shows, as they are now."""
    gm, plan = st.gm, st.plan
    if show == "graph":
        return lambda: gm.graph.python_code("self").src
    if show == "costs":
        return lambda: _costs_text(gm)
    if show == "batch":
        batch, bindings = st.batch, st.bindings
        return lambda: f"# {batch}\n# planning bindings: {bindings}\n"
    if show == "cuts":
        cuts = st.cuts
        return lambda: f"# legal cut positions ({len(cuts)}): {cuts}\n"
    if show == "stage_plan":
        stage_plan = st.stage_plan
        return lambda: f"# {stage_plan}\n"
    if show == "finer":
        finer, stage_plan, M = list(st.finer), st.stage_plan, st.num_microbatches
        weighed = "; ".join(f"{m} microbatches: {pace:.4g} s{', recomputes' if again else ''}" for m, pace, again in finer)
        return lambda: (f"# {M} microbatches" + (f" (weighed {weighed})" if finer else "") + f"\n# {stage_plan}\n")
    stages = list(st.stages)
    if show == "stages":
        return lambda: "\n\n".join(s.forward.print_readable(print_output=False) for s in stages)
    if show == "programs":
        programs = [g for s in stages for g in s.programs.values()]
        return lambda: "\n\n".join(g.print_readable(print_output=False) for g in programs)
    if show == "io":
        return lambda: (f"# split leaves {sorted(plan.split_leaves)}; size symbols {plan.sym_sources}; outputs "
                        f"{plan.graph_outputs} (batched {plan.output_batched}); mutated buffers {plan.mutated_buffers}\n")
    return lambda: str(plan) + "\n"


def _costs_text(gm) -> str:
    lines = [f"# {n.name}: fwd {c.fwd_flops} FLOPs, bwd {c.bwd_flops} FLOPs, out {c.out_bytes} B"
             for n in gm.graph.nodes if (c := n.meta.get("rp_cost")) is not None]
    return "\n".join(lines) + "\n\n" + gm.graph.python_code("self").src


# Note [float sizes]: dynamo passes a Python float of the model's (a config's
# partial_rotary_factor, through the backend) as a 0-d tensor and reads it in the graph as a float
# symbol (zf62); a size computed from it, `int(head_dim * factor)`, is an expression of that
# symbol, which no argument's size binds. Planning binds it to the value dynamo saw (the
# ShapeEnv's hint). The jobs compute such sizes from the values they are given, so only the
# plan's byte counts read the hint: Phi-3's longrope through the backend failed in planning
# ("no value bound for symbol(s) ['zf62']").
def _float_hints(gm) -> dict:
    """The values of the float symbols a graph's sizes read (Note [float sizes])."""
    env = next((ev.fake_mode.shape_env for n in gm.graph.find_nodes(op="placeholder")
                if isinstance(ev := n.meta.get("example_value"), torch.Tensor) and getattr(ev, "fake_mode", None)
                is not None and ev.fake_mode.shape_env is not None), None)
    if env is None:
        return {}
    read = {s.name for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("example_value"))
            for size in (v.shape if isinstance(v, torch.Tensor) else (v,))
            if isinstance(size, (torch.SymInt, torch.SymFloat)) for s in size.node.expr.free_symbols}
    # (only those: a module's float the backend read as a number (Note [module floats]) is none)
    return {s.name: float(v) for s, v in symbol_hints(env).items() if s.name.startswith("zf") and s.name in read}


def _bindings(gm, batch, micro: int) -> dict:
    """Values of the graph's size symbols to plan at: the planned microbatch for the batch."""
    out = {}
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value") if n.op == "placeholder" else None
        if isinstance(ev, (torch.SymInt, torch.SymFloat)) and ev.node.expr.is_Symbol:    # (a float too: backend)
            out[ev.node.expr.name] = ev.node.hint
    out.update({k: v for k, v in _float_hints(gm).items() if k not in out})
    for s in batch.symbols:
        out[s.name] = micro
    return out


def _single_scalar_output(gm: fx.GraphModule) -> int:
    scalars = scalar_outputs(gm.graph)
    if len(scalars) != 1:
        raise CaptureError("train_step needs a loss: the model returns no `loss` field and not exactly one scalar "
                           "output. Pass labels so the model computes its loss, or give Config(loss_fn=...) "
                           "or train_step(..., target=..., loss_fn=...)")
    return scalars[0]


def _rows_per_microbatch(st: CompileState) -> int:
    """The rows of a microbatch the plan is costed at (the batch symbols' planning binding)."""
    rows = [st.bindings[s.name] for s in st.batch.symbols if s.name in st.bindings]
    return int(max(rows)) if rows else _planned_microbatch(st.batch, st.num_microbatches)


def _planned_microbatch(batch, num_microbatches: int) -> int:
    if not batch.size or not batch.leaves:
        return batch.size or 1
    return max(1, math.ceil(batch.size / num_microbatches))


def _describe_io(plan: Plan) -> None:
    """Which call leaves are split per microbatch, where each size symbol is read, and the outputs."""
    gm, batch = plan.gm, plan.batch
    plan.split_leaves = set(batch.leaves)
    if not plan.split_leaves and batch.fixed and plan.num_microbatches > 1:
        lines = sorted(set(batch.fixed_at.values()))
        at = f" (the model code specialised it at {', '.join(f'`{w}`' for w in lines)})" if lines else ""
        how = ("Keep the rows' number dynamic there (a Python list of the rows, or a loop over them, fixes it), or "
               "pass num_microbatches=1" if lines else "Mark the batch dim dynamic (torch.compile(..., dynamic=True) "
               "or torch._dynamo.mark_dynamic(x, 0))")
        warnings.warn(f"rpcompile: the captured graph fixed the batch size of {batch.fixed}{at}, so the batch is "
                      f"not split into microbatches (num_microbatches=1 is used). {how}.")
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("rp_kind") == "sym":
            plan.sym_sources[n.name] = n.meta.get("rp_arg_index") or _sym_source(gm, n.meta["rp_expr"])
    means = []      # 0-d outputs of no kind over the rows: their microbatches' mean
    for i, v in enumerate(output_values(gm.graph)):
        ev = v.meta.get("example_value") if isinstance(v, fx.Node) else None
        if not isinstance(ev, torch.Tensor):
            raise CaptureError(f"the model returns a non-tensor value computed in forward ({v}); rpcompile "
                               "returns tensors only: return it as a tensor or compute it outside the model (a "
                               "transformers model called with use_cache=True, its config's default, returns its "
                               "cache, whose sliding-window layers hold lengths: call it with use_cache=False, as "
                               "rpcompile.compile does unless told otherwise)")
        plan.graph_outputs.append(v.name)
        # (dim 0 the rows, or each row's entries together: a multiple of them, Note [rows kept apart])
        rows = ev.dim() >= 1 and batch.whole_rows(ev.shape[0])
        batched = rows and not rows_in_blocks(v, batch)
        if rows and not batched and plan.num_microbatches > 1:
            raise CaptureError(f"the model returns `{v.name}` of shape {batch.shape_text(ev.shape)}, whose dim 0 "
                               f"holds the batch's rows in blocks, whole batches one after another "
                               f"(`torch.cat([chosen, rejected])`, `h.repeat(2, 1)`): rpcompile puts a call's outputs "
                               f"together from its microbatches along dim 0, which would interleave the blocks. "
                               f"Return each block as an output of its own (`chosen, rejected = h.chunk(2)`), or call "
                               f"with Config(num_microbatches=1)")
        if not batched and plan.num_microbatches > 1 and any(map(batch.mentions, ev.shape)):
            # (an output of another layout would come back as its first microbatch's alone)
            raise CaptureError(f"the model returns `{v.name}` of shape {batch.shape_text(ev.shape)}, whose size "
                               f"depends on the batch size elsewhere than in dim 0: rpcompile puts a call's outputs "
                               f"together from its microbatches along dim 0 (the rows). Return it batch-first, or "
                               f"call with Config(num_microbatches=1)")
        plan.output_batched.append(batched)
        plan.output_differentiable.append(bool(ev.requires_grad) and ev.is_floating_point())
        if not batched:         # Note [outputs over rows] (passes/normalize_loss.py)
            kind = over_rows(v, batch)
            if kind is not None:
                plan.output_kinds[i] = kind
            elif plan.num_microbatches == 1 or not reads_the_batch(v, batch):
                pass
            elif ev.dim() == 0:
                if plan.loss_scale is None or plan.loss_scale.output != i:
                    means.append(i)
            else:
                raise CaptureError(f"the model returns `{v.name}` of shape {batch.shape_text(ev.shape)}, computed "
                                   f"from the whole batch but not row by row: rpcompile computes a call per microbatch "
                                   f"and puts such an output together only where it is a sum, mean, max or min over "
                                   f"the rows (Note [outputs over rows]). Return it batch-first (a value per row) and "
                                   f"reduce it outside the model, or call with Config(num_microbatches=1)")
    if means:
        # (a router's auxiliary loss, a norm of the whole batch: microbatches cannot make it)
        which = f"output{'s' * (len(means) > 1)} {', '.join(map(str, means))}"
        warnings.warn(f"rpcompile: the model returns 0-d values computed from the whole batch but not as a sum, "
                      f"mean, max or min over its rows ({which} of its flattened outputs): rpcompile computes a call "
                      f"per microbatch and returns for each such output the microbatches' values averaged (weighted "
                      f"by their rows), which is not eager's value. Return its parts batch-first and reduce them "
                      f"outside the model, or call with Config(num_microbatches=1) for eager's value")


def _sym_source(gm, expr):
    if expr.is_Integer:
        return int(expr)
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value") if n.op == "placeholder" else None
        if n.meta.get("rp_kind") == "input" and isinstance(ev, torch.Tensor):
            for d, s in enumerate(ev.shape):
                if isinstance(s, torch.SymInt) and s.node.expr == expr:
                    return (n.meta["rp_index"], d)
    raise CaptureError(f"size symbol {expr} is not the size of any input dimension; rpcompile cannot bind it")
