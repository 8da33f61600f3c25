"""The schedule of a run is data built before it runs: placement, links and the printed form
are checked here without threads; one run on CPU devices checks that it is what ran."""
from types import SimpleNamespace

import pytest
import torch

import rpcompile
from rpcompile.runtime.schedule import JobAction, Schedule, build_schedule

from parity import inject_fault
from models import lm_batch, qwen3


def _chain(kinds, inputs=None):
    """[(job index, stage, role)] of a train step whose stages have these kinds."""
    inputs = inputs or [[f"x{k}"] for k in range(len(kinds))]
    return [(k, SimpleNamespace(index=k, inputs=inputs[k]), kind) for k, kind in enumerate(kinds)]


FOUR = _chain(["fwd", "fwd", "fused", "bwd"])


def test_action_prints_stage_role_device():
    assert str(JobAction(job=0, stage=0, role="fwd", device=0)) == "0F@0"
    assert str(JobAction(job=2, stage=2, role="fused", device=2)) == "2FB@2"
    assert str(JobAction(job=3, stage=3, role="bwd", device=0)) == "3B@0"
    assert str(JobAction(job=11, stage=11, role="bwd", device=7)) == "11B@7"


@pytest.mark.parametrize("devices, offset, text", [
    (1, 0, "0F@0 1F@0 2FB@0 3B@0"),
    (1, 5, "0F@0 1F@0 2FB@0 3B@0"),
    (2, 0, "0F@0 1F@1 2FB@0 3B@1"),
    (2, 1, "0F@1 1F@0 2FB@1 3B@0"),
    (3, 0, "0F@0 1F@1 2FB@2 3B@0"),
    (3, 2, "0F@2 1F@0 2FB@1 3B@2"),
    (3, 4, "0F@1 1F@2 2FB@0 3B@1"),     # the offset is taken mod the device count
])
def test_printed_form(devices, offset, text):
    s = build_schedule(FOUR, devices, offset)
    assert str(s) == text
    assert s.offset == offset % devices and s.num_devices == devices


def test_call_runs_print_their_roles():
    """cm(...) runs the fused stage's forward, and its backward later: F then B."""
    stages = [SimpleNamespace(index=k, inputs=[]) for k in range(4)]
    fwd = build_schedule([(k, stages[k], "fwd") for k in (0, 1, 2)], 2, 0)
    bwd = build_schedule([(k, stages[k], "bwd") for k in (2, 3)], 2, fwd.next_offset)
    assert (str(fwd), str(bwd)) == ("0F@0 1F@1 2F@0", "2B@1 3B@0")


def test_round_robin_placement_and_offset_carry_over():
    jobs = _chain(["fwd"] * 3 + ["fused"] + ["bwd"] * 3)
    for n in (1, 2, 3, 4, 8):
        offset = 0
        for _ in range(4):                      # consecutive runs continue the rotation
            s = build_schedule(jobs, n, offset)
            assert [a.device for a in s.actions] == [(offset + k) % n for k in range(len(jobs))]
            assert s.next_offset == (offset + len(jobs)) % n
            offset = s.next_offset
    # the device after the last job of one run starts the next
    a = build_schedule(jobs, 3, 0)
    b = build_schedule(jobs, 3, a.next_offset)
    assert b.actions[0].device == (a.actions[-1].device + 1) % 3


def test_links_of_a_nine_job_chain_on_four_devices():
    kinds = ["fwd"] * 4 + ["fused"] + ["bwd"] * 4
    # forward stage k reads h{k}; backward stage 8 - k + 4 reads h{k} (its checkpoint) and g{k+1}
    inputs = [[f"h{k}"] for k in range(5)] + [[f"h{k}", f"g{k + 1}"] for k in (3, 2, 1, 0)]
    jobs = _chain(kinds, inputs)
    for offset in (0, 1, 3):
        s = build_schedule(jobs, 4, offset)
        assert [a.job for a in s.actions] == list(range(9))
        assert [a.stage for a in s.actions] == list(range(9))
        assert [a.role for a in s.actions] == kinds
        assert [a.device for a in s.actions] == [(offset + k) % 4 for k in range(9)]
        assert [a.prev_job for a in s.actions] == [None, 0, 1, 2, 3, 4, 5, 6, 7]
        # the next job on the same device is four on: its weights are prefetched during this one
        assert [a.next_on_device for a in s.actions] == [4, 5, 6, 7, 8, None, None, None, None]
        for a in s.actions:
            if a.next_on_device is not None:
                assert s.actions[a.next_on_device].device == a.device
        assert [a.next_device for a in s.actions] == [(offset + k + 1) % 4 for k in range(8)] + [None]
        assert s.actions[0].next_reads == {"h1"}
        assert s.actions[4].next_reads == {"h3", "g4"}
        assert s.actions[8].next_reads == frozenset()
        # later reads: what any job after the next one reads (a checkpoint goes to the host too)
        assert s.actions[2].later_reads == {"h4", "h3", "h2", "h1", "h0", "g4", "g3", "g2", "g1"}
        assert s.actions[3].later_reads == {"h3", "h2", "h1", "h0", "g4", "g3", "g2", "g1"}
        assert s.actions[6].later_reads == {"h0", "g1"}
        assert s.actions[7].later_reads == frozenset() and s.actions[8].later_reads == frozenset()
        assert s.stage(4) is jobs[4][1]


def test_a_later_run_s_reads_count_as_read_later():
    """A differentiable call runs its forward jobs, and its backward jobs in a later run: what
    the backward reads must reach the host, even from the last forward job, and on one device
    (where the next job would otherwise take a value on the device only)."""
    kinds = ["fwd"] * 2 + ["fused"] + ["bwd"] * 2
    inputs = [["h0"], ["h1"], ["h2"], ["h1", "g2"], ["h0", "g1"]]
    jobs = _chain(kinds, inputs)
    forward = [(k, st, "fwd") for k, st, kind in jobs if kind != "bwd"]
    backward = [(k, st, "bwd") for k, st, kind in jobs if kind != "fwd"]
    for n, replicas in ((1, 1), (2, 1), (2, 2)):
        s = build_schedule(forward, n, 0, replicas, 4, then=backward)
        alone = build_schedule(forward, n, 0, replicas, 4)
        assert [str(a) for a in s.actions] == [str(a) for a in alone.actions]
        assert alone.actions[-1].later_reads == frozenset()
        for a, b in zip(alone.actions, s.actions):
            assert b.later_reads == a.later_reads | {"h0", "h1", "h2", "g1", "g2"}
            # what only the later run reads, named apart (Note [values a later run reads])
            assert b.then_reads == {"h0", "h1", "h2", "g1", "g2"} and a.then_reads == frozenset()


def test_links_match_the_rotation_formula():
    """The links the executor used to compute inline: next on device k + N, next device (k + 1)."""
    for n_jobs in (1, 2, 5, 9, 12):
        jobs = _chain(["fwd"] * (n_jobs - 1) + ["fused"], [[f"v{k}", "shared"] for k in range(n_jobs)])
        for n in (1, 2, 3, 4):
            s = build_schedule(jobs, n, 1)
            for k, a in enumerate(s.actions):
                assert a.next_on_device == (k + n if k + n < n_jobs else None)
                assert a.next_device == ((1 + k + 1) % n if k + 1 < n_jobs else None)
                assert a.later_reads == frozenset().union(*[set(st.inputs) for _, st, _ in jobs[k + 2:]])


def test_render_marks_the_failed_job():
    s = build_schedule(FOUR, 3, 0)
    assert s.render() == str(s) == "0F@0 1F@1 2FB@2 3B@0"
    assert s.render(failed=2) == "0F@0 1F@1 [2FB@2 failed] 3B@0"
    assert s.render(failed=0) == "[0F@0 failed] 1F@1 2FB@2 3B@0"
    assert s.render(failed=99) == str(s)      # a job not in the schedule marks nothing


def test_schedule_is_plain_data():
    s = build_schedule(FOUR, 2, 1)
    assert isinstance(s, Schedule) and isinstance(s.actions, tuple)
    assert s == build_schedule(FOUR, 2, 1)
    with pytest.raises(Exception):
        s.actions[0].device = 1               # frozen
    with pytest.raises(ValueError):
        build_schedule(FOUR, 0, 0)
    empty = build_schedule([], 3, 2)
    assert str(empty) == "" and empty.next_offset == 2


def _expected_text(placements):
    letters = {"fwd": "F", "fused": "FB", "bwd": "B"}
    return " ".join(f"{stage}{letters[role]}@{device}" for _, stage, role, device in placements)


def test_printed_schedule_is_what_ran_on_cpu_devices(monkeypatch):
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB"))
    assert cm.last_schedule is None
    batch = lm_batch()
    cm.train_step(**batch)
    first = cm.last_schedule
    J = len(cm.plan.stages)
    assert J >= 3
    assert str(first) == _expected_text(cm.last_placements)
    assert [a.device for a in first.actions] == [k % 2 for k in range(J)]
    assert [a.role for a in first.actions] == [st.kind for st in cm.plan.stages]
    # every job ran on the worker its action names (read off the trace)
    for a in first.actions:
        spans = [s for s in cm.last_trace if s.get("job") == a.job and s["name"] in
                 ("forward", "forward+backward", "recompute+backward")]
        assert spans and all(s["worker"] == a.device for s in spans)

    cm.train_step(**batch)
    second = cm.last_schedule
    assert second.offset == first.next_offset == J % 2
    assert str(second) == _expected_text(cm.last_placements)
    model.zero_grad()

    # a failing job: the StageError carries the schedule with that job marked
    target = cm.plan.stages[-2].index
    inject_fault(monkeypatch, target, microbatch=1)
    with pytest.raises(rpcompile.StageError) as e:
        cm.train_step(**batch)
    err = e.value
    failed = cm.last_schedule
    assert failed.offset == second.next_offset
    marked = next(a for a in failed.actions if a.stage == target)
    assert err.job == marked.job and err.stage == target and err.microbatch == 1
    assert err.schedule == failed.render(failed=marked.job)
    assert f"[{marked} failed]" in err.schedule and err.schedule.count("failed]") == 1
    lines = str(err).splitlines()
    assert "injected fault" in lines[0] and lines[-1] == f"schedule: {err.schedule}"
    assert isinstance(err.__cause__, RuntimeError)
    monkeypatch.undo()

    # a differentiable call runs two schedules: the forward (F, the loss's job fused: FB, Note
    # [the loss's backward ahead] in runner.py) and the backward (B)
    out = cm(**batch)
    fwd = cm.last_schedule
    assert str(fwd) == _expected_text(cm.last_placements)
    assert [a.role for a in fwd.actions] == ["fwd"] * (len(fwd.actions) - 1) + ["fused"]
    out.loss.backward()
    bwd = cm.last_schedule
    assert bwd.offset == fwd.next_offset and all(a.role == "bwd" for a in bwd.actions)
    assert str(bwd) == _expected_text(cm.last_placements)
    assert torch.isfinite(out.loss)
