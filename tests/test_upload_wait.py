"""Note [uploads behind the job before] (passes/uploads.py): what a device's jobs wait for their
weights beyond the times the solver prices (the longer of a job's compute and its own upload)."""
import pytest
import torch

import rpcompile
from rpcompile import passes
from rpcompile.capture import capture_call
from rpcompile.passes.uploads import upload_wait
from rpcompile.plan import _fmt_seconds

from models import llama, lm_batch

BW = 10.0     # bytes a second: weights of 1 take 0.1 s


def test_a_long_job_behind_a_short_one_waits_for_its_weights():
    """Llama-3.1-8B's 2-GPU copies at 8 microbatches, in small: a 0.08 s forward, a fused job
    whose weights take 0.3 s, a short backward. The fused job's weights go up while the forward
    runs, and it starts 0.22 s after that forward ends."""
    wait = upload_wait([0.08, 1.0, 0.05], [0.5, 3.0, 0.5], (), BW, early=True, num_fwd=1)
    assert wait == pytest.approx(0.22)
    # the forward as long as the upload: nothing to wait for
    assert upload_wait([0.3, 1.0, 0.05], [0.5, 3.0, 0.5], (), BW, early=True, num_fwd=1) == pytest.approx(0.0)


def test_the_next_steps_first_job_goes_up_early_or_at_the_steps_end():
    """Early (delayed mode): the next step's job 0 goes up during the jobs after the loss; else it
    goes up as the step ends, and the step waits for it."""
    jobs = ([0.5, 0.5, 0.5], [2.0, 2.0, 2.0])
    assert upload_wait(*jobs, (), BW, early=True, num_fwd=1) == pytest.approx(0.0)
    assert upload_wait(*jobs, (), BW, early=False, num_fwd=1) == pytest.approx(0.2)
    # one job a step: its next weights go up during the step, or after it
    assert upload_wait([1.0], [5.0], (), BW, early=True, num_fwd=0) == pytest.approx(0.0)
    assert upload_wait([1.0], [5.0], (), BW, early=False, num_fwd=0) == pytest.approx(0.5)


def test_what_a_job_may_not_prefetch_goes_up_while_it_runs():
    """An allowance of 1 of the fused job's 3: 0.1 s up behind the forward, 0.2 s during the
    fused job, which is longer: no wait. With a fused job of 0.1 s the rest sets its end."""
    assert upload_wait([0.08, 1.0, 0.05], [0.5, 3.0, 0.5], (1.0, 9.0, 9.0), BW, early=True,
                       num_fwd=1) == pytest.approx(0.02)
    wait = upload_wait([0.3, 0.1, 0.3], [0.5, 3.0, 0.5], (1.0, 9.0, 9.0), BW, early=True, num_fwd=1)
    assert wait == pytest.approx(0.0)       # (its end at its weights' end is what the solver priced)
    assert upload_wait([0.3], [0.5], (), float("inf"), early=False, num_fwd=0) == 0.0


def _capture():
    return capture_call(llama(layers=4), (), {**lm_batch(batch=8), "use_cache": False}, dtype=None,
                        device=torch.device("cpu"), dynamic_lengths=True)


def test_the_plan_prints_its_wait_and_the_finer_split_weighs_it():
    """A plan's wait is its own (`cm.plan` prints it); a pipeline over several devices is not
    replayed; the finer split compares the counts' steps with their waits."""
    cap = _capture()
    cfg = dict(devices=["cpu"], num_microbatches=2, memory_budget="600KiB", split_microbatches=True)
    plan = passes.compile_graph(cap, rpcompile.Config(**cfg), "train")
    assert len(plan.stages) > 1 and plan.upload_wait_s > 0
    assert f"+ {_fmt_seconds(plan.upload_wait_s)} waiting for weights (cost model" in str(plan)
    pipe = passes.compile_graph(cap, rpcompile.Config(**{**cfg, "devices": ["cpu", "cpu"], "data_parallel": False}),
                                "train")
    assert pipe.replicas == 1 and pipe.upload_wait_s == 0.0 and "waiting for weights" not in str(pipe)
    finer = passes.compile_graph(cap, rpcompile.Config(**cfg), "train", split_finer=True)
    for m, pace, _ in finer.finer:
        at = passes.compile_graph(cap, rpcompile.Config(**{**cfg, "num_microbatches": m}), "train")
        assert pace == pytest.approx(at.est_step_time + at.upload_wait_s)
