"""Plans for H200s made on the CPU, for the planning scripts under benchmarks/runs/ (share_by_pace,
whole_share, microbatches): a model of benchmarks.common built on the meta device and captured on
fake tensors at seq 2048, planned as on GPUs (`as_on_gpu`) with the memory budget the H200 plans
printed (125.3 GiB). Run those scripts from the repository root."""
from __future__ import annotations

import torch

import rpcompile
from benchmarks.common import batch_ids, build_model, get_model
from rpcompile.capture import capture_call

H200_BUDGET = int(125.3 * 2**30)


def as_on_gpu() -> None:
    """Plan as on GPUs (replicas weighed, the optimizer's share chosen) though the devices are "cpu"."""
    rpcompile.Config.on_gpu = property(lambda self: True)
    rpcompile.Config.repeats_a_gpu = property(lambda self: False)


def capture(name: str, rows: int = 32, seq: int = 2048):
    """Model `name` captured for a batch of `rows` sequences of `seq` tokens, with labels."""
    spec = get_model(name)
    model = build_model(spec, init_device="meta", device="meta", max_positions=seq)
    ids = batch_ids(spec.vocab, rows, seq, step=0)
    return capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")


def config(num_devices: int, num_microbatches: int, **kw) -> rpcompile.Config:
    """A delayed-mode bf16 Config for `num_devices` H200s."""
    return rpcompile.Config(devices=["cpu"] * num_devices, num_microbatches=num_microbatches, dtype=torch.bfloat16,
                            optimizer_mode="delayed", memory_budget=H200_BUDGET, **kw)
