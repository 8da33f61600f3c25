"""The benchmarked systems: one small runner module each, all driven by common.run_trainer.

The harness reads this table without importing the runners (they import torch, rpcompile,
roundpipe...); a child process imports the one runner it runs.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    name: str
    module: str
    needs_cuda: bool          # GPU-only systems report "skipped: needs CUDA" in CPU mode
    multi_gpu: bool           # False: a one-GPU baseline, skipped when more GPUs are asked for
    env: str                  # "default", or "roundpipe": transformers 4.57 first on PYTHONPATH
    # Rough host / resident-GPU bytes per parameter, for the fit checks that spare the machine
    # (and the time budget) runs that cannot fit. fp32 master 4 + fp32 grad 4 + Adam 8 = 16.
    host_bytes_per_param: float
    gpu_bytes_per_param: float
    label: str
    options: tuple = ()       # (key, value) pairs put into RunSpec.options (before --option)
    # Stage jobs rotate over the GPUs, and each (stage, GPU) pair compiles its Inductor code on
    # its first use: the default warm-up is then at least one step per GPU (harness.default_warmup).
    rotates_over_gpus: bool = False


def _rpcompile(name: str, label: str, **options) -> System:
    """rpcompile with options (rpcompile_runner.config_options turns them into Config fields).
    With an attached optimizer it plans its host memory within what the host has, the AdamW
    state it has no room for going to the GPUs (Note [host room] in rpcompile/passes/host_memory.py),
    so only the rest must fit: fp32 master 4 + bf16 gradients 2 + bf16 working copies 2 (two in
    delayed mode)."""
    attached = 4 + 2 + 2 * (2 if options.get("rpcompile_delayed") else 1)
    host = attached if options.get("rpcompile_delayed") or options.get("rpcompile_overlapped") else 16 + 2
    return System(name, "benchmarks.systems.rpcompile_runner", needs_cuda=False, multi_gpu=True, env="default",
                  host_bytes_per_param=host, gpu_bytes_per_param=0, label=label,
                  options=tuple(sorted(options.items())), rotates_over_gpus=True)


SYSTEMS = {
    "rpcompile": _rpcompile("rpcompile", "rpcompile (host fp32 master + AdamW(fused), bf16 stages)"),
    "rpcompile-call": _rpcompile("rpcompile-call",
                                 "rpcompile, each step cm(...).loss.backward(); opt.step(): the differentiable call, "
                                 "exact mode", rpcompile_call="1"),
    "rpcompile-overlapped": _rpcompile("rpcompile-overlapped",
                                       "rpcompile, Config(optimizer_mode='overlapped') + cm.attach_optimizer(AdamW)",
                                       rpcompile_overlapped="1"),
    "rpcompile-delayed": _rpcompile("rpcompile-delayed",
                                    "rpcompile, Config(optimizer_mode='delayed') + cm.attach_optimizer(AdamW)",
                                    rpcompile_delayed="1"),
    "rpcompile-delayed-proc": _rpcompile("rpcompile-delayed-proc",
                                         "rpcompile, Config(optimizer_mode='delayed', workers='processes') + "
                                         "cm.attach_optimizer(AdamW)", rpcompile_delayed="1", rpcompile_processes="1"),
    "rpcompile-delayed-threads": _rpcompile("rpcompile-delayed-threads",
                                            "rpcompile, Config(optimizer_mode='delayed', workers='threads') + "
                                            "cm.attach_optimizer(AdamW)", rpcompile_delayed="1", rpcompile_threads="1"),
    "rpcompile-delayed-dp": _rpcompile("rpcompile-delayed-dp",
                                       "rpcompile, Config(optimizer_mode='delayed', data_parallel=True) + "
                                       "cm.attach_optimizer(AdamW): replicas on worker threads", rpcompile_delayed="1",
                                       rpcompile_data_parallel="1", rpcompile_threads="1"),
    "rpcompile-delayed-dp-proc": _rpcompile("rpcompile-delayed-dp-proc",
                                            "rpcompile, Config(optimizer_mode='delayed', data_parallel=True, "
                                            "workers='processes') + cm.attach_optimizer(AdamW): replicas in worker "
                                            "processes", rpcompile_delayed="1", rpcompile_data_parallel="1",
                                            rpcompile_processes="1"),
    "rpcompile-delayed-pipe": _rpcompile("rpcompile-delayed-pipe",
                                         "rpcompile, Config(optimizer_mode='delayed', data_parallel=False) + "
                                         "cm.attach_optimizer(AdamW): the pipeline, never replicas",
                                         rpcompile_delayed="1", rpcompile_pipeline="1"),
    "rpcompile-delayed-ondev": _rpcompile("rpcompile-delayed-ondev",
                                          "rpcompile, Config(optimizer_mode='delayed', optimizer_on_devices=1.0) + "
                                          "cm.attach_optimizer(AdamW)", rpcompile_delayed="1",
                                          rpcompile_optimizer_on_devices="1.0"),
    "rpcompile-delayed-host": _rpcompile("rpcompile-delayed-host",
                                          "rpcompile, Config(optimizer_mode='delayed', optimizer_on_devices=0.0) + "
                                          "cm.attach_optimizer(AdamW): every update on the host",
                                          rpcompile_delayed="1", rpcompile_optimizer_on_devices="0.0"),
    "rpcompile-p2p": _rpcompile("rpcompile-p2p", "rpcompile, Config(peer_transfers=True)", rpcompile_peer="1"),
    "rpcompile-overlapped-p2p": _rpcompile("rpcompile-overlapped-p2p",
                                           "rpcompile, Config(optimizer_mode='overlapped', peer_transfers=True)",
                                           rpcompile_overlapped="1", rpcompile_peer="1"),
    "eager": System("eager", "benchmarks.systems.eager", needs_cuda=False, multi_gpu=False, env="default",
                    host_bytes_per_param=0, gpu_bytes_per_param=16,
                    label="resident eager PyTorch, 1 GPU, HF checkpointing, bf16 autocast, fp32 AdamW(fused)"),
    "roundpipe": System("roundpipe", "benchmarks.systems.roundpipe_runner", needs_cuda=True, multi_gpu=True,
                        env="roundpipe", host_bytes_per_param=16 + 2 + 2,
                        label="RoundPipe 0.1.1 (bf16 model, fp32 optim copy + its CPU Adam)",
                        gpu_bytes_per_param=0),
    "roundpipe-sync": System("roundpipe-sync", "benchmarks.systems.roundpipe_runner", needs_cuda=True, multi_gpu=True,
                             env="roundpipe", host_bytes_per_param=16 + 2 + 2,
                             label="RoundPipe 0.1.1, model.step(is_async=False): no 1-step-stale parameters",
                             gpu_bytes_per_param=0, options=(("roundpipe_sync", "1"),)),
    "fsdp2": System("fsdp2", "benchmarks.systems.fsdp2", needs_cuda=True, multi_gpu=True, env="default",
                    host_bytes_per_param=16 + 4, gpu_bytes_per_param=0,
                    label="FSDP2 + CPUOffloadPolicy, bf16/fp32 mixed precision, checkpointing, CPU AdamW(fused)"),
    # a pretend system (no model) that fails on demand: the harness's own tests
    "simulated": System("simulated", "benchmarks.systems.simulated", needs_cuda=False, multi_gpu=True,
                        env="default", host_bytes_per_param=0, gpu_bytes_per_param=0,
                        label="simulated (harness tests)"),
}


def get_system(name: str) -> System:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}") from None


def load_runner(name: str):
    return importlib.import_module(get_system(name).module)
