"""Note [hand-overs on the device] (runtime/job.py): where the next job runs on the same device
(a copy of replicas, a plan for one device), what it reads stays there; a pipeline over several
devices hands over through the host as before."""
import pytest

import rpcompile

from models import lm_batch, qwen3
from parity import train_both


def _from_the_job_before(cm) -> list:
    """(job, value) of the activations the forward jobs after the first and the fused job read
    from the host: what the job before each made (the backward jobs' checkpoints, which a job
    after the next reads, stay on the host either way)."""
    F = len(cm.plan.stage_plan.fwd_bounds)
    return [(s["job"], s["value"]) for s in cm.last_trace if s["name"] == "fetch" and 1 <= s["job"] <= F]


@pytest.mark.parametrize("devices,workers", [(1, "threads"), (2, "threads"), (2, "processes")])
def test_a_copys_jobs_hand_over_on_their_device_and_train_as_eager(devices, workers):
    """One device, or a copy on each of two (threads or worker processes): several jobs a copy,
    no activation goes down to the host and back up, and loss, gradients and parameters after
    SGD-momentum steps are as in eager PyTorch."""
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=2 * devices, memory_budget="250KiB",
                           data_parallel=True if devices > 1 else None, workers=workers)
    cm = train_both(qwen3(), [lm_batch(batch=4, seed=s) for s in range(3)], cfg, check_every_step=True)
    assert cm.plan.replicas == devices and len(cm.plan.stages) >= 3
    assert cm.plan.stage_plan.fused[0] > 0            # forward jobs hand their outputs on
    assert not _from_the_job_before(cm)


def test_a_pipeline_over_devices_hands_over_through_the_host():
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="250KiB", data_parallel=False)
    cm = rpcompile.compile(qwen3(), cfg)
    cm.train_step(**lm_batch(batch=4))
    assert cm.plan.replicas == 1 and len(cm.plan.stages) >= 3
    assert cm.plan.stage_plan.fused[0] > 0 and _from_the_job_before(cm)


def test_a_backward_reads_the_gradient_the_job_before_left_on_its_device(monkeypatch):
    """The fused job's gradient of its input goes to the backward job after it on the device,
    not through the host; in a pipeline over two devices it goes through the host."""
    from rpcompile.runtime import job as job_mod
    seen = []
    fetch_grad = job_mod.JobContext.fetch_grad

    def spy(self, mb, name):
        seen.append(((mb, ("grad", name)) in self.step.peer, name in self.step.micro[mb].grads))
        return fetch_grad(self, mb, name)
    monkeypatch.setattr(job_mod.JobContext, "fetch_grad", spy)
    for devices, on_device in ((["cpu"], True), (["cpu", "cpu"], False)):
        seen.clear()
        cfg = rpcompile.Config(devices=devices, num_microbatches=2, memory_budget="250KiB", data_parallel=False)
        cm = rpcompile.compile(qwen3(), cfg)
        cm.train_step(**lm_batch(batch=4))
        assert cm.plan.stage_plan.fused[0] > 0 and seen
        assert all(kept == on_device and host != on_device for kept, host in seen), (devices, seen)
