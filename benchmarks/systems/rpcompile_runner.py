"""rpcompile: weights, gradients and AdamW state on the host; stage jobs rotate over the GPUs.

    cm = rpcompile.compile(model, config=rpcompile.Config(devices=[...], num_microbatches=M,
                                                          dtype=torch.bfloat16))
    loss = cm.train_step(input_ids=ids, labels=ids); opt.step(); opt.zero_grad()

The host masters are the model's fp32 parameters; AdamW(fused=True) steps them on the CPU.
System "rpcompile-overlapped" (option rpcompile_overlapped=1) uses Config(optimizer_mode=
"overlapped") and cm.attach_optimizer(opt): rpcompile steps AdamW in a host thread beside the
next step's jobs (RoundPipe's step is asynchronous too). With --device cpu the same runs on CPU
"devices" (threads), for the tests.
"""
from __future__ import annotations

import torch

from ..common import GiB, LR, Trainer, build_model, count_params


class RPCompileTrainer(Trainer):
    def __init__(self, spec, rank=0, world=1):
        import rpcompile

        self._planning_error = rpcompile.PlanningError
        on_gpu = spec.device == "cuda"
        self.model = build_model(spec.spec, dtype=torch.float32, device="cpu",
                                 init_device="cuda:0" if on_gpu else "cpu",
                                 max_positions=spec.max_positions, seed=spec.seed)
        self.n_params = count_params(self.model)
        devices = [f"cuda:{i}" for i in range(spec.gpus)] if on_gpu else ["cpu"] * spec.gpus
        extra = {}
        if spec.mode == "maxseq" and on_gpu:
            extra["memory_budget"] = int(spec.mem_cap_gib * GiB)    # plan for the capped card
        m = spec.microbatches if spec.mode == "throughput" else 1
        # overlapped: rpcompile steps the optimizer itself in a host thread, beside the next step
        self.overlapped = str(spec.options.get("rpcompile_overlapped", "0")) == "1"
        if self.overlapped:
            extra["optimizer_mode"] = "overlapped"
        self.config = rpcompile.Config(devices=devices, num_microbatches=m, dtype=torch.bfloat16, **extra)
        self.cm = rpcompile.compile(self.model, config=self.config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        if self.overlapped:
            self.cm.attach_optimizer(self.opt)

    def step(self, ids):
        try:
            loss = self.cm.train_step(input_ids=ids, labels=ids)
        except self._planning_error as e:
            # no plan fits the memory budget: for the max-length search that is "out of memory"
            raise torch.OutOfMemoryError(f"rpcompile planning: out of memory budget: {e}") from e
        if not self.overlapped:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return float(loss)

    def finish(self):
        self.cm.synchronize()               # the overlapped optimizer's last step (no-op in exact mode)
        super().finish()

    def recover(self):
        if not self.overlapped:
            self.opt.zero_grad(set_to_none=True)

    def info(self):
        out = {"config": {"devices": [str(d) for d in self.config.devices],
                          "num_microbatches": self.config.num_microbatches, "dtype": "bfloat16",
                          "memory_budget": self.config.memory_budget,
                          "optimizer_mode": self.config.optimizer_mode}}
        plan = self.cm.plan
        if plan is not None:
            rows = plan.stage_rows()
            out.update(plan=str(plan), stage_jobs=len(rows), plan_est_step_s=float(plan.est_step_time),
                       # each stage job uploads its weights once per step (DESIGN.md)
                       plan_weight_upload_bytes_per_step=int(sum(r["param_bytes"] for r in rows)),
                       # gradients come down once per backward/fused stage job (same dtype assumed)
                       plan_grad_download_bytes_per_step_est=int(sum(r["param_bytes"] for r in rows
                                                                      if r["kind"] in ("bwd", "fused"))))
        try:
            trace = getattr(self.cm, "last_trace", None)
        except Exception as e:  # noqa: BLE001 - optional figure
            trace, out["trace_error"] = None, f"{type(e).__name__}: {e}"
        if trace:
            out["trace"] = trace_summary(trace)
        return out


def trace_summary(spans) -> dict:
    """cm.last_trace (the executed schedule of the last step: span dicts with device, stream,
    name, start_s, end_s) summed per stream and span name: busy seconds and counts, bytes where
    spans carry them. Weights, activations in and results out are the PCIe streams."""
    busy, count, nbytes = {}, {}, {}
    first, last = float("inf"), 0.0
    for sp in spans:
        key = f"{sp.get('stream')}/{sp.get('name')}"
        start, end = float(sp.get("start_s", 0.0)), float(sp.get("end_s", 0.0))
        busy[key] = busy.get(key, 0.0) + max(0.0, end - start)
        count[key] = count.get(key, 0) + 1
        first, last = min(first, start), max(last, end)
        for k, v in sp.items():
            if "bytes" in k and isinstance(v, (int, float)):
                nbytes[key] = nbytes.get(key, 0) + v
    out = {"spans": len(spans), "step_span_s": max(0.0, last - first) if spans else 0.0,
           "busy_s": busy, "count": count}
    if nbytes:
        out["bytes"] = nbytes
    return out


def make_trainer(spec, rank=0, world=1):
    return RPCompileTrainer(spec, rank, world)
