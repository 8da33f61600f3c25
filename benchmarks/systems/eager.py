"""Resident eager PyTorch: the whole model on one GPU (fp32 weights, bf16 autocast), HF gradient
checkpointing, gradient accumulation over the microbatches, fused AdamW on the GPU.

Everything (weights, gradients, Adam state: 16 bytes a parameter) stays on the GPU: the
baseline for models that fit. Also runs on CPU (--device cpu) for the tests.
"""
from __future__ import annotations

import torch

from ..common import Trainer, accumulate_and_step, adamw_kwargs, build_model, count_params, enable_checkpointing


class EagerTrainer(Trainer):
    def __init__(self, spec, rank=0, world=1):
        self.dev = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        self.model = build_model(spec.spec, dtype=torch.float32, device=self.dev,
                                 max_positions=spec.max_positions, seed=spec.seed, lora=spec.lora)
        enable_checkpointing(self.model)
        self.n_params = count_params(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(spec), fused=True)
        self.m = spec.microbatches if spec.mode != "maxseq" else 1

    def step(self, ids):
        return accumulate_and_step(self.model, self.opt, ids, self.m, self.dev, autocast=True)

    def recover(self):
        self.opt.zero_grad(set_to_none=True)

    def info(self):
        return {"notes": [f"fp32 weights + bf16 autocast, AdamW(fused) on {self.dev.type}"]}


def make_trainer(spec, rank=0, world=1):
    return EagerTrainer(spec, rank, world)
