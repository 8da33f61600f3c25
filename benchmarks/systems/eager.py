"""Resident eager PyTorch: the whole model on one GPU (fp32 weights, bf16 autocast), HF gradient
checkpointing, gradient accumulation over the microbatches, fused AdamW on the GPU.

Everything (weights, gradients, Adam state: 16 bytes a parameter) stays on the GPU: the
baseline for models that fit. Also runs on CPU (--device cpu) for the tests.
"""
from __future__ import annotations

import torch

from ..common import LR, Trainer, build_model, count_params, enable_checkpointing, microbatches


class EagerTrainer(Trainer):
    def __init__(self, spec, rank=0, world=1):
        self.dev = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        self.model = build_model(spec.spec, dtype=torch.float32, device=self.dev,
                                 max_positions=spec.max_positions, seed=spec.seed)
        enable_checkpointing(self.model)
        self.n_params = count_params(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        self.m = spec.microbatches if spec.mode == "throughput" else 1

    def step(self, ids):
        total = torch.zeros((), device=self.dev)
        for chunk, weight in microbatches(ids, self.m):
            chunk = chunk.to(self.dev, non_blocking=True)
            with torch.autocast(self.dev.type, dtype=torch.bfloat16):
                loss = self.model(input_ids=chunk, labels=chunk).loss
            (loss * weight).backward()
            total += loss.detach().float() * weight
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total)

    def recover(self):
        self.opt.zero_grad(set_to_none=True)

    def info(self):
        return {"notes": [f"fp32 weights + bf16 autocast, AdamW(fused) on {self.dev.type}"]}


def make_trainer(spec, rank=0, world=1):
    return EagerTrainer(spec, rank, world)
