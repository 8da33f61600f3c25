"""rpcompile: fine-tune models bigger than GPU memory on a few GPUs.

    cm = rpcompile.compile(model, config=rpcompile.Config(devices=["cuda:0", "cuda:1"], num_microbatches=4))
    loss = cm.train_step(input_ids=ids, labels=ids)
    opt.step(); opt.zero_grad()
"""
import torch as _torch

from .torch_version import check as _check_torch

_check_torch(_torch.__version__)     # (before the modules that use newer torch: Note [the oldest torch])

from .backend import backend, rpcompile_backend
from .compiled import CompiledModel
from .config import Config
from .errors import CaptureError, InputError, RPCompileError, StageError
from .passes.host_memory import HostMemoryError
from .passes.partition import PlanningError

__version__ = "0.1.0"


def compile(model, config: Config | None = None) -> CompiledModel:  # noqa: A001 - mirrors torch.compile
    """Compile `model` for pipelined training; capture happens at the first call."""
    return CompiledModel(model, config)


__all__ = ["compile", "Config", "CompiledModel", "backend", "rpcompile_backend", "CaptureError",
           "HostMemoryError", "InputError", "PlanningError", "RPCompileError", "StageError"]
