"""Replicas (Note [replicas] in runtime/replicas.py): each device runs the one-device plan over
its share of the microbatches and the copies sum their gradients. The schedule is checked
without threads; training is checked against eager PyTorch in every optimizer mode, on CPU
devices (worker threads: the same code paths as on GPUs but for the device-to-device reads;
worker processes: the gloo process group where GPUs have NCCL's)."""
import copy
from types import SimpleNamespace

import pytest
import torch

import rpcompile
from rpcompile.runtime.schedule import build_schedule, microbatch_shares

from models import MLP, lm_batch, qwen3
from parity import close, delayed_run, inject_fault, train_both


def _chain(kinds):
    return [(k, SimpleNamespace(index=k, inputs=[f"x{k}"]), kind) for k, kind in enumerate(kinds)]


def test_shares_cover_the_microbatches_in_order():
    assert microbatch_shares(4, 2) == [range(0, 2), range(2, 4)]
    assert microbatch_shares(5, 2) == [range(0, 3), range(3, 5)]
    assert microbatch_shares(3, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]
    for m in range(1, 9):
        for r in range(1, 5):
            shares = microbatch_shares(m, r)
            assert [mb for s in shares for mb in s] == list(range(m))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_replicated_schedule_prints_and_marks_one_copy():
    s = build_schedule(_chain(["fwd", "fused", "bwd"]), 2, offset=1, replicas=2, num_microbatches=3)
    assert str(s) == "0F@0[0:2] 0F@1[2:3] 1FB@0[0:2] 1FB@1[2:3] 2B@0[0:2] 2B@1[2:3]"
    assert s.render(failed=1, device=1) == "0F@0[0:2] 0F@1[2:3] 1FB@0[0:2] [1FB@1[2:3] failed] 2B@0[0:2] 2B@1[2:3]"
    # each copy's next job is its own next job, on its own device
    assert s.replicas == 2
    for a in s.actions:
        assert a.device == a.replica
        if a.job < 2:
            assert (a.next_on_device, a.next_device) == (a.job + 1, a.device)
    with pytest.raises(ValueError, match="number of microbatches"):
        build_schedule(_chain(["fwd", "fused"]), 2, replicas=2)
    with pytest.raises(ValueError, match="3 replicas"):
        build_schedule(_chain(["fused"]), 2, replicas=3, num_microbatches=4)


@pytest.mark.parametrize("devices,microbatches,rows,workers", [
    (2, 4, 5, "threads"), (2, 3, 5, "threads"), (3, 3, 2, "threads"), (3, 3, 2, "processes")])
def test_replicas_train_as_eager(devices, microbatches, rows, workers):
    """Even and uneven shares, and a batch of two rows over three copies (the third runs no
    microbatch): loss, gradients and parameters after SGD-momentum steps as in eager PyTorch,
    with the copies in worker threads or in worker processes (Note [replicas in worker processes])."""
    model = qwen3()
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, memory_budget="300KiB",
                           data_parallel=True, workers=workers)
    cm = train_both(model, [lm_batch(batch=rows, seed=s) for s in range(3)], cfg, check_every_step=True)
    assert cm.plan.replicas == devices and "replicas" in str(cm.plan)
    text = str(cm.last_schedule)
    for r, share in enumerate(microbatch_shares(min(rows, microbatches), devices)):
        assert f"@{r}[{share.start}:{share.stop}]" in text


def test_replicas_in_overlapped_mode_equal_eager():
    model = qwen3(tied=True)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4, memory_budget="300KiB",
                                                   optimizer_mode="overlapped", data_parallel=True))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), max_grad_norm=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    for step in range(3):
        batch = lm_batch(seed=step)
        loss = cm.train_step(**batch)
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt_ref.step(), opt_ref.zero_grad()
        close(loss, loss_ref.detach(), 1e-5, 1e-6, f"loss at step {step}")
    cm.synchronize()
    assert cm.plan.replicas == 2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, name)


def test_replicas_in_delayed_mode_equal_the_pipeline(delayed_reference):
    """The same delayed steps as parity.delayed_run's pipeline (one microbatch a copy)."""
    losses, params = delayed_run(data_parallel=True)
    for t, (a, b) in enumerate(zip(losses, delayed_reference[0], strict=True)):
        close(a, b, 1e-5, 1e-6, f"loss at step {t}")
    for a, b in zip(params, delayed_reference[1], strict=True):
        close(a, b, 1e-4, 1e-6, "parameter after three delayed steps")


def test_replicas_in_worker_processes_equal_the_pipeline_and_a_failed_copy_changes_nothing(delayed_reference):
    """parity.delayed_run's delayed steps with the copies in worker processes, and before the
    last a batch that fails in the second copy's share only: the first copy, waiting for it
    at the exchange, stops; the error comes to the caller with that copy marked, and nothing
    changed (Note [replicas in worker processes])."""
    def fail(cm, model, t):
        cm.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        bad = lm_batch(seed=t)
        bad["input_ids"] = bad["input_ids"].clone()
        bad["input_ids"][4, 3] = 10_000          # row 4: the second microbatch, out of the vocabulary
        with pytest.raises(rpcompile.StageError) as info:
            cm.train_step(**bad)
        err = info.value
        assert err.worker == 1 and err.microbatch == 1
        assert "@1[1:2] failed]" in err.schedule and "@0[0:1] failed]" not in err.schedule
        cm.synchronize()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(p.grad is None for p in model.parameters())

    losses, params = delayed_run("processes", fail_at=2, fail=fail, data_parallel=True)
    for t, (a, b) in enumerate(zip(losses, delayed_reference[0], strict=True)):
        close(a, b, 1e-5, 1e-6, f"loss at step {t}")
    for a, b in zip(params, delayed_reference[1], strict=True):
        close(a, b, 1e-4, 1e-6, "parameter after three delayed steps")


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_each_copy_gets_the_next_steps_first_weights_early(monkeypatch, workers):
    """Delayed mode sends the next step's first job's weights up as a step ends (Note [resident
    weights]); with replicas every device runs a copy of that job, so each gets them, and each
    worker's copy claims its own upload. (On CPU devices nothing goes up: the requests and the
    claims are what is checked; on GPUs the 2x H200 run of the thirty-fifth session.)"""
    from rpcompile.runtime.device import DeviceRuntime
    from rpcompile.runtime.processes import ProcessExecutor
    from rpcompile.runtime.worker import Worker
    asked = []
    if workers == "threads":
        real = DeviceRuntime.prefetch

        def prefetch(dev, key, *a, **kw):
            if key[0] == "next step":
                asked.append((dev.worker_index, key[1]))
            return real(dev, key, *a, **kw)
        monkeypatch.setattr(DeviceRuntime, "prefetch", prefetch)
    else:
        real = ProcessExecutor.send_prefetch

        def send_prefetch(ex, worker, *a, **kw):
            asked.append((worker, None))
            return real(ex, worker, *a, **kw)
        monkeypatch.setattr(ProcessExecutor, "send_prefetch", send_prefetch)
    model = qwen3(seed=3)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, workers=workers,
                                                   optimizer_mode="delayed", data_parallel=True))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    for t in range(3):
        assert torch.isfinite(cm.train_step(**lm_batch(seed=t)))
    cm.synchronize()
    assert cm.plan.replicas == 2 and cm.plan.early_first_upload      # (no budget: room for it)
    # a request for each later step to each device
    assert len(asked) >= 4 and {w for w, _ in asked} == {0, 1}
    if workers == "threads":
        assert sorted(asked) == sorted((w, t) for t in {t for _, t in asked} for w in (0, 1))
    # a worker's claim: the token named for it goes to its copy of the first job, no other one
    worker = SimpleNamespace(index=1, dev=SimpleNamespace(prefetched={("first", 7): "mine", ("first", 6): "old"}))
    step = object()
    actions = build_schedule(_chain(["fused"]), 2, replicas=2, num_microbatches=2).actions
    Worker.claim_first_upload(worker, step, {"actions": actions, "first_upload": {0: 5, 1: 7}})
    assert worker.dev.prefetched == {(id(step), 0): "mine"}
    Worker.claim_first_upload(worker, step, {"actions": actions, "first_upload": {0: 5}})
    assert worker.dev.prefetched == {(id(step), 0): "mine"}     # (nothing named for it: no "first" left)


def test_a_copy_joins_the_sum_unless_a_copy_not_ready_failed():
    """Note [replicas in worker processes]: a copy waits for every copy's word before the
    collective; a failure of a copy that already gave it (in a later job) does not stop it, as
    the others may be in the collective already; a failure of one that has not, does."""
    import threading
    from rpcompile.runtime.replicas import PeerExchange
    from rpcompile.runtime.worker import RemoteFailure

    class Step:      # (two microbatches of a bf16 set over three copies: Note [one microbatch a copy])
        def __init__(self):
            self.error, self.failed_copies = None, set()
            self.micro, self.grads = [None, None], SimpleNamespace(dtype=torch.bfloat16)

        def error_is_remote(self):
            return isinstance(self.error, RemoteFailure)

    dev = SimpleNamespace(device=torch.device("cpu"), is_cpu=True)
    said = []
    # copy 1 said it is ready and then failed; copy 2's word comes later: copy 0 waits for it
    ex, step = PeerExchange(3, said.append, lambda: None), Step()
    ex.arrive(1, [5])
    step.error, step.failed_copies = RemoteFailure(), {1}
    threading.Timer(0.2, ex.arrive, (2, [7])).start()
    assert ex.share(0, None, {3}, dev, step, 10) == {3, 5, 7} and said == [[3]]
    assert ex.padded.shape == ex.out.shape == (12,) and not ex.padded.any()   # (no microbatch: zeros)
    assert ex.padded.dtype == ex.out.dtype == torch.bfloat16        # (the dtype the other copies take)
    assert ex.wide.shape == (4,) and ex.wide.dtype == torch.float32    # (Note [narrow slices summed by their copy])
    # copy 2 failed before saying so: copy 0 stops
    ex, step = PeerExchange(3, said.append, lambda: None), Step()
    ex.arrive(1, [5])
    step.error, step.failed_copies = RemoteFailure(), {2}
    assert ex.share(0, None, {3}, dev, step, 10) is None
    assert [PeerExchange(3, None, None).bounds(r, 10) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]


def _bit_equal(narrow, wide):
    """Two delayed_run results (losses, parameters) equal bit for bit."""
    for t, (a, b) in enumerate(zip(narrow[0], wide[0], strict=True)):
        assert torch.equal(a, b), f"loss at step {t}: {a.item()} against {b.item()}"
    for a, b in zip(narrow[1], wide[1], strict=True):
        assert torch.equal(a, b), f"a parameter after three delayed steps: max abs error {(a - b).abs().max():.3g}"


def test_a_narrow_sum_is_made_in_fp32_a_part_at_a_time(monkeypatch):
    """Note [copies' sums a part at a time]: each copy stages a part of every copy's slice in the
    sum's dtype (the host set's bf16, for bf16 and for fp32 accumulators), the all-to-all brings it
    every copy's part of slice r, and that is summed in fp32 and rounded once into copy r's own
    slice of its accumulator: 1 + 2^-8 + 2^-8 is 1 + 2^-7 so, where bf16 partial sums round it to 1
    (Note [narrow slices summed by their copy])."""
    import torch.distributed as dist
    from rpcompile.runtime.replicas import PeerExchange

    n, numel = 3, 10                       # slices of 4 (padded to 12), slice 1 is 4:8
    received = torch.full((n, 4), 2.0 ** -8)
    received[0] = torch.tensor([1.0, -3.0, 0.5, 7.0])
    received = received.bfloat16()
    monkeypatch.setattr(PeerExchange, "SUM_SLICE", 3)       # parts 0:3, 3:4 of each slice
    step = SimpleNamespace(error=None, failed_copies=set(), micro=[None] * n,
                           grads=SimpleNamespace(dtype=torch.bfloat16))
    dev = SimpleNamespace(device=torch.device("cpu"), is_cpu=True)
    for dtype in (torch.bfloat16, torch.float32):
        sent = []

        def all_to_all_single(out, inp, group=None):
            a = sum(p.shape[1] for p in sent)
            sent.append(inp.view(n, -1).clone())
            out.view(n, -1).copy_(received[:, a:a + sent[-1].shape[1]])

        monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
        ex = PeerExchange(n, lambda keys: None, lambda: None)
        ex.arrive(0, [1])
        ex.arrive(2, [2])
        acc = ex.accumulator(1, dev, torch.empty(numel, dtype=torch.bfloat16), None, dtype)
        acc.copy_(torch.arange(numel))
        padded = ex.padded
        assert ex.share(1, acc, {3}, dev, step, numel) == {1, 2, 3}
        assert ex.wide.shape == (3,) and ex.wide.dtype == torch.float32 and ex.send.dtype == torch.bfloat16
        assert ex.received_bytes(1, numel) == 4 * (n - 1) * 2      # (the trace's figure: bf16 sent)
        total = ex.reduce(1, dev, numel)
        assert [p.shape for p in sent] == [(n, 3), (n, 1)]
        assert torch.equal(torch.cat(sent, 1).view(-1)[:numel], torch.arange(numel).bfloat16())   # (padded)
        assert total.dtype == dtype and torch.equal(total, received.float().sum(0).to(dtype))
        assert total.data_ptr() == padded[4:].data_ptr()        # (copy 1's own slice of its accumulator)
        assert total[0].item() == 1.0078125 and (received[0] + received[1] + received[2])[0].item() == 1.0
        assert ex.padded is None and ex.out is None and ex.wide is None and ex.send is None


def test_a_kept_accumulator_serves_the_next_run_where_it_fits():
    """Note [copies' sum beside the next step]: a copy of one job keeps its accumulator from run
    to run (its sum lands in its own slice of it), and makes a new one, kept instead, where the
    piece, the dtype or the job (another plan's) changed; `release` gives it back."""
    import torch.distributed as dist
    from rpcompile.runtime.replicas import KeptSum, PeerExchange

    def scatter(out, inp, group=None):     # (one copy of two: its own part of slice 0, doubled)
        out.copy_(2 * inp.view(2, -1)[0])

    step = SimpleNamespace(error=None, failed_copies=set(), micro=[None] * 4,
                           grads=SimpleNamespace(dtype=torch.float32))
    dev = SimpleNamespace(device=torch.device("cpu"), is_cpu=True)
    kept, made = KeptSum(), []
    runs = ((6, torch.float32, "a"), (6, torch.float32, "a"), (8, torch.float32, "a"), (8, torch.bfloat16, "a"),
            (8, torch.bfloat16, "b"))
    for numel, dtype, key in runs:
        ex = PeerExchange(2, lambda keys: None, lambda: None)
        ex.kept, ex.kept_key = kept, key
        ex.arrive(1, [0])
        acc = ex.accumulator(0, dev, torch.empty(numel), None, dtype)
        made.append(ex.padded)
        acc.copy_(torch.arange(numel))
        assert ex.share(0, acc, {0}, dev, step, numel) == {0}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, "reduce_scatter_tensor", scatter)
            mp.setattr(dist, "reduce_scatter_single", scatter, raising=False)
            mp.setattr(dist, "all_to_all_single",      # (the other copy's part of slice 0 as this one's)
                       lambda out, inp, group=None: out.view(2, -1).copy_(inp.view(2, -1)[:1].expand(2, -1)))
            total = ex.reduce(0, dev, numel)
        assert torch.equal(total.float(), 2 * torch.arange(numel // 2).float())
        assert total.data_ptr() == made[-1].data_ptr() and kept.padded is made[-1]
        assert ex.landed(total, dev) is None and kept.free is None     # (CPU: nothing in flight)
    assert made[1] is made[0] and all(made[k] is not made[k - 1] for k in (2, 3, 4)) and kept.key == "b"
    kept.release(dev)
    assert (kept.padded, kept.key, kept.free) == (None, None, None)


def test_copies_of_one_job_in_worker_processes_train_as_eager():
    """Copies of one fused job, two microbatches each, in worker processes: the accumulator each
    keeps from step to step (Note [copies' sum beside the next step]) starts each step's sum
    afresh, and the parts summed a part at a time (Note [copies' sums a part at a time]) give loss,
    gradients and parameters after SGD-momentum steps as in eager PyTorch, step after step (the
    parts: test_a_narrow_sum_is_made_in_fp32_a_part_at_a_time), a longer batch's plan between
    them, of several jobs a copy (the kept accumulator is given back before it and made again after)."""
    model = qwen3()
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=4, data_parallel=True, workers="processes",
                           memory_budget="600KiB")
    batches = [lm_batch(seed=0), lm_batch(seq=48, seed=1), lm_batch(seed=2), lm_batch(seed=3)]
    cm = train_both(model, batches, cfg, steps=4, check_every_step=True, min_stages=1)
    plans = cm._plans.plans()
    assert len(plans) == 2 and len(plans[0].stages) == 1 and len(plans[1].stages) > 1
    assert plans[0].replicas == plans[1].replicas == 2 and cm.plan is plans[0]
    assert "0FB@0[0:2] 0FB@1[2:4]" in str(cm.last_schedule)
    assert {(s["stream"], s["kept"]) for s in cm.last_trace if s["name"] == "sum_replicas"} == {("sums", True)}


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_copies_of_one_microbatch_accumulate_in_bf16_and_bring_down_the_same_values(monkeypatch, workers):
    """Note [one microbatch a copy]: bf16 working copies in delayed mode (a bf16 host set) and
    one microbatch a copy: the accumulators are bf16, and the steps' losses and parameters
    equal, bit for bit, those of fp32 accumulators in worker threads (two copies: their sum is
    rounded once either way), the copies in worker processes summing in the collective (gloo
    here) too."""
    from rpcompile.runtime import grads, job

    def run(workers, rule):
        monkeypatch.setattr(job, "accumulator_dtype", rule)
        return delayed_run(workers, data_parallel=True, dtype=torch.bfloat16)

    made = []

    def spy(step, copies):
        made.append((len(step.micro), copies, grads.accumulator_dtype(step, copies)))
        return made[-1][2]

    wide = run("threads", lambda step, copies: torch.float32)
    narrow = run(workers, spy)
    if workers == "threads":     # (worker processes take the rule themselves)
        assert made and set(made) == {(2, 2, torch.bfloat16)}
    _bit_equal(narrow, wide)
    step = SimpleNamespace(micro=[None] * 3, grads=SimpleNamespace(dtype=torch.bfloat16))
    assert [grads.accumulator_dtype(step, n) for n in (1, 2, 3)] == [torch.float32, torch.float32, torch.bfloat16]


def test_four_copies_in_processes_sum_their_bf16_slices_in_fp32(monkeypatch):
    """Note [narrow slices summed by their copy]: four copies of one microbatch each, in worker
    processes (gloo), bring down the gradients of fp32 accumulators bit for bit, as worker
    threads do; a bf16 reduce-scatter rounded every partial sum (every parameter differed, up to
    1e-3, after three AdamW steps)."""
    from rpcompile.runtime import job

    monkeypatch.setattr(job, "accumulator_dtype", lambda step, copies: torch.float32)
    wide = delayed_run("threads", devices=4, data_parallel=True, dtype=torch.bfloat16)
    monkeypatch.undo()      # (worker processes take the rule themselves: bf16, one microbatch a copy)
    narrow = delayed_run("processes", devices=4, data_parallel=True, dtype=torch.bfloat16)
    _bit_equal(narrow, wide)


def test_a_failing_copy_raises_and_changes_nothing(monkeypatch):
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4,
                                                   memory_budget="300KiB", data_parallel=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    batch = lm_batch()
    cm.train_step(**batch)
    opt.step(), opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    stage = cm.plan.stages[-1].index
    inject_fault(monkeypatch, stage, microbatch=3)     # in the second copy's share only
    with pytest.raises(rpcompile.StageError) as e:
        cm.train_step(**batch)
    err = e.value
    assert err.stage == stage and err.microbatch == 3 and err.worker == 1
    assert f"[{stage}B@1[2:4] failed]" in str(err) and f" {stage}B@0[0:2] " in f" {err.schedule} "
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    monkeypatch.undo()
    assert torch.isfinite(cm.train_step(**batch))      # the workers carry on


def test_the_planner_takes_the_faster_of_pipeline_and_replicas(monkeypatch):
    """With data_parallel=None the plan is the one of the two with the lower estimate (on GPUs
    driven by threads; CPU devices keep the pipeline unless asked)."""
    from rpcompile import passes
    from rpcompile.capture import capture_call

    # one capture planned three ways, as a compiled model's first call plans it (the check is of
    # the plans: the three compiled models and steps this made checked nothing more)
    cap = capture_call(qwen3(), (), {**lm_batch(), "use_cache": False}, dtype=None, device=torch.device("cpu"),
                       dynamic_lengths=True)

    def plan(dp):
        return passes.compile_graph(cap, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4,
                                                          memory_budget="300KiB", data_parallel=dp), "train")
    pipeline = plan(None)          # (CPU devices: the pipeline, unweighed)
    monkeypatch.setattr(passes, "_weighs_replicas", lambda config: config.data_parallel is not False)
    replicas, chosen = plan(True), plan(None)
    assert pipeline.replicas == 1 and replicas.replicas == 2
    assert pipeline.est_step_time != replicas.est_step_time
    faster = min(pipeline, replicas, key=lambda p: p.est_step_time)
    assert chosen.replicas == faster.replicas
    assert chosen.est_step_time == pytest.approx(faster.est_step_time)


def test_copies_of_one_microbatch_each_are_costed_summing_the_host_sets_dtype(monkeypatch):
    """Note [one microbatch a copy]: where each copy runs one microbatch its accumulator is in the
    host gradient set's dtype (bf16 with an attached optimizer and bf16 compute), and the plan
    costs the copies' sum at that width; with more microbatches than copies, at fp32, unless the
    copies are worker processes, which send the host set's dtype (Note [copies' sums a part at a time])."""
    from rpcompile import passes
    from rpcompile.capture import capture_call
    cap = capture_call(qwen3(), (), {**lm_batch(batch=4), "use_cache": False}, dtype=torch.bfloat16,
                       device=torch.device("cpu"), dynamic_lengths=True)
    widths = []
    real = passes.exchange_seconds
    monkeypatch.setattr(passes, "exchange_seconds", lambda *a: widths.append(a[3]) or real(*a))
    for mode, m, workers in (("delayed", 2, "threads"), ("delayed", 4, "threads"), ("exact", 2, "threads"),
                             ("delayed", 4, "processes"), ("exact", 4, "processes")):
        plan = passes.compile_graph(cap, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=m, data_parallel=True,
                                                          dtype=torch.bfloat16, optimizer_mode=mode, workers=workers),
                                    "train")
        assert plan.replicas == 2
    assert widths == [2, 4, 4, 2, 4]      # (exact mode: fp32 host gradients)


def test_what_replicas_refuse(monkeypatch):
    with pytest.raises(ValueError, match="data_parallel='yes'"):
        rpcompile.Config(data_parallel="yes")
    with pytest.raises(ValueError, match="choose one"):
        rpcompile.Config(devices=["cpu", "cpu"], data_parallel=True, peer_transfers=True)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 2)
        assert rpcompile.Config(devices=["cuda:0", "cuda:1"]).workers == "processes"
        assert rpcompile.Config(devices=["cuda:0", "cuda:1"], data_parallel=True).workers == "processes"
        from rpcompile.passes import _weighs_replicas
        assert _weighs_replicas(rpcompile.Config(devices=["cuda:0", "cuda:1"], workers="threads"))
        assert not _weighs_replicas(rpcompile.Config(devices=["cuda:0", "cuda:1"], peer_transfers=True))
        assert _weighs_replicas(rpcompile.Config(devices=["cuda:0", "cuda:1"]))      # processes
        assert not _weighs_replicas(rpcompile.Config(devices=["cuda:0", "cuda:1"], data_parallel=False))
        assert _weighs_replicas(rpcompile.Config(devices=["cuda:0", "cuda:1"], workers="processes",
                                                 data_parallel=True))
        # NCCL takes one GPU per worker process: a GPU named twice keeps the pipeline there
        with pytest.raises(ValueError, match="GPU named twice"):
            rpcompile.Config(devices=["cuda:0", "cuda:0"], workers="processes", data_parallel=True)
        assert rpcompile.Config(devices=["cuda:0", "cuda:0"], workers="processes").repeats_a_gpu
        assert not rpcompile.Config(devices=["cuda:0", "cuda:1"]).repeats_a_gpu
        assert rpcompile.Config(devices=["cuda:0", "cuda:0"], data_parallel=True).workers == "threads"

    class Normed(torch.nn.Module):   # running statistics: updated microbatch after microbatch
        def __init__(self):
            super().__init__()
            self.mlp, self.bn = MLP(), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.mlp(x)).square().mean()
    cm = rpcompile.compile(Normed(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                      data_parallel=True))
    with pytest.raises(rpcompile.PlanningError, match="updates buffers in place"):
        cm.train_step(torch.randn(8, 8))


def test_a_forward_call_with_replicas_equals_eager():
    model = qwen3()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4,
                                                   memory_budget="300KiB", data_parallel=True))
    batch = lm_batch()
    with torch.no_grad():
        out, want = cm(**batch), ref(**batch)
    assert str(cm.last_schedule).startswith("0F@0[0:2] 0F@1[2:4]")
    close(out.logits, want.logits, 1e-5, 1e-6, "logits")
    close(out.loss, want.loss, 1e-5, 1e-6, "loss")
