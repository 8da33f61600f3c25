"""Note [resident weights] (passes/resident.py): what a device holds beside a job."""
import types

import pytest
import torch

import rpcompile
from rpcompile.passes.resident import prefetch_allowance, resident_memory
from rpcompile.runtime import job as job_mod
from rpcompile.runtime.modes import DelayedMode

from models import lm_batch, qwen3

GiB = 1 << 30


def test_resident_memory_counts_the_neighbours_weights():
    """One device, jobs fwd 0, fwd 1, fused 2, bwd 3, bwd 4 with weights 7, 8, 1, 1, 2 GiB; the
    solver's memory counts each job's weights twice."""
    w = [7 * GiB, 8 * GiB, 1 * GiB, 1 * GiB, 2 * GiB]
    mem = [2 * p + 5 * GiB for p in w]
    # no limit: job 0 holds job 1's 8 (1 more than its own 7), job 3 job 4's 2; the last nothing
    got = resident_memory(mem, w, (), num_fwd=2, num_devices=1, early=False)
    assert got == [20 * GiB, mem[1], mem[2], 8 * GiB, mem[4]]
    # the early upload of the next step's job 0 (7) sits beside the jobs after the loss (3, 4)
    got = resident_memory(mem, w, (), num_fwd=2, num_devices=1, early=True)
    assert got == [20 * GiB, mem[1], mem[2], 15 * GiB, 14 * GiB]
    # two devices: job k's neighbour is job k + 2; the next step's job 0 runs on the device of
    # job 5 - 2k (jobs 3 and 1 here), after the loss only job 3
    got = resident_memory(mem, w, (), num_fwd=2, num_devices=2, early=True)
    assert got == [mem[0], mem[1], 8 * GiB, 13 * GiB, mem[4]]
    # allowances: job 0 may prefetch 7.5 GiB of job 1's 8
    allowance = prefetch_allowance(mem, w, 19.5 * GiB)
    assert allowance[0] == 7.5 * GiB and all(a >= p for a, p in zip(allowance, w))
    assert resident_memory(mem, w, allowance, 2, 1, False)[0] == 19.5 * GiB
    assert prefetch_allowance(mem, w, None) == ()


def test_prefetch_takes_the_next_jobs_first_weights_up_to_the_allowance():
    params = [torch.empty(100), torch.empty(50), torch.empty(300)]
    stage = types.SimpleNamespace(params=[0, 1, 2], param_slices={}, index=1)
    step = types.SimpleNamespace(params=params, dtype=torch.bfloat16, host_weights=None, ready=None, tracer=None)
    asked = []
    dev = types.SimpleNamespace(prefetch=lambda key, ps, *a: asked.append([i for i, _ in ps]))
    job_mod._prefetch(step, dev, 1, stage, limit=300)       # 200 + 100 bytes of bf16; not the 600
    job_mod._prefetch(step, dev, 1, stage, limit=299)
    job_mod._prefetch(step, dev, 1, stage)
    assert asked == [[0, 1], [0], [0, 1, 2]]


def test_a_prefetch_takes_the_rows_a_job_reads_of_a_parameter():
    """Note [row weights prefetched]: an LM head shard's rows go up with the job's weights, keyed
    as the job asks for them, and count against the allowance by their own bytes."""
    params = [torch.empty(100), torch.empty(50), torch.empty(40, 10)]
    stage = types.SimpleNamespace(params=[0, 1], param_slices={"w_a": (2, 0, 10), "w_b": (2, 10, 20)}, index=1)
    step = types.SimpleNamespace(params=params, dtype=torch.bfloat16, host_weights=None, ready=None, tracer=None)
    asked = []
    dev = types.SimpleNamespace(prefetch=lambda key, ps, *a: asked.append([i for i, _ in ps]))
    job_mod._prefetch(step, dev, 1, stage)
    job_mod._prefetch(step, dev, 1, stage, limit=300 + 200)    # the whole ones and one shard's rows
    assert asked == [[0, 1, (2, 0, 10), (2, 10, 20)], [0, 1, (2, 0, 10)]]


def test_the_uploader_sends_rows_as_rows_and_whole_parameters_in_runs():
    """DeviceRuntime.prefetch on a GPU (the device faked): whole parameters go up as runs of
    adjacent copies, rows of one with upload_weight(rows=...), each under the key asked for."""
    from concurrent.futures import Future
    from rpcompile.runtime.device import DeviceRuntime

    class Now:
        def submit(self, fn):
            f = Future()
            f.set_result(fn())
            return f
    dev = DeviceRuntime.__new__(DeviceRuntime)
    dev.is_cpu, dev.prefetched, dev.uploader, dev.label, dev.worker_index = False, {}, Now(), "fake", 0
    calls = []
    dev._upload_runs = lambda todo, hw: ({i: ("run", i) for i, _ in todo}, 1)
    dev.upload_weight = lambda p, dtype, hw, rows=None, wait=True: calls.append(rows) or ("rows", rows)
    w = [torch.empty(4), torch.empty(6, 2)]
    dev.prefetch("k", [(0, w[0]), ((1, 2, 4), w[1])], torch.bfloat16, types.SimpleNamespace(held=None))
    got = dev.prefetched["k"].result()
    assert got == {0: ("run", 0), (1, 2, 4): ("rows", (2, 4))} and calls == [(2, 4)]


def _delayed(budget):
    model = qwen3(layers=4)
    cfg = rpcompile.Config(devices=["cpu"], num_microbatches=2, optimizer_mode="delayed", memory_budget=budget)
    cm = rpcompile.compile(model, cfg)
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    cm.train_step(**lm_batch(batch=4, seq=16))
    cm.synchronize()
    return cm


def test_the_next_steps_first_job_goes_up_early_only_where_it_fits():
    """A roomy budget keeps delayed mode's early upload; the tightest budget a plan fits gives it
    up (each job's planned memory, with what is resident beside it, stays within the budget),
    and the mode then leaves the upload to the next step's first job."""
    roomy = _delayed("1GiB")
    assert roomy.plan.early_first_upload
    model = qwen3(layers=4)
    probe = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], num_microbatches=2,
                                                      optimizer_mode="delayed", memory_budget=1))
    probe.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=4, seq=16))
    tight_budget = e.value.min_budget
    tight = _delayed(tight_budget)
    plan = tight.plan
    assert not plan.early_first_upload and max(plan.stage_plan.job_memory) <= tight_budget
    assert len(plan.prefetch_bytes) == len(plan.stages)
    mode = DelayedMode(types.SimpleNamespace())
    runner = types.SimpleNamespace(executor=None)     # would fail if the mode asked for a device
    mode._upload_first_job(runner, plan, 1)
    assert mode.next_upload is None
