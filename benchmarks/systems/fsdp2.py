"""FSDP2 with CPU offload: `fully_shard` on every decoder layer and on the root, with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and CPUOffloadPolicy(pin_memory=True);
HF activation checkpointing; fused AdamW stepping the fp32 shards on the CPU. One process per
GPU (torch.multiprocessing + NCCL), each taking 1/world of the step's sequences, accumulating
gradients over the microbatches (reduce-scatter after each, as FSDP2 does by default).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..common import (Recorder, RunSpec, Trainer, accumulate_and_step, adamw_kwargs, build_model, count_params,
                      enable_checkpointing, run_trainer)


class FSDP2Trainer(Trainer):
    def __init__(self, spec, rank=0, world=1):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        cuda = spec.device == "cuda"
        self.dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        # built on the GPU: fully_shard moves every state to the mesh device anyway, then the
        # offload policy moves the fp32 shards to pinned host memory
        model = build_model(spec.spec, dtype=torch.float32, device=self.dev, max_positions=spec.max_positions,
                            seed=spec.seed, lora=spec.lora)
        self.n_params = count_params(model)
        enable_checkpointing(model)
        kwargs = {"mesh": init_device_mesh(self.dev.type, (world,)),
                  "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if cuda:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(spec), fused=True)
        self.m = spec.microbatches if spec.mode != "maxseq" else 1

    def step(self, ids):
        # FSDP2's MixedPrecisionPolicy casts to bf16 itself: no autocast
        return accumulate_and_step(self.model, self.opt, ids, self.m, self.dev, autocast=False)

    def recover(self):
        self.opt.zero_grad(set_to_none=True)


def make_trainer(spec, rank=0, world=1):
    return FSDP2Trainer(spec, rank, world)


def run(spec: RunSpec, rec: Recorder) -> None:
    """Spawn one process per GPU; rank 0 writes the result file."""
    if spec.device != "cuda" and not spec.options.get("fsdp_on_cpu"):
        raise RuntimeError("FSDP2 + CPUOffloadPolicy needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec.update(phase="spawn")
    mp.spawn(_rank_main, args=(spec.to_json(), port), nprocs=spec.gpus, join=True)
    rec.reload()


def _rank_main(rank: int, spec_json: str, port: int) -> None:
    spec = RunSpec.from_json(spec_json)
    world = spec.gpus
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def reduce(values, op):
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return t.tolist()

    try:
        run_trainer(make_trainer, spec, Recorder(spec.result_path, resume=True) if rank == 0 else None,
                    rank=rank, world=world, devices=[dev] if cuda else [],
                    reduce_max=lambda xs: reduce(xs, dist.ReduceOp.MAX),
                    reduce_mean=lambda xs: [x / world for x in reduce(xs, dist.ReduceOp.SUM)])
    finally:
        dist.destroy_process_group()
