"""A plan's stage jobs costed at other sizes than the ones it was planned at.

The cost pass keeps every FLOP and byte count as a sympy expression in the size symbols, so a
plan made at one sequence length is re-costed at another by substitution, without capturing or
planning again (Note [plans per length] in plan_cache.py).
"""
from __future__ import annotations

from .cost import Hardware
from .cut_points import liveness, segment_table
from .partition import _Costs
from .resident import job_weights, resident_memory


def job_memory_at(plan, config, bindings: dict) -> list:
    """Planned device memory of each stage job of `plan` (execution order) at `bindings`."""
    hw = Hardware.of(config)
    segments, cut_bytes = segment_table(plan.gm, liveness(plan.gm), plan.cuts, bindings, hw)
    costs = _Costs(segments, cut_bytes, num_devices=plan.num_devices, num_microbatches=plan.num_microbatches,
                   memory_budget=None, upload_bw=hw.upload_bw, job_overhead_s=hw.job_overhead_s(plan.num_devices),
                   max_jobs=None)
    memory = [costs.job_mem(kind, i, j) for kind, (i, j) in plan.stage_plan.jobs()]
    return resident_memory(memory, job_weights(segments, plan.stage_plan), plan.prefetch_bytes,
                           len(plan.stage_plan.fwd_bounds), 1 if plan.replicas > 1 else plan.num_devices,
                           plan.early_first_upload)     # (a replica's jobs all run on its device)
