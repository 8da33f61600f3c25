"""Config: what the user chooses (devices, microbatches, precision, memory budget, loss)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(value, name: str = "memory_budget") -> Optional[int]:
    """Turn 24 * 2**30, "24GiB" or "24 GB" into a number of bytes (None stays None); `name` is
    the setting the error names."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size: write e.g. 24 * 2**30 or '24GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class Config:
    """How a model is compiled and run.

    devices: where stage jobs run, e.g. ["cuda:0", "cuda:1"] or ["cpu", "cpu"] (threads).
    num_microbatches: the batch (dim 0 of every batched input) is split into this many.
    dtype: compute dtype of the working copies on the devices; None means the model's own
        dtype on CPU devices and bfloat16 on GPUs. Host masters keep the model's own dtype.
    memory_budget: bytes (or "24GiB") a stage job may use on one device; None: 0.9 of the
        device's free memory when the model's first plan is made, kept by its later plans, on
        GPUs (set it where other code allocates on the devices later); unlimited on CPU.
    host_memory_budget: bytes (or "100GiB") of host memory the model's first train plan may
        take in all, its parameters included (what `cm.plan` prints as "host memory"). Where
        the plan would take more, more of the attached optimizer goes to the GPUs (where the
        plan chooses the share: optimizer_on_devices=None), else planning stops with an error
        that says what to change, before anything is allocated (Note [host room] in
        passes/host_memory.py); later calls at other sizes (longer sequences: more activations
        on the host) are held to it too. None (the default): the host memory available at that plan
        (the smaller of the system's and the cgroup's) plus what the parameters hold already,
        less 8 GiB and a tenth of the host's memory for what the process and
        the system allocate besides.
    loss_fn: loss_fn(output, target) when the model does not return its own loss.
    lm_head_shards: vocabulary shards of the LM head (None: chosen from the cost model,
        0: leave the head whole).
    optimizer_mode: "exact" (gradients land, then the user steps), "overlapped" (rpcompile
        steps the attached optimizer beside the next step, whose jobs wait for the parameters
        they read: results equal exact mode) or "delayed" (the next step does not wait: step t
        computes its gradients at the parameters after optimizer steps 0..t-2, one step of
        delay as RoundPipe's asynchronous step; deterministic, not equal to eager training).
    optimizer_on_devices: the share (0 to 1) of the trainable parameters whose attached
        optimizer (Adam, AdamW, SGD) steps on the devices (overlapped and delayed modes): an fp32
        copy of their masters and their optimizer state stay on the devices, split evenly among
        them, so the host does less of each step's update and holds less state (Note [optimizer
        state on the devices] in runtime/flat.py). The planner leaves that memory (AdamW: 12
        bytes a parameter) out of each device's budget. 0: every update on the host. None (the
        default): on GPUs, the first plan chooses the largest share that fits in half of
        what its stage jobs leave of each device's budget, and a later plan that does not fit
        beside it (a longer sequence) brings the state back to the host (Note [optimizer share
        by room] in passes/host_memory.py); 0 on CPU devices and in exact mode.
    peer_transfers: a boundary activation the next stage job reads goes GPU to GPU where peer
        access exists (the host still gets a copy if a later job reads it), instead of through
        host memory.
    unbatched_inputs: names of call arguments (keywords, or positional indices) whose tensors are
        not split into microbatches although their dim 0 may equal the batch size; every other
        tensor argument with dim 0 == the batch size is split (Note [batched inputs]).
    dynamic_lengths: the sequence length (dim 1 of the first tensor argument) is symbolic in the
        capture, so one capture, plan and set of stage programs serve every length (Note
        [dynamic lengths] in lengths.py); False: each new length is captured and planned anew.
    workers: "threads" (one worker thread per device, in this process) or "processes" (one
        worker process per device: Note [worker processes] in runtime/worker.py; host buffers
        in shared memory; several GPUs launch their kernels in parallel instead of taking turns
        under one interpreter lock). None (the default): processes on two or more GPUs (4x H200,
        Qwen3-1.7B, delayed mode, one run: 97,279 tokens/s against 79,821 with threads), threads
        on one GPU, on CPU devices, with peer_transfers, and for replicas of a GPU named twice.
    data_parallel: whether each device may run a copy of the one-device plan over its share of
        the microbatches, the copies' gradients summed on the devices before they come down
        (Note [replicas] in runtime/replicas.py), instead of the stage jobs of one pipeline
        handed round-robin. None (the default): the planner weighs both and takes the faster
        on GPUs (peer_transfers off; 2x H200, Qwen3-1.7B, delayed mode, one run: replicas in
        worker processes 80,112 tokens/s, the pipeline 71,175); True: the
        replicas wherever there is a microbatch for every device (in worker processes by
        default on two or more GPUs, as with None, the copies summing in a process group of the
        workers: Note [replicas in worker processes]; threads where a GPU is named twice); False:
        never.
    split_microbatches: whether the model's first train plan may split each of the
        num_microbatches further (2, 4, ... parts) where that makes the stage jobs recompute
        nothing and is estimated clearly faster (Note [finer microbatches] in passes/__init__.py);
        the plan then splits every batch into that many (`cm.plan` says). None (the default): on
        GPUs, into a count whose plan runs the whole model as one fused job a device (one GPU's
        plan or copies of it), the kind measured faster (copies of three jobs on 2 GPUs at 8
        microbatches were slower, their weights going up behind a short job); True: on any
        devices, CPU devices too, any count estimated faster; False: never, a batch is split into
        num_microbatches.
    inductor_options: options for Inductor when it compiles stage compute (torch.compile's
        `options`), e.g. {"cpp_wrapper": True}: kernels launched from C++ rather than Python,
        less host time per launch where many devices share one Python thread of control.
        {"triton.autotune_pointwise": False} shortens a first step with cold compile caches
        (Qwen3-1.7B, 2 H200s: setup 43.5-50.5 s against 56.0-60.4 s) but ran steps 1.4-2.6%
        slower on one H200 (48th session, RESULTS.md), so rpcompile leaves Inductor's default,
        autotuning, which a warm cache does not repeat.
    captures_kept: how many captures (each with its plans and compiled stage programs) are kept
        for calls alike but for the sizes or the Python values the forward reads (a Dropout's p,
        a flag); past it the least recently used is dropped, as torch.compile bounds its
        recompiles (torch._dynamo.config.recompile_limit, also 8): Note [captures kept] in
        plan_cache.py.
    """

    devices: Sequence[str] = ("cpu",)
    num_microbatches: int = 1
    dtype: Optional[torch.dtype] = None
    memory_budget: Optional[object] = None
    loss_fn: Optional[Callable] = None
    lm_head_shards: Optional[int] = None
    optimizer_mode: str = "exact"
    optimizer_on_devices: Optional[float] = None
    compile_stages: Optional[bool] = None   # Inductor for stage compute; None: on for GPUs
    dump_dir: Optional[str] = None
    max_jobs: Optional[int] = None
    peer_transfers: bool = False
    inductor_options: Optional[dict] = None
    unbatched_inputs: Sequence = ()
    dynamic_lengths: bool = True
    workers: Optional[str] = None
    data_parallel: Optional[bool] = None
    split_microbatches: Optional[bool] = None
    host_memory_budget: Optional[object] = None
    captures_kept: int = 8

    def __post_init__(self):
        if isinstance(self.devices, (str, torch.device)):
            self.devices = [self.devices]
        self.devices = [torch.device(d) for d in self.devices]
        if not self.devices:
            raise ValueError("Config.devices is empty: name at least one device, e.g. ['cpu'] or ['cuda:0']")
        kinds = {d.type for d in self.devices}
        if len(kinds) > 1:
            raise ValueError(f"Config.devices mixes device types {sorted(kinds)}: use only GPUs or only CPUs")
        for d in self.devices:
            if d.type == "cuda":
                if not torch.cuda.is_available():
                    raise ValueError(f"Config.devices names {d} but no CUDA device is available: use devices=['cpu']")
                if d.index is not None and d.index >= torch.cuda.device_count():
                    raise ValueError(f"Config.devices names {d} but only {torch.cuda.device_count()} GPU(s) exist")
            elif d.type != "cpu":
                raise ValueError(f"Config.devices: device type {d.type!r} is not supported (use cpu or cuda)")
        self.devices = [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in self.devices]
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(f"Config.num_microbatches={self.num_microbatches!r}: give an int >= 1")
        if isinstance(self.captures_kept, bool) or not isinstance(self.captures_kept, int) or self.captures_kept < 1:
            raise ValueError(f"Config.captures_kept={self.captures_kept!r}: give an int >= 1")
        self.memory_budget = parse_bytes(self.memory_budget)
        self.host_memory_budget = parse_bytes(self.host_memory_budget, "host_memory_budget")
        if isinstance(self.unbatched_inputs, (str, int)):
            self.unbatched_inputs = (self.unbatched_inputs,)
        self.unbatched_inputs = tuple(self.unbatched_inputs)
        if self.inductor_options is not None and not isinstance(self.inductor_options, dict):
            raise ValueError(f"Config.inductor_options={self.inductor_options!r}: give a dict of Inductor options, "
                             "e.g. {'cpp_wrapper': True}")
        if self.split_microbatches not in (None, True, False):
            raise ValueError(f"Config.split_microbatches={self.split_microbatches!r}: give True, False or None (the "
                             "planner splits finer on GPUs where that makes one fused job a device and is faster)")
        if self.data_parallel not in (None, True, False):
            raise ValueError(f"Config.data_parallel={self.data_parallel!r}: give True, False or None (the planner "
                             "chooses)")
        if self.workers is None:
            multi_gpu = self.on_gpu and len(self.devices) > 1
            # (replicas of a GPU named twice cannot sum between processes: threads there)
            processes = multi_gpu and not self.peer_transfers and not (self.data_parallel and self.repeats_a_gpu)
            self.workers = "processes" if processes else "threads"
        if self.workers not in ("threads", "processes"):
            raise ValueError(f"Config.workers={self.workers!r}: use 'threads' or 'processes'")
        if self.data_parallel and self.peer_transfers:
            raise ValueError("Config(data_parallel=True) and peer_transfers=True ask for two different plans: replicas "
                             "keep every job's activations on its own device; choose one")
        if self.workers == "processes" and self.data_parallel and self.repeats_a_gpu:
            raise ValueError("Config(data_parallel=True, workers='processes') with a GPU named twice: the replicas sum "
                             "their gradients through NCCL, one GPU per worker process; name each GPU once, or use "
                             "workers='threads'")
        if self.workers == "processes" and self.peer_transfers:
            raise ValueError("Config(peer_transfers=True) needs workers='threads': worker processes hand values "
                             "on through shared host memory")
        if self.optimizer_mode not in ("exact", "overlapped", "delayed"):
            raise ValueError(f"Config.optimizer_mode={self.optimizer_mode!r}: use 'exact', 'overlapped' or 'delayed'")
        share = self.optimizer_on_devices     # (None: the first plan chooses it)
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0.0 <= share <= 1.0):
            raise ValueError(f"Config.optimizer_on_devices={share!r}: give the share of the parameters whose "
                             "optimizer steps on the devices, a number from 0 to 1 (or None: chosen by the plan)")
        if share and self.optimizer_mode == "exact":
            raise ValueError("Config.optimizer_on_devices needs optimizer_mode='overlapped' or 'delayed' (an attached "
                             "optimizer that rpcompile steps); in exact mode your optimizer.step() runs on the host")

    @property
    def on_gpu(self) -> bool:
        return self.devices[0].type == "cuda"

    @property
    def repeats_a_gpu(self) -> bool:
        """Whether a GPU is named twice (two devices of one GPU: NCCL cannot sum between them)."""
        return self.on_gpu and len(set(self.devices)) < len(self.devices)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype floating weights and inputs are cast to on the devices (None: no cast)."""
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.on_gpu else None
