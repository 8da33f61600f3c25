"""The host memory a step of a plan needs, by kind, from the plan alone (what `cm.plan` prints).

Per parameter: the master (the user's tensor), its gradient (in its dtype), the optimizer's
state (AdamW: two fp32 moments; the optimizer is not known at compile time, so AdamW is
assumed and said), the working copies the devices upload from (pinned, in the compute dtype,
on GPUs; two of them in delayed mode), and in overlapped/delayed mode one more step's gradients
in flight while the optimizer works on the last ones. Per step: the activations and
checkpoints the jobs hand on through the host, per microbatch times the microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass


ADAMW_STATE_BYTES = 8      # exp_avg and exp_avg_sq in fp32, per trainable parameter


@dataclass
class HostMemory:
    masters: int
    grads: int
    optimizer_state: int
    working_copies: int
    grads_in_flight: int
    activations: int
    num_params: int

    @property
    def total(self) -> int:
        return (self.masters + self.grads + self.optimizer_state + self.working_copies + self.grads_in_flight
                + self.activations)

    def rows(self) -> list:
        return [("master weights", self.masters), ("gradients", self.grads),
                ("optimizer state (AdamW assumed)", self.optimizer_state),
                ("working copies for upload", self.working_copies),
                ("gradients in flight (overlapped/delayed)", self.grads_in_flight),
                ("activations and checkpoints per step", self.activations)]

    def summary(self) -> str:
        from ..plan import _fmt_bytes
        per = self.total / max(1, self.num_params)
        parts = ", ".join(f"{name} {_fmt_bytes(b)}" for name, b in self.rows() if b)
        return f"host memory {_fmt_bytes(self.total)} ({per:.1f} B/param): {parts}"


def host_memory(plan, compute_dtype, on_gpu: bool, optimizer_mode: str) -> HostMemory:
    params = plan.captured.params
    trainable = [p for p in params if p.requires_grad]
    masters = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    state = sum(p.numel() for p in trainable) * ADAMW_STATE_BYTES
    copies = 0
    if on_gpu or optimizer_mode == "delayed":
        for p in params:
            itemsize = (compute_dtype or p.dtype).itemsize if p.is_floating_point() else p.element_size()
            copies += p.numel() * itemsize * (2 if optimizer_mode == "delayed" and p.requires_grad else 1)
    in_flight = grads if optimizer_mode != "exact" else 0
    by_name = {n.name: n for n in plan.gm.graph.nodes}
    per_micro = sum(plan.value_bytes(by_name.get(name)) for st in plan.stages for name in st.handed_on)
    return HostMemory(masters, grads, state, copies, in_flight, int(per_micro) * plan.num_microbatches,
                      sum(p.numel() for p in params))
