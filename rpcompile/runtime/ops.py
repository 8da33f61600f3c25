"""The ops of stage programs: transfers, events and RNG; each forwards to its job's context.

Note [program ops]: the transfer and event ops are `torch.library` custom ops in the
`rpcompile` namespace with schemas and fake implementations, so a program prints as what the
job does (`torch.ops.rpcompile.fetch(job, mb, 'x')`), traces with `make_fx` (see
`runtime.fake.trace_job`) and cannot be reordered or dropped by graph passes: ops returning
nothing are marked side-effectful. A schema cannot carry a Python object, so `job` is the
integer handle of a registered `runtime.job.JobContext` (or, when tracing with fake tensors,
of a `runtime.fake.FakeJob`). Values that are not tensors (sizes, tuples) go through the
plain-Python `*_value` ops beside them; compute, RNG and autograd helpers stay Python too.
"""
from __future__ import annotations

import itertools
import threading
from typing import Optional

import torch
from torch import Tensor

_local = threading.local()
_jobs: dict = {}                      # handle -> JobContext / FakeJob
_handles = itertools.count(1)


def register(job) -> int:
    """A handle for `job` that program ops take as their first argument."""
    handle = next(_handles)
    _jobs[handle] = job
    return handle


def unregister(handle: int) -> None:
    _jobs.pop(handle, None)


def _job(handle: int):
    return _jobs[int(handle)]


def _op(name: str, fake):
    """Declare fn as the custom op rpcompile::name with the given fake implementation."""
    def wrap(fn):
        op = torch.library.custom_op(f"rpcompile::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        if fn.__annotations__.get("return") in (None, "None"):
            torch.fx.node.has_side_effect(getattr(torch.ops.rpcompile, name).default)
        return getattr(torch.ops.rpcompile, name).default
    return wrap


def _nothing(*args):
    return None


def _fake(kind):
    return lambda job, *args: _job(job).fake(kind, *args)


# --- events -------------------------------------------------------------------------------
@_op("wait", _nothing)
def wait(job: int, mb: int) -> None:
    """Block until the job before this one in the chain has finished microbatch mb."""
    _job(job).wait(mb)


@_op("done", _nothing)
def done(job: int, mb: int) -> None:
    """Record that this job finished microbatch mb (the next job may read its results)."""
    _job(job).done(mb)


# --- uploads ------------------------------------------------------------------------------
@_op("prefetch_next", _nothing)
def prefetch_next(job: int, mb: int) -> None:
    """Start uploading the weights of the next job on this device (once per job)."""
    _job(job).prefetch_next(mb)


@_op("upload_weight", _fake("weight"))
def upload_weight(job: int, name: str) -> Tensor:
    """The device working copy of the model's parameter `name` (uploaded once per job)."""
    return _job(job).weight(name)


@_op("upload_weight_rows", _fake("weight_rows"))
def upload_weight_rows(job: int, name: str, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of parameter `name` on the device (a vocabulary shard of the LM head)."""
    return _job(job).weight(name, (start, stop))


@_op("upload_buffer", _fake("buffer"))
def upload_buffer(job: int, name: str) -> Tensor:
    """The device copy of the model's buffer `name`."""
    return _job(job).buffer(name)


@_op("fetch", _fake("act"))
def fetch(job: int, mb: int, name: str) -> Tensor:
    """Upload an activation or checkpoint of microbatch mb (from the host, or from a peer GPU)."""
    return _job(job).fetch(mb, name)


@_op("upload_input", _fake("input"))
def upload_input(job: int, mb: int, index: int) -> Tensor:
    """Upload microbatch mb of the call's input leaf `index`."""
    return _job(job).user_input(mb, index)


@_op("fetch_grad", _fake("grad"))
def fetch_grad(job: int, mb: int, name: str) -> Tensor:
    """Upload the gradient later jobs computed for `name` (an empty tensor when none reached it)."""
    return _job(job).fetch_grad(mb, name)


@_op("loss_seed", _fake("seed"))
def loss_seed(job: int, mb: int) -> Tensor:
    """d(batch loss)/d(microbatch loss output): the seed of the fused stage's backward."""
    return _job(job).loss_seed(mb)


@_op("loss_scale", _fake("seed"))
def loss_scale(job: int, mb: int, term: int) -> Tensor:
    """Microbatch mb's scale of cross-entropy term `term` (Note [cross-entropy terms])."""
    return _job(job).loss_scale(mb, term)


# --- downloads ----------------------------------------------------------------------------
@_op("offload", _nothing)
def offload(job: int, mb: int, name: str, value: Tensor) -> None:
    """Download a value later jobs need into the host store."""
    _job(job).offload(mb, name, value)


@_op("download_output", _nothing)
def download_output(job: int, mb: int, name: str, value: Tensor) -> None:
    """Download a value the model returns."""
    _job(job).output(mb, name, value)


@_op("offload_grad", _nothing)
def offload_grad(job: int, mb: int, name: str, value: Optional[Tensor]) -> None:
    """Download (and add up) the gradient of a value an earlier job produced."""
    _job(job).offload_grad(mb, name, value)


@_op("accumulate_grads", _nothing)
def accumulate_grads(job: int, grads: list[Optional[Tensor]]) -> None:
    """Add this microbatch's parameter gradients into the job's device accumulators."""
    _job(job).accumulate_grads(grads)


# --- values that are not tensors (sizes, tuples): plain Python ----------------------------
def fetch_value(job, mb, name):
    """A non-tensor value (or tuple of tensors) an earlier job handed on."""
    return _job(job).fetch(mb, name)


def input_value(job, mb, index):
    """A call input leaf that is not a tensor."""
    return _job(job).user_input(mb, index)


def offload_value(job, mb, name, value):
    _job(job).offload(mb, name, value)


def output_value(job, mb, name, value):
    _job(job).output(mb, name, value)


def sym(job, mb, name):
    """The value of a size symbol (e.g. the microbatch's batch size)."""
    return _job(job).sym(mb, name)


def rng_key(job, mb):
    """The key of this step's and microbatch's random streams (Note [RNG replay])."""
    return _job(job).rng_key(mb)


def compute(job, mb, graph, *args):
    """Run a stage's compute graph on the device's compute stream."""
    ctx = _job(job)
    name = {"fwd": "forward", "fused": "forward+backward", "bwd": "recompute+backward"}[ctx.role]
    # .forward, not graph(...): torch.fx's GraphModule.__call__ prints the generated code around
    # a failing line to stderr, even when the caller catches the StageError that reports it
    _local.job = ctx        # whose weights arrive before each piece (Note [weights as they arrive])
    try:
        return ctx.span("compute", name, lambda: graph.forward(*args), mb)
    finally:
        _local.job = None


def arrive(args) -> None:
    """Before a piece of a compute graph runs: the weights among its arguments that the running
    job left to go up as they are read (Note [weights as they arrive], runtime/job.py)."""
    ctx = getattr(_local, "job", None)
    if ctx is not None and getattr(ctx, "late_weights", None):     # (a dry run's job has none)
        ctx.arrive(args)


# --- inside compute graphs ----------------------------------------------------------------
def reseed(key, position):
    """Seed the running device's generator for the stretch starting at `position`."""
    _local.reseed(key, position)


def grad_leaf(x):
    """A leaf that requires grad, sharing x's data: gradients are taken against it."""
    return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def vjp(outputs, inputs, seeds):
    """Gradients of `outputs` (seeded by `seeds`; absent seeds, None or empty, skipped) w.r.t. `inputs`."""
    pairs = [(o, s.to(o.dtype)) for o, s in zip(outputs, seeds)
             if s is not None and s.numel() > 0 and isinstance(o, torch.Tensor) and o.requires_grad]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    outs, ss = zip(*pairs)
    return torch.autograd.grad(outs, inputs, ss, allow_unused=True)
