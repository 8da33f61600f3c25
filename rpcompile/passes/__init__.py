"""The compiler, in order: every pass rpcompile runs between capture and runtime.

    captured graph
      -> keep_loss_output   train mode: the loss is the only output (passes/outputs.py)
      -> normalize_loss     mean cross-entropy -> token sum + counter (passes/normalize_loss.py)
      -> split_lm_head      vocabulary shards with an online log-sum-exp (passes/lm_head.py)
      -> annotate_costs     FLOPs and bytes per node, sympy in the batch symbol (passes/cost.py)
      -> liveness, legal_cuts, segment_table   where stages may end (passes/cut_points.py)
      -> solve_stages       exact DP over forward / fused / backward stages (passes/partition.py)
      -> build_stages       forward and recompute+backward graphs per stage (passes/codegen.py)
      -> build_program      per-stage programs of transfer, event and compute nodes (passes/codegen.py)
      -> order_transfers    in each program: activation uploads, then weights, then the next job's prefetch

On GPUs the runner then compiles each stage's compute with Inductor, one repeated block (decoder
layer) at a time (passes/regions.py).
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.fx as fx

from ..errors import CaptureError
from ..plan import Plan
from .batch import attach_row_checks, check_splittable, find_batch
from .codegen import build_program, build_stages
from .cost import Hardware, annotate_costs
from .cut_points import legal_cuts, liveness, segment_table
from .graph_utils import clone_graph_module, is_impure, output_values
from .normalize_loss import mean_cross_entropy, normalize_loss
from .outputs import keep_loss_output, loss_leaf_index
from .partition import PlanningError, solve_stages

__all__ = ["compile_graph", "PlanningError"]


def compile_graph(cap, config, mode: str, loss_output=None) -> Plan:
    """Run every pass over a Captured graph and return the Plan with its stages and programs."""
    gm = clone_graph_module(cap.gm)
    if loss_output is None:
        loss_output = loss_leaf_index(cap.out_spec, len(cap.out_leaves)) if cap.out_spec is not None else None
        if loss_output is not None:
            kind, idx = cap.out_leaves[loss_output]
            loss_output = idx if kind == "out" else None
    if loss_output is None:
        # No output structure (a dynamo backend's flat outputs): a mean cross-entropy output
        # is the loss.
        loss_output = next((i for i, v in enumerate(output_values(gm.graph))
                            if isinstance(v, fx.Node) and mean_cross_entropy(v)), None)
    if mode == "train":
        if loss_output is None:
            loss_output = _single_scalar_output(gm)
        gm = keep_loss_output(gm, loss_output)
        loss_output = 0
    loss_scale = None
    if loss_output is not None:
        gm = normalize_loss(gm, loss_output)
        loss_scale = gm.meta["rp_loss"]
    lm_head = None
    if mode == "train" and config.lm_head_shards != 0:
        from .lm_head import split_lm_head
        gm = split_lm_head(gm, num_shards=config.lm_head_shards)
        lm_head = gm.meta.get("rp_lm_head")
    gm = annotate_costs(gm)

    batch = find_batch(gm, cap.batch_size, config.unbatched_inputs)
    check_splittable(batch, config.num_microbatches)
    hw = Hardware.h100() if config.on_gpu else Hardware.cpu()
    micro = _planned_microbatch(batch, config)
    bindings = _bindings(gm, batch, micro)
    lv = liveness(gm)
    cuts = legal_cuts(gm, lv, bindings)
    segments, cut_bytes = segment_table(gm, lv, cuts, bindings, hw)
    budget = _memory_budget(config)
    try:
        sp = solve_stages(segments, cut_bytes, num_devices=len(config.devices),
                          num_microbatches=config.num_microbatches, memory_budget=budget,
                          upload_bw=hw.upload_bw, job_overhead_s=hw.job_overhead_s(len(config.devices)),
                          max_jobs=config.max_jobs)
    except PlanningError as e:
        raise PlanningError(f"no stage plan fits: {e}", min_budget=e.min_budget, stage=e.stage) from None
    jobs = [(kind, (cuts[i], cuts[j])) for kind, (i, j) in sp.jobs()]
    stages = build_stages(gm, lv, jobs)
    for st in stages:
        roles = {"fwd": ["fwd"], "fused": ["fused", "fwd", "bwd"], "bwd": ["bwd"]}[st.kind]
        st.programs = {role: build_program(st, role) for role in roles}
    plan = Plan(mode=mode, gm=gm, captured=cap, stages=stages, stage_plan=sp, cuts=cuts, bindings=bindings,
                num_devices=len(config.devices), num_microbatches=config.num_microbatches,
                memory_budget=budget, loss_scale=loss_scale, lm_head=lm_head, batch=batch)
    _describe_io(plan)
    attach_row_checks(stages, batch, plan.sym_sources)
    plan.mutated_buffers = sorted({n.meta["rp_index"] for n in gm.graph.nodes
                                   if n.op == "placeholder" and n.meta.get("rp_kind") == "buffer"
                                   and any(is_impure(u) for u in n.users)})
    return plan


def _bindings(gm, batch, micro: int) -> dict:
    """Values of the graph's size symbols to plan at: the planned microbatch for the batch."""
    out = {}
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value") if n.op == "placeholder" else None
        if isinstance(ev, torch.SymInt) and ev.node.expr.is_Symbol:
            out[ev.node.expr.name] = ev.node.hint
    for s in batch.symbols:
        out[s.name] = micro
    return out


def _single_scalar_output(gm: fx.GraphModule) -> int:
    outs = output_values(gm.graph)
    scalars = [i for i, v in enumerate(outs) if isinstance(v, fx.Node)
               and isinstance(v.meta.get("example_value"), torch.Tensor) and v.meta["example_value"].dim() == 0]
    if len(scalars) != 1:
        raise CaptureError("train_step needs a loss: the model returns no `loss` field and not exactly one scalar "
                           "output. Pass labels so the model computes its loss, or give Config(loss_fn=...) "
                           "or train_step(..., target=..., loss_fn=...)")
    return scalars[0]


def _planned_microbatch(batch, config) -> int:
    if not batch.size or not batch.leaves:
        return batch.size or 1
    return max(1, math.ceil(batch.size / config.num_microbatches))


def _memory_budget(config):
    if config.memory_budget is not None:
        return config.memory_budget
    if config.on_gpu:
        free = min(torch.cuda.mem_get_info(d)[0] for d in config.devices)
        return int(free * 0.9)
    return None


def _describe_io(plan: Plan) -> None:
    """Which call leaves are split per microbatch, where each size symbol is read, and the outputs."""
    gm, batch = plan.gm, plan.batch
    plan.split_leaves = set(batch.leaves)
    if not plan.split_leaves and batch.fixed and plan.num_microbatches > 1:
        warnings.warn(f"rpcompile: the captured graph fixed the batch size of {batch.fixed}, so the batch is not "
                      "split into microbatches (num_microbatches=1 is used). Mark the batch dim dynamic "
                      "(torch.compile(..., dynamic=True) or torch._dynamo.mark_dynamic(x, 0)).")
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("rp_kind") == "sym":
            plan.sym_sources[n.name] = _sym_source(gm, n.meta["rp_expr"])
    for v in output_values(gm.graph):
        ev = v.meta.get("example_value") if isinstance(v, fx.Node) else None
        if not isinstance(ev, torch.Tensor):
            raise CaptureError(f"the model returns a non-tensor value computed in forward ({v}); rpcompile "
                               "returns tensors only: return it as a tensor or compute it outside the model")
        plan.graph_outputs.append(v.name)
        plan.output_batched.append(ev.dim() >= 1 and batch.is_batch_dim(ev.shape[0]))


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
