"""RoundPipe 0.1.1 (PyPI), called as ANCHORS.md records:

    model = wrap_model_to_roundpipe(model, optim_dtype=torch.float32, use_sequential_preset=True,
                                    model_run_config=RoundPipeRunConfig(num_microbatch=M))
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=LR, weight_decay=0.01, decoupled_weight_decay=True)
    loss = model.forward_backward(input_kwargs={..., "return_logits": False},
                                  loss_fn=lambda o, _: o.loss / M)
    model.step(lambda: (opt.step(), opt.zero_grad()))          # is_async=True, RoundPipe's default

The model is bf16 on the host (RoundPipe uploads the parameters as they are); optim_dtype=fp32
gives the fp32 master copy its Adam steps; decoupled_weight_decay makes that Adam the same AdamW
(lr, weight decay 0.01) that every other system steps, so loss curves compare step for step.
Runs in its own process with transformers 4.57 first on PYTHONPATH (its presets use the 4.x
masking API). model.step() is asynchronous by default: a step's forward uses the parameters
from before the previous step's update (RoundPipe's documented 1-step staleness), so its loss
curve lags eager's by design; system "roundpipe-sync" (option roundpipe_sync=1) passes
is_async=False, which makes every step use the latest parameters. roundpipe.optim.Adam
compiles a C++ kernel with g++/ninja at first use (cached under TORCH_EXTENSIONS_DIR). Steps are
timed start to start and finish() waits for the last optimizer step.
"""
from __future__ import annotations

import torch

from ..common import GiB, Trainer, adamw_kwargs, build_model, count_params


def _pretend_card_of(cap_bytes: float) -> None:
    """Make RoundPipe plan for a card of `cap_bytes` (it sizes stages from mem_get_info at import)."""
    real = torch.cuda.mem_get_info

    def mem_get_info(device=None):
        free, total = real(device)
        return max(0, min(free, int(cap_bytes) - torch.cuda.memory_reserved(device))), min(total, int(cap_bytes))

    torch.cuda.mem_get_info = mem_get_info


class RoundPipeTrainer(Trainer):
    # RoundPipe's worker threads end the process on an error; after an OOM raised in this thread
    # its pipeline state is not known to be sound either, so a max-length search restarts.
    restart_after_oom = True

    def __init__(self, spec, rank=0, world=1):
        if spec.device != "cuda":
            raise RuntimeError("RoundPipe needs CUDA")
        self.notes = []
        self.is_async = str(spec.options.get("roundpipe_sync", "0")) != "1"
        if not self.is_async:
            self.notes.append("model.step(..., is_async=False): every step uses the latest parameters")
        elif spec.mode == "losscurve":
            self.notes.append("async model.step: each step's forward uses 1-step-old parameters (RoundPipe's design)")
        if spec.mode == "maxseq":
            _pretend_card_of(spec.mem_cap_gib * GiB)
            self.notes.append(f"torch.cuda.mem_get_info reports a {spec.mem_cap_gib:g} GiB card to RoundPipe's planner")
        import roundpipe
        from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

        model = build_model(spec.spec, dtype=torch.bfloat16, device="cpu", init_device="cuda:0",
                            max_positions=spec.max_positions, seed=spec.seed, lora=spec.lora)
        self.n_params = count_params(model)
        self.m = spec.microbatches if spec.mode != "maxseq" else 1
        self.model = wrap_model_to_roundpipe(model, optim_dtype=torch.float32, use_sequential_preset=True,
                                             model_run_config=RoundPipeRunConfig(num_microbatch=self.m))
        try:
            # decoupled weight decay: the same AdamW as every other system (adamw_kwargs)
            self.opt = roundpipe.optim.Adam(self.model.optim_parameters(), **adamw_kwargs(spec),
                                            decoupled_weight_decay=True)
        except Exception as e:  # noqa: BLE001 - no compiler on the machine: say so, measure anyway
            if spec.options.get("roundpipe_strict_adam"):
                raise
            self.notes.append(f"roundpipe.optim.Adam did not build ({type(e).__name__}: {str(e)[:200]}); "
                              "used torch.optim.AdamW(fused=True) on the host instead")
            self.opt = torch.optim.AdamW(self.model.optim_parameters(), **adamw_kwargs(spec), fused=True)

    def step(self, ids):
        m, opt = self.m, self.opt
        loss = self.model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False},
                                           loss_fn=lambda o, _: o.loss / m)
        self.model.step(lambda: (opt.step(), opt.zero_grad()), is_async=self.is_async)
        return float(loss)

    def finish(self):
        self.model.optim_updated.wait()
        super().finish()

    def info(self):
        from importlib.metadata import version
        return {"notes": self.notes, "roundpipe": version("roundpipe"),
                "optimizer": type(self.opt).__module__ + "." + type(self.opt).__name__}


def make_trainer(spec, rank=0, world=1):
    return RoundPipeTrainer(spec, rank, world)
