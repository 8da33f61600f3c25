"""The seam to the compiler core: ``rpcompile.compile`` by default, an eager stand-in on request.

Everything the command needs from a compiled model is::

    cm.train_step(input_ids=..., labels=..., [attention_mask=...]) -> detached scalar loss
                                              # grads land in p.grad; the mask where data is padded
    cm.plan                                   # printable stage table
    cm.last_trace                             # optional: [{device, stream, name, start_s, end_s}]

``_EagerCompiled`` (hidden ``--engine eager``) offers the same with plain PyTorch, so the
command and its tests could be written before the core existed, and so the two can be compared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .data import IGNORE
from .errors import RunError
from .report import plural

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compile_model(model, engine: str, devices: list[str], microbatches: int, dtype, optimizer_mode="exact"):
    if engine == "eager":
        return _EagerCompiled(model, devices, microbatches, dtype)
    try:
        import rpcompile

        compile_fn, config_cls = rpcompile.compile, rpcompile.Config
    except (ImportError, AttributeError) as e:
        raise RunError(f"the rpcompile compiler core is not available ({type(e).__name__}: {e})") from None
    return compile_fn(model, config=config_cls(devices=devices, num_microbatches=microbatches, dtype=dtype,
                                               optimizer_mode=optimizer_mode))


def engine_errors(engine: str) -> tuple:
    """The exception types the engine raises for problems a user can act on."""
    if engine == "eager":
        return ()
    import rpcompile

    return (rpcompile.RPCompileError,)


@dataclass
class _EagerPlan:
    device: str
    microbatches: int
    dtype: torch.dtype
    params: int

    def __str__(self) -> str:
        return (f"eager stand-in (not rpcompile): 1 stage, the whole model on {self.device}\n"
                f"  stage 0  forward+loss+backward  {self.params:,} params  "
                f"{plural(self.microbatches, 'microbatch', 'microbatches')}  "
                f"compute {str(self.dtype).replace('torch.', '')}")


class _EagerCompiled:
    """Plain PyTorch behind rpcompile's interface: the model on ``devices[0]``, microbatches one
    after another, the loss of the whole batch (sum over its label tokens / their count)."""

    def __init__(self, model, devices, num_microbatches, dtype=None):
        self.model = model
        self.device = torch.device(devices[0])
        self.num_microbatches = num_microbatches
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        model.to(self.device)
        self.plan = _EagerPlan(str(self.device), num_microbatches, self.dtype,
                               sum(p.numel() for p in model.parameters()))
        self.last_trace = None
        self._t0 = time.perf_counter()

    def _span(self, name, start):
        self.last_trace.append({"device": str(self.device), "stream": "compute", "name": name,
                                "start_s": start - self._t0, "end_s": time.perf_counter() - self._t0})

    def train_step(self, input_ids, labels, attention_mask=None):
        self.last_trace = []
        M = self.num_microbatches
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        masks = (attention_mask.to(self.device).tensor_split(M) if attention_mask is not None
                 else [None] * M)
        chunks = list(zip(input_ids.tensor_split(M), labels.tensor_split(M), masks))
        counts = [int((lab[:, 1:] != IGNORE).sum()) for _, lab, _ in chunks]
        total = max(sum(counts), 1)
        loss_sum = torch.zeros((), device=self.device)
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        for i, ((ids, lab, mask), n) in enumerate(zip(chunks, counts)):
            if n == 0 or ids.shape[0] == 0:
                continue
            start = time.perf_counter()
            extra = {} if mask is None else {"attention_mask": mask}
            with autocast:
                loss = self.model(input_ids=ids, labels=lab, **extra).loss.float() * (n / total)
            self._span(f"forward mb{i}", start)
            start = time.perf_counter()
            loss.backward()
            self._span(f"backward mb{i}", start)
            loss_sum += loss.detach()
        return loss_sum.cpu()
