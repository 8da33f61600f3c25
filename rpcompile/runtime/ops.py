"""The ops of stage programs: transfers, events, RNG; each forwards to the job's context.

Program graphs call these by name so that printing a program reads as what the job does.
`job` is a `runtime.job.JobContext`; `mb` the microbatch index.
"""
from __future__ import annotations

import threading

import torch

_local = threading.local()


def wait(job, mb):
    """Block until the job before this one in the chain has finished microbatch mb."""
    job.wait(mb)


def done(job, mb):
    """Record that this job finished microbatch mb (the next job may read its results)."""
    job.done(mb)


def weight(job, name):
    """The device working copy of the model's parameter `name` (uploaded once per job)."""
    return job.weight(name)


def weight_rows(job, name, start, stop):
    """Rows [start, stop) of parameter `name` on the device (a vocabulary shard of the LM head)."""
    return job.weight(name, (start, stop))


def buffer(job, name):
    """The device copy of the model's buffer `name`."""
    return job.buffer(name)


def fetch(job, mb, name):
    """Upload an activation or checkpoint of microbatch mb from the host store."""
    return job.fetch(mb, name)


def user_input(job, mb, index):
    """Upload microbatch mb of the call's input leaf `index`."""
    return job.user_input(mb, index)


def sym(job, mb, name):
    """The value of a size symbol (e.g. the microbatch's batch size)."""
    return job.sym(mb, name)


def rng_key(job, mb):
    """The key of this step's and microbatch's random streams (Note [RNG replay])."""
    return job.rng_key(mb)


def compute(job, mb, graph, *args):
    """Run a stage's compute graph on the device's compute stream."""
    name = {"fwd": "forward", "fused": "forward+backward", "bwd": "recompute+backward"}[job.role]
    return job.span("compute", name, lambda: graph(*args), mb)


def offload(job, mb, name, value):
    """Download a value later jobs need into the host store."""
    job.offload(mb, name, value)


def output(job, mb, name, value):
    """Download a value the model returns."""
    job.output(mb, name, value)


def fetch_grad(job, mb, name):
    """Upload the gradient that later jobs computed for `name`."""
    return job.fetch_grad(mb, name)


def loss_seed(job, mb):
    """d(batch loss)/d(microbatch loss output): the seed of the fused stage's backward."""
    return job.loss_seed(mb)


def offload_grad(job, mb, name, value):
    """Download (and add up) the gradient of a value an earlier job produced."""
    job.offload_grad(mb, name, value)


def accumulate_grads(job, grads):
    """Add this microbatch's parameter gradients into the job's device accumulators."""
    job.accumulate_grads(grads)


def reseed(key, position):
    """Seed the running device's generator for the stretch starting at `position`."""
    _local.reseed(key, position)


def grad_leaf(x):
    """A leaf that requires grad, sharing x's data: the input gradients are taken against it."""
    return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def vjp(outputs, inputs, seeds):
    """Gradients of `outputs` (seeded by `seeds`; None seeds skipped) w.r.t. `inputs`."""
    pairs = [(o, s.to(o.dtype)) for o, s in zip(outputs, seeds)
             if s is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    outs, ss = zip(*pairs)
    return torch.autograd.grad(outs, inputs, ss, allow_unused=True)
