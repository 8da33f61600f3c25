"""What every benchmarked system shares: models, batches, FLOPs, the timed loop, memory figures.

Used by the harness (parent process) and by the runners (one child process per system).
Imports only torch and the standard library at module level; transformers is imported where a
model is built, so the RoundPipe child picks up the transformers 4.x put first on its
PYTHONPATH while the other children use the machine's own 5.x.

A runner is a module with `make_trainer(spec, rank, world) -> Trainer`; `run_trainer` drives
it through warm-up and timed steps (or the max-sequence search) and writes what it measures
into the child's result file after every step, so a timeout still leaves figures behind.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import resource
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

GiB = 2**30
PEAK_FLOPS_PER_GPU = 790e12          # bf16 matmul, measured per H100/H200 (ANCHORS.md)
LR = 1e-5                            # every system's optimizer: the same AdamW (see adamw_kwargs)
WEIGHT_DECAY = 0.01                  # torch.optim.AdamW's default, decoupled; RoundPipe's Adam is told the same


# --- models -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only causal LM (transformers' Qwen3, Llama or Qwen3-MoE classes)."""

    name: str
    family: str              # "qwen3", "llama" or "qwen3_moe" (every layer's MLP a mixture of experts)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0         # qwen3_moe: experts a layer, top_k of them per token, each of moe_intermediate
    top_k: int = 0
    moe_intermediate: int = 0


MODELS = {
    "qwen3-1.7b": ModelSpec("qwen3-1.7b", "qwen3", hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128,
                            intermediate=6144, vocab=151936, tied=True),
    "llama3.1-8b": ModelSpec("llama3.1-8b", "llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                             intermediate=14336, vocab=128256, tied=False),
    # Llama-3.1-8B's layers, half of them (4.5B parameters): a one-GPU host (128 GiB) holds it, so one
    # H200 measures the microbatch shapes of a 4-GPU Llama-3.1-8B plan (runs/two_row_microbatches/)
    "llama3.1-8b-16l": ModelSpec("llama3.1-8b-16l", "llama", hidden=4096, layers=16, heads=32, kv_heads=8,
                                 head_dim=128, intermediate=14336, vocab=128256, tied=False),
    # Qwen3-32B (32.8B parameters): its LoRA on one GPU, with the frozen base bf16 in host memory
    "qwen3-32b": ModelSpec("qwen3-32b", "qwen3", hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128,
                           intermediate=25600, vocab=151936, tied=False),
    # Qwen3-30B-A3B's layers, 6 of its 48 (4.4B parameters, 0.95B of them active a token): a one-GPU
    # host (128 GiB) holds its full fine-tuning, so one H200 measures a mixture of experts' layers
    "qwen3-30b-a3b-6l": ModelSpec("qwen3-30b-a3b-6l", "qwen3_moe", hidden=2048, layers=6, heads=32, kv_heads=4,
                                  head_dim=128, intermediate=6144, vocab=151936, tied=False, experts=128, top_k=8,
                                  moe_intermediate=768),
    # smoke tests: the same classes, a few hundred thousand parameters
    "tiny": ModelSpec("tiny", "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                      intermediate=128, vocab=512, tied=True),
    "tiny-llama": ModelSpec("tiny-llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                            intermediate=128, vocab=512, tied=False),
    "tiny-moe": ModelSpec("tiny-moe", "qwen3_moe", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                          intermediate=128, vocab=512, tied=False, experts=4, top_k=2, moe_intermediate=32),
}
MODELS["llama-3.1-8b"] = MODELS["llama3.1-8b"]


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(sorted(MODELS))}") from None


def param_count(spec: ModelSpec, active: bool = False) -> int:
    """Parameters of the model, a tied LM head counted once (what model.parameters() yields);
    `active`: those one token computes with (a mixture of experts' top_k experts, not all)."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    attention = h * q + 2 * h * kv + q * h                     # q, k, v, o projections (no biases)
    if spec.experts:                                            # router + each expert's gate, up, down
        mlp = spec.experts * h + (spec.top_k if active else spec.experts) * 3 * h * spec.moe_intermediate
    else:
        mlp = 3 * h * spec.intermediate                         # gate, up, down
    norms = 2 * h + (2 * spec.head_dim if spec.family != "llama" else 0)   # + Qwen3's q_norm, k_norm
    embeddings = spec.vocab * h * (1 if spec.tied else 2)
    return embeddings + spec.layers * (attention + mlp + norms) + h     # + final norm


def _families():
    import transformers

    return {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}


def hf_config(spec: ModelSpec, max_positions: int = 4096):
    """A transformers config of the spec (works with transformers 4.57 and 5.x)."""
    kwargs = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                  max_position_embeddings=max(int(max_positions), 4096), tie_word_embeddings=spec.tied,
                  use_cache=False, attn_implementation="sdpa")
    if spec.experts:         # no router loss (output_router_logits=False): every system's loss the same
        kwargs.update(num_experts=spec.experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True,
                      moe_intermediate_size=spec.moe_intermediate, output_router_logits=False)
    return _families()[spec.family][0](**kwargs)


def build_model(spec: ModelSpec, *, dtype=torch.float32, device="cpu", init_device=None,
                max_positions: int = 4096, seed: int = 0, lora: int = 0) -> torch.nn.Module:
    """The model with random weights (no download), in `dtype` on `device`, in train mode; with
    `lora` > 0, LoRA adapters of that rank on its linear layers (add_lora).

    Weights are drawn on `init_device` (a GPU draws 8B parameters in well under a second; the
    host would take minutes) and then moved to `device`.
    """
    cfg = hf_config(spec, max_positions)
    cls = _families()[spec.family][1]
    init = torch.device(init_device or device)
    torch.manual_seed(seed)
    with torch.device(init):
        model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():              # parameters only: buffers (rotary inv_freq) stay fp32
            p.data = p.data.to(dtype)
    if lora:
        model = add_lora(model, lora)
    model.to(device)
    if init.type == "cuda" and torch.device(device).type != "cuda":
        torch.cuda.synchronize(init)
        torch.cuda.empty_cache()
    model.config.use_cache = False
    model.train()
    return model


def add_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """LoRA adapters of `rank` on every linear layer but the LM head (peft's "all-linear", alpha
    16, as RoundPipe's own LoRA benchmark sets them), in the base weights' dtype; only the
    adapters train. The model keeps its class (peft's LoraModel, not a PeftModel wrapper), so
    every system wraps it as it wraps the full model."""
    from peft import LoraConfig, LoraModel, TaskType

    cfg = LoraConfig(r=rank, lora_alpha=16, target_modules="all-linear", task_type=TaskType.CAUSAL_LM)
    return LoraModel(model, cfg, "default").model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing per decoder layer (non-reentrant); the method was
    renamed in transformers 5 (activation_checkpointing_enable), the old name warns."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- FLOPs --------------------------------------------------------------------------------
def flops_per_token(n_params: int, layers: int, heads: int, head_dim: int, seq_len: int,
                    recompute: bool = False) -> float:
    """Model FLOPs per trained token, 6N + 12·L·H·Q·S (ANCHORS.md); with one recompute of the
    forward, what the hardware does: 8N + 16·L·H·Q·S."""
    a, b = (8, 16) if recompute else (6, 12)
    return a * n_params + b * layers * heads * head_dim * seq_len


def utilisation(tokens_per_s: float, spec: ModelSpec, seq_len: int, gpus: int,
                n_params: Optional[int] = None, peak_flops: float = PEAK_FLOPS_PER_GPU) -> dict:
    """MFU and share of the recompute-inclusive ceiling for a measured throughput (a mixture of
    experts' FLOPs count the experts a token is routed to, not all of them)."""
    n = (n_params or param_count(spec)) - (param_count(spec) - param_count(spec, active=True))
    model = flops_per_token(n, spec.layers, spec.heads, spec.head_dim, seq_len)
    hardware = flops_per_token(n, spec.layers, spec.heads, spec.head_dim, seq_len, recompute=True)
    ceiling = peak_flops * gpus / hardware
    return {"mfu": tokens_per_s * model / (peak_flops * gpus), "ceiling_tokens_per_s": ceiling,
            "ceiling_share": tokens_per_s / ceiling, "model_flops_per_token": model,
            "hardware_flops_per_token": hardware}


# --- batches ------------------------------------------------------------------------------
def batch_ids(vocab: int, n_seqs: int, seq_len: int, step: int, rank: int = 0, seed: int = 0) -> torch.Tensor:
    """Random token ids (also used as labels); the same for every system at a given step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, vocab, (n_seqs, seq_len), generator=g)


def step_batch(spec: "RunSpec", step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """This process's share of the global batch of optimizer step `step`: the global batch is
    the same for every system (same seed, same step), and a process of `world` (FSDP2's ranks)
    takes its contiguous slice of n_seqs / world sequences, so the ranks together train on
    exactly what a one-process system trains on."""
    ids = batch_ids(spec.spec.vocab, spec.n_seqs, spec.seq_len, step=step, seed=spec.seed)
    n_local = spec.n_seqs // world
    return ids[rank * n_local:(rank + 1) * n_local]


def adamw_kwargs(spec: "RunSpec") -> dict:
    """The optimizer hyperparameters every system uses (AdamW: Adam with decoupled weight decay;
    betas and eps at torch's defaults), so loss curves are comparable step for step."""
    return {"lr": spec.lr, "weight_decay": WEIGHT_DECAY}


def microbatches(ids: torch.Tensor, m: int) -> list:
    """(chunk, weight) pairs: weight = the chunk's share of the batch's counted tokens, so
    sum(weight * mean loss of chunk) is the mean loss of the whole batch."""
    chunks = [c for c in torch.tensor_split(ids, min(m, ids.shape[0])) if c.shape[0]]
    return [(c, c.shape[0] / ids.shape[0]) for c in chunks]


def accumulate_and_step(model, opt, ids, m, dev, autocast: bool) -> float:
    """One optimizer step of gradient accumulation over m microbatches (eager and FSDP2)."""
    total = torch.zeros((), device=dev)
    for chunk, weight in microbatches(ids, m):
        chunk = chunk.to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=chunk, labels=chunk).loss
        (loss * weight).backward()
        total += loss.detach().float() * weight
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


# --- what a child writes ------------------------------------------------------------------
@dataclass
class RunSpec:
    """Everything a child needs to run one system; travels as JSON."""

    system: str
    model: str
    device: str = "cuda"               # "cuda" or "cpu"
    gpus: int = 1                      # GPUs (or CPU "devices" for rpcompile) to use
    seq_len: int = 2048
    tokens_per_step: int = 65536
    microbatches: int = 4
    steps: int = 5
    warmup: int = 2
    seed: int = 0
    mode: str = "throughput"           # or "maxseq", or "losscurve" (steps from step 1, warmup 0)
    lr: float = LR
    result_path: str = ""
    # max-sequence search
    mem_cap_gib: float = 24.0
    maxseq_start: int = 4096
    maxseq_limit: int = 262144
    maxseq_step: int = 1024
    maxseq_ok: int = 0                 # a length known to train (carried over a relaunch)
    maxseq_fail: Optional[int] = None  # a length known to fail
    maxseq_probes: list = field(default_factory=list)
    options: dict = field(default_factory=dict)

    @property
    def spec(self) -> ModelSpec:
        return get_model(self.model)

    @property
    def lora(self) -> int:
        """`--option lora=R`: LoRA adapters of rank R on every system's model (0: full fine-tuning)."""
        return int(self.options.get("lora", 0))

    @property
    def max_positions(self) -> int:
        return max(self.seq_len, self.maxseq_limit) if self.mode == "maxseq" else self.seq_len

    @property
    def n_seqs(self) -> int:
        return max(1, self.tokens_per_step // self.seq_len)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))


class Recorder:
    """The child's result file, rewritten (atomically) at every update."""

    def __init__(self, path: Optional[str], resume: bool = False):
        self.path = path
        self.data: dict = {"status": "running", "phase": "start", "pid": os.getpid()}
        if resume:
            self.reload()
        self._write()

    def update(self, **kw) -> None:
        self.data.update(kw)
        self._write()

    def reload(self) -> None:
        """Take in what another process (a rank) wrote to the file meanwhile."""
        if self.path:
            self.data.update(read_result(self.path))

    def _write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.data, f, default=str)
        os.replace(tmp, self.path)


class NullRecorder(Recorder):
    def __init__(self):
        super().__init__(None)


def read_result(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# --- devices and memory -------------------------------------------------------------------
def cuda_devices() -> list:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def reset_gpu_peaks(devices) -> None:
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)


def gpu_peaks(devices) -> dict:
    alloc = [torch.cuda.max_memory_allocated(d) for d in devices]
    reserved = [torch.cuda.max_memory_reserved(d) for d in devices]
    return {"peak_gpu_alloc_bytes": max(alloc, default=0), "peak_gpu_reserved_bytes": max(reserved, default=0),
            "peak_gpu_alloc_bytes_per_device": alloc}


def _smaps_pss(pid: int, by_file: dict = None) -> dict:
    """Pss bytes of a process by what is mapped: shared memory (/dev/shm files), anonymous (heap,
    malloc arenas, pinned host blocks), files (libraries, CUDA's), other. by_file, if given,
    gathers the Pss of each mapped file outside /dev/shm (path -> bytes)."""
    out = {"shared memory": 0, "anonymous": 0, "files": 0, "other": 0}
    what, path = "other", ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):              # a mapping's first line: address range ... [path]
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
                what = ("shared memory" if path.startswith("/dev/shm") else "anonymous" if path in ("", "[heap]")
                        else "files" if path.startswith("/") else "other")
            elif head == "Pss:":
                b = int(line.split()[1]) * 1024
                out[what] += b
                if what == "files" and by_file is not None:
                    by_file[path] = by_file.get(path, 0) + b
    return out


def process_tree_memory(root: int = None) -> dict:
    """Host memory of this process and its descendants by kind, from /proc/PID/smaps:
    {kind: {"pss_bytes", "rss_bytes", "processes", "pss_by_mapping", "top_files"}} (top_files: the
    files outside /dev/shm with the most Pss, [path, bytes]). Pss shares a page among
    the processes that map it, so the kinds add up to what the tree holds (shared-memory files
    once); kinds: main, rpcompile worker, compile worker (Inductor's pool), other. Empty off Linux."""
    root = os.getpid() if root is None else root
    children: dict = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out: dict = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/smaps_rollup") as f:
                fields = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.split()[-1:] == ["kB"]}
            by_file: dict = {}
            by_mapping = _smaps_pss(pid, by_file)
        except OSError:
            continue
        kind = ("main" if pid == root else "rpcompile worker" if "rpcompile.runtime.worker" in cmd
                else "compile worker" if "compile_worker" in cmd or "_inductor" in cmd else "other")
        k = out.setdefault(kind, {"pss_bytes": 0, "rss_bytes": 0, "processes": 0, "pss_by_mapping": {}, "files": {}})
        k["pss_bytes"] += fields.get("Pss", 0)
        k["rss_bytes"] += fields.get("Rss", 0)
        k["processes"] += 1
        for name, b in by_mapping.items():
            k["pss_by_mapping"][name] = k["pss_by_mapping"].get(name, 0) + b
        for path, b in by_file.items():
            k["files"][path] = k["files"].get(path, 0) + b
    for k in out.values():      # what the file mappings are (Inductor's kernels, CUDA's libraries, ...)
        k["top_files"] = sorted(([p, b] for p, b in k.pop("files").items()), key=lambda x: -x[1])[:8]
    return out


def _owner(obj, skip: set, depth: int = 2) -> str:
    """A short name for what holds `obj`: the attribute, key or container and its owner's type."""
    names = []
    for ref in gc.get_referrers(obj):
        if id(ref) in skip or type(ref).__name__ in ("frame", "cell", "function"):
            continue
        attrs = ref if isinstance(ref, dict) else getattr(ref, "__dict__", None)
        if isinstance(attrs, dict):
            keys = ", ".join(str(k) for k, v in list(attrs.items()) if v is obj)[:60]
            holder = type(ref).__name__ if attrs is not ref else next(
                (type(o).__name__ for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), "dict")
            names.append(f"{holder}[{keys}]")
        elif isinstance(ref, (list, tuple)) and depth > 1:
            names.append(f"{type(ref).__name__} in {_owner(ref, skip, depth - 1)}")
        else:
            names.append(type(ref).__name__)
    return " | ".join(names[:3]) or "?"


def pinned_tensors(limit: int = 8) -> dict:
    """The live tensors of this process on page-locked memory, grouped by storage, the largest
    first: [storage bytes, shape, dtype, tensors, what holds one]. Beside torch's caching host
    allocator's figure it says which buffers hold its blocks (the cold-compile runs' 10 GiB,
    twenty-fourth session); storages only C++ holds do not show, so `found_bytes` may fall short."""
    objects = gc.get_objects()
    storages: dict = {}
    for o in objects:
        if not issubclass(type(o), torch.Tensor):
            continue
        try:
            if o.device.type != "cpu" or not o.is_pinned():
                continue
            st = o.untyped_storage()
        except Exception:   # fake, meta and other tensors without a storage
            continue
        entry = storages.setdefault(st.data_ptr(), [st.nbytes(), list(o.shape), str(o.dtype), 0, o])
        entry[3] += 1
        if o.numel() > entry[4].numel():      # the largest view names the buffer (a slot is a view of it)
            entry[1:3], entry[4] = [list(o.shape), str(o.dtype)], o
    rows = sorted(storages.values(), key=lambda e: -e[0])
    skip = {id(objects), id(rows)} | {id(e) for e in rows}
    del objects
    return {"found_bytes": sum(e[0] for e in rows), "storages": len(rows),
            "largest": [[n, shape, dtype, count, _owner(t, skip)] for n, shape, dtype, count, t in rows[:limit]]}


def host_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cap_gpu_memory(devices, cap_bytes: float) -> None:
    for d in devices:
        total = torch.cuda.get_device_properties(d).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), d)


def is_oom(exc: BaseException) -> bool:
    """True if `exc` or anything in its chain is a device out-of-memory error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def oom_detail(exc: BaseException) -> str:
    """'out of memory' and, where the chain holds torch's message, what was asked for and the
    allocator's figures (a probe's record says whether the plan or fragmentation failed)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        at = text.find("Tried to allocate")
        if at >= 0:
            end = text.find("If reserved but unallocated", at)
            return "out of memory: " + " ".join(text[at:end if end > 0 else at + 400].split())
        exc = exc.__cause__ or exc.__context__
    return "out of memory"


def free_memory(devices=()) -> None:
    gc.collect()
    for d in devices:
        torch.cuda.synchronize(d)
    if devices:
        torch.cuda.empty_cache()


# --- the trainer interface and the loop that drives it --------------------------------------
class RestartRequested(Exception):
    """The trainer cannot go on in this process after an out-of-memory: the harness starts a new child."""


class Trainer:
    """One system's training step over a batch of token ids; a runner's make_trainer builds it."""

    devices: list = []        # CUDA devices this process uses (for memory figures and syncs)
    restart_after_oom = False  # True: a max-length probe that runs out of memory ends the child

    def step(self, ids: torch.Tensor) -> float:
        """Forward + backward over `ids` (split into microbatches) and one optimizer step."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait until all work started by step() is done (asynchronous optimizers, streams)."""
        for d in self.devices:
            torch.cuda.synchronize(d)

    def recover(self) -> None:
        """Make the next step() possible after one failed with out-of-memory."""

    def probe_info(self) -> dict:
        """What a system adds to each max-length probe's record (plans, compile seconds so far)."""
        return {}

    def info(self) -> dict:
        """Extra facts for the report (plan, notes)."""
        return {}


def run_trainer(make_trainer: Callable, spec: RunSpec, rec: Optional[Recorder], *, rank: int = 0, world: int = 1,
                devices=None, reduce_max: Optional[Callable] = None, reduce_mean: Optional[Callable] = None) -> None:
    """Build the trainer and run spec.mode ("throughput", "losscurve" or "maxseq"), recording as it goes.

    "losscurve" is the throughput loop with no warm-up: every optimizer step from the first one
    is recorded (its loss and time), for the loss-parity comparison between systems.

    devices: the CUDA devices this process uses (default: all visible in CUDA mode).
    reduce_max / reduce_mean: lists of floats across ranks (multi-process systems).
    """
    rec = rec or NullRecorder()
    if devices is None:
        devices = cuda_devices() if spec.device == "cuda" else []
    reduce_max = reduce_max or (lambda xs: xs)
    reduce_mean = reduce_mean or (lambda xs: xs)
    rec.update(phase="build", device_name=device_name() if devices else "cpu", torch=torch.__version__,
               transformers=_transformers_version(), world=world)
    t0 = time.perf_counter()
    trainer = make_trainer(spec, rank=rank, world=world)
    trainer.devices = list(devices)
    free_memory(devices)
    if spec.mode == "maxseq" and devices:
        # after the build: weights are drawn on the GPU in fp32, more than the cap for an 8B model
        cap_gpu_memory(devices, spec.mem_cap_gib * GiB)
    reset_gpu_peaks(devices)
    rec.update(phase="built", build_s=time.perf_counter() - t0, n_params=count_params_of(trainer))
    if spec.mode == "maxseq":
        _max_seq_search(trainer, spec, rec, rank, devices, reduce_max)
    else:
        if spec.mode == "losscurve":
            spec = dataclasses.replace(spec, warmup=0)
        _throughput(trainer, spec, rec, rank, world, devices, reduce_max, reduce_mean)
    try:
        info = trainer.info()
    except Exception as e:  # noqa: BLE001 - extra facts must not turn a finished run into a failure
        info = {"notes": [f"info() failed: {type(e).__name__}: {e}"]}
    rec.update(info=info)


def count_params_of(trainer) -> Optional[int]:
    n = getattr(trainer, "n_params", None)
    return int(n) if n is not None else None


def _transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except Exception:  # noqa: BLE001 - informational only
        return "unavailable"


def _throughput(trainer, spec, rec, rank, world, devices, reduce_max, reduce_mean) -> None:
    n_local = spec.n_seqs // world
    total = spec.warmup + spec.steps
    batches = [step_batch(spec, i, rank, world) for i in range(total)]
    steps: list = []
    rec.update(phase="warmup", steps=steps, tokens_per_step=n_local * world * spec.seq_len)
    t_first = t_start = time.perf_counter()
    for i, ids in enumerate(batches):
        if i == spec.warmup:
            trainer.finish()                       # warm-up work must not leak into timed steps
            t_start = time.perf_counter()
            rec.update(phase="timed", warmup_s=t_start - t_first)
        t = time.perf_counter()
        if steps:
            steps[-1]["s"] = t - t_first - steps[-1]["start"]
        loss = reduce_mean([float(trainer.step(ids))])[0]
        steps.append({"i": i, "timed": i >= spec.warmup, "loss": loss, "start": t - t_first,
                      "returned_s": time.perf_counter() - t})
        rec.update(steps=steps, **_mem(devices, reduce_max))
    t_returned = time.perf_counter()
    trainer.finish()
    t_end = time.perf_counter()
    if steps:
        steps[-1]["s"] = t_end - t_first - steps[-1]["start"]
    n_timed = sum(1 for s in steps if s["timed"])
    # drain_s: the end's wait for work the last step left running (an asynchronous optimizer's
    # last step): part of the last timed step and of s_per_step, and reported on its own
    result = {"steps": steps, "phase": "done", "drain_s": t_end - t_returned, **_mem(devices, reduce_max)}
    if n_timed:
        result["s_per_step"] = (t_end - t_start) / n_timed
    rec.update(**result)


def _mem(devices, reduce_max) -> dict:
    out = {"host_maxrss_bytes": host_maxrss_bytes()}
    if devices:
        peaks = gpu_peaks(devices)
        a, r = reduce_max([float(peaks["peak_gpu_alloc_bytes"]), float(peaks["peak_gpu_reserved_bytes"])])
        out.update(peak_gpu_alloc_bytes=int(a), peak_gpu_reserved_bytes=int(r),
                   peak_gpu_alloc_bytes_this_process=peaks["peak_gpu_alloc_bytes_per_device"])
    return out


def next_probe(ok: int, fail: Optional[int], start: int, limit: int, step: int = 1024) -> Optional[int]:
    """The next sequence length of the search: double from `start` until a length fails, then
    bisect between the longest that trained and the shortest that failed, in steps of `step`."""
    if fail is None:
        nxt = start if ok < start else 2 * ok
        return nxt if nxt <= limit else (limit if ok < limit else None)
    if fail - ok <= step:
        return None
    mid = (ok + fail) // 2 // step * step
    mid = max(mid, ok + step)
    return mid if mid < fail else None


class _ProbeProfiler:
    """cProfile over a max-length probe's first step when `--option profile_probes=N`: the N
    functions of most cumulative seconds go into the probe's record as `profile` [[function,
    cumulative s, own s, calls]], to show where a new length's seconds go (planning, building
    programs, compiling, host allocations). Off: does nothing. The second step at the length is
    not profiled, so a profiled probe's "over a known length" is inflated (report.new_length_extra
    marks it): time the bar without it."""

    def __init__(self, spec):
        self.n = int(spec.options.get("profile_probes", 0) or 0)
        self.prof = None

    def __enter__(self):
        if self.n:
            import cProfile
            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.disable()
        return False

    def top(self) -> dict:
        if self.prof is None:
            return {}
        import pstats
        stats = pstats.Stats(self.prof).stats
        rows = sorted(((f"{os.path.basename(fn)}:{line}({name})", ct, tt, nc)
                       for (fn, line, name), (cc, nc, tt, ct, _) in stats.items()), key=lambda r: -r[1])
        return {"profile": [[f, round(ct, 3), round(tt, 3), nc] for f, ct, tt, nc in rows[:self.n]]}


class _GcClock:
    """Seconds and count of the interpreter's garbage collections per generation while on: a
    full (generation 2) collection walks every object the process tracks (a compiled model's
    graphs, fake tensors, sympy sizes), and one falling into a new length's step is seconds
    the step pays that no profile names."""

    def __init__(self):
        self.seconds, self.count, self._t = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def _tick(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t
            self.count[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._tick)
        return False

    def record(self) -> dict:
        return {"gc_s": [round(x, 3) for x in self.seconds], "gc_n": list(self.count)}


def _max_seq_search(trainer, spec, rec, rank, devices, reduce_max) -> None:
    ok, fail = spec.maxseq_ok, spec.maxseq_fail
    probes = list(spec.maxseq_probes)
    rec.update(phase="maxseq", probes=probes, maxseq_ok=ok, maxseq_fail=fail)
    while (s := next_probe(ok, fail, spec.maxseq_start, spec.maxseq_limit, spec.maxseq_step)) is not None:
        rec.update(current_probe=s, current_probe_started=time.time())
        reset_gpu_peaks(devices)
        t = time.perf_counter()
        ids = batch_ids(spec.spec.vocab, 1, s, step=0, rank=rank, seed=spec.seed)
        repeat_s, prof, gcs = None, _ProbeProfiler(spec), _GcClock()
        try:
            with prof, gcs:
                loss = float(trainer.step(ids))
                trainer.finish()
            good, err = math.isfinite(loss), None if math.isfinite(loss) else f"loss {loss}"
            probe_s = time.perf_counter() - t
            if good:   # the same length again: a step at a known length, what a new length costs beside
                t2 = time.perf_counter()
                trainer.step(ids)
                trainer.finish()
                repeat_s = time.perf_counter() - t2
        except Exception as e:  # noqa: BLE001 - an OOM is an answer, anything else a failure
            if not is_oom(e):
                raise
            good, err, loss = False, oom_detail(e), None
            if not trainer.restart_after_oom:
                trainer.recover()
        if good or not trainer.restart_after_oom:
            free_memory(devices)
        mem = _mem(devices, reduce_max) if good or not trainer.restart_after_oom else {}
        probes.append({"seq_len": s, "ok": good, "loss": loss, "s": probe_s if good else time.perf_counter() - t,
                       "repeat_s": repeat_s, "error": err, "peak_gpu_alloc_bytes": mem.get("peak_gpu_alloc_bytes"),
                       **prof.top(), **gcs.record(),
                       **trainer.probe_info()})
        if good:
            ok = s
        else:
            fail = s
        rec.update(probes=probes, maxseq_ok=ok, maxseq_fail=fail, current_probe=None)
        if not good and trainer.restart_after_oom and next_probe(ok, fail, spec.maxseq_start, spec.maxseq_limit,
                                                                 spec.maxseq_step):
            raise RestartRequested(f"out of memory at {s} tokens; {type(trainer).__name__} restarts after an OOM")
    rec.update(phase="done", max_seq=ok)


def child_failure(rec: Recorder, exc: BaseException) -> None:
    rec.update(status="oom" if is_oom(exc) else "failed", error=f"{type(exc).__name__}: {exc}"[:2000],
               traceback=traceback.format_exc()[-6000:])
