"""The first train plan fits the host's memory (Note [host room] in passes/host_memory.py): the
host's available memory as the system and the cgroup say, the optimizer's share the plan
chooses raised to what the host needs, and a clear error before anything is allocated where
nothing fits."""
import importlib
import re

import pytest
import torch

import rpcompile
from rpcompile.passes.budgets import Budgets
from models import lm_batch
from test_optimizer_on_devices import DEVICES, _qwen

host_memory = importlib.import_module("rpcompile.passes.host_memory")


def test_host_memory_now_is_the_smaller_of_the_system_and_the_cgroup(tmp_path):
    """(available, total): /proc/meminfo's, or a cgroup's limit less its use plus its page cache
    where that is less (v2 and v1 files; an unlimited cgroup is no limit)."""
    now = host_memory.host_memory_now
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000000 kB\nSwapFree: 5 kB\n")
    system = (1000000 * 1024, 24000000 * 1024)
    v2 = tmp_path / "v2"
    v2.mkdir()
    assert now(str(meminfo), str(v2)) == system                   # no cgroup files
    (v2 / "memory.max").write_text("max\n")
    assert now(str(meminfo), str(v2)) == system                   # not limited
    (v2 / "memory.max").write_text(f"{600 << 20}\n")
    (v2 / "memory.current").write_text(f"{300 << 20}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {50 << 20}\nactive_file 7\n")
    assert now(str(meminfo), str(v2)) == (350 << 20, 600 << 20)   # limit - used + cache
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")        # v1's "unlimited"
    assert now(str(meminfo), str(v1)) == system
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{int(1.5 * 2**30)}\n")
    (v1 / "memory" / "memory.stat").write_text(f"inactive_file 0\ntotal_inactive_file {1 << 20}\n")
    assert now(str(tmp_path / "none"), str(v1)) == ((512 << 20) + (1 << 20), 2 << 30)
    assert now(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_the_default_budget_is_what_is_available_with_the_parameters_less_a_margin(monkeypatch):
    params = [torch.zeros(1000), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(5, device="meta")]
    held = 4000 + 20
    assert host_memory.held_host_bytes(params + params[:1]) == held
    monkeypatch.setattr(host_memory, "host_memory_now", lambda: (100 << 30, 120 << 30))
    margin = host_memory.HOST_MARGIN + int(host_memory.HOST_SHARE * (120 << 30))
    assert host_memory.default_host_budget(params) == (100 << 30) + held - margin
    monkeypatch.setattr(host_memory, "host_memory_now", lambda: (4 << 30, 8 << 30))   # a small host: a quarter at most
    assert host_memory.default_host_budget(params) == (3 << 30) + held
    monkeypatch.setattr(host_memory, "host_memory_now", lambda: None)
    assert host_memory.default_host_budget(params) is None


def test_config_reads_the_host_budget_as_a_size():
    assert rpcompile.Config(host_memory_budget="2GiB").host_memory_budget == 2 << 30
    assert rpcompile.Config().host_memory_budget is None
    with pytest.raises(ValueError, match="host_memory_budget='lots' is not a size"):
        rpcompile.Config(host_memory_budget="lots")


def _run(budget=None, share=None, host=None, steps=3, mode="delayed", optimizer=None, forward_first=False):
    model = _qwen(layers=2)
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode=mode,
                                                   memory_budget=budget, optimizer_on_devices=share,
                                                   host_memory_budget=host))
    opt = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if forward_first:      # (its plan chooses a share: Note [a call's share chosen again] in compiled.py)
        with torch.no_grad():
            cm(**lm_batch(batch=4, seq=64, vocab=256, seed=0))
    if mode != "exact":
        cm.attach_optimizer(opt)
    losses = []
    for t in range(steps):
        losses.append(float(cm.train_step(**lm_batch(batch=4, seq=64, vocab=256, seed=t))))
        if mode == "exact":
            opt.step()
            opt.zero_grad()
    cm.synchronize()
    return cm, losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def tight(monkeypatch):
    """The share chosen on these CPU devices as on GPUs, and a device budget the jobs fill (the
    room leaves no share): (that budget, the host memory of a plan with every update on the host,
    the losses and parameters of its steps)."""
    from rpcompile import passes
    from rpcompile.passes.host_memory import device_optimizer_bytes
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")
    with pytest.raises(rpcompile.PlanningError) as e:
        _run(1, share=0.0, steps=1)
    budget = e.value.min_budget + device_optimizer_bytes(list(_qwen(layers=2).parameters()), 1.0, 2)
    cm, losses, params = _run(budget, share=0.0)
    return budget, cm.plan.host_memory.total, losses, params


def test_the_plan_puts_on_the_devices_what_the_host_has_no_room_for(tight):
    """A host budget below what a plan with every update on the host takes: the plan chooses a
    share of the optimizer on the devices that fits it (the room the jobs leave gives none, so
    they are cut again beside it), says so, and trains as with every update on the host."""
    budget, at_home, losses, params = tight
    cm, more_losses, more_params = _run(budget)
    assert cm.plan.optimizer_share == 0.0 and cm.plan.host_memory.budget > at_home      # (what the room gives)
    assert cm.plan.host_share == 0.0
    host = at_home - 60_000
    cm, got_losses, got_params = _run(budget, host=host)
    hm = cm.plan.host_memory
    assert 0 < cm.plan.host_share <= cm.plan.optimizer_share < 1 and hm.total <= host < at_home
    assert cm.plan.memory_budget == budget - hm.device_optimizer
    assert max(cm.plan.stage_plan.job_memory) <= cm.plan.memory_budget
    assert "within a host budget of" in str(cm.plan) and "a share of" in str(cm.plan)
    assert got_losses == pytest.approx(losses, rel=1e-6)
    for a, b in zip(got_params, params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_plan_that_does_not_fit_the_host_stops_before_anything_moves(tight):
    """Where no share fits (a budget below even the whole's), where the share is fixed, and in
    exact mode: a HostMemoryError from the first step, saying what the plan needs and what to
    change; the parameters are the model's own, nothing allocated for the optimizer."""
    budget, at_home, _, _ = tight
    model = _qwen(layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                   memory_budget=budget, host_memory_budget=at_home // 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cm.attach_optimizer(opt)
    with pytest.raises(rpcompile.HostMemoryError, match="not even with all of the optimizer's state") as e:
        cm.train_step(**lm_batch(batch=4, seq=64, vocab=256, seed=0))
    assert e.value.budget == at_home // 4 < e.value.needed
    assert "(Config.host_memory_budget)" in str(e.value) and "optimizer_mode='overlapped'" in str(e.value)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b) and p.grad is None
    assert not opt.state and cm.runner.host_grads.flat is None
    with pytest.raises(host_memory.HostMemoryError, match=r"a share of at least 0\.\d+ .*optimizer_on_devices=0\.0"):
        _run(budget, share=0.0, host=at_home - 60_000, steps=1)
    with pytest.raises(host_memory.HostMemoryError, match="use optimizer_mode='delayed' or 'overlapped' with"):
        _run(None, host=at_home // 4, mode="exact", steps=1)
    # an optimizer stepped per parameter on the host (not AdamW, Adam or SGD) has a share of 0, even
    # after a forward call's plan chose one: the error names it instead of optimizer_on_devices
    with pytest.raises(rpcompile.HostMemoryError, match=r"a share of at least 0\.\d+ .*\(Adagrad steps on the host only\)") as e:
        _run(budget, host=at_home - 60_000, steps=1, optimizer=torch.optim.Adagrad, forward_first=True)
    assert "an optimizer the plan can step on the GPUs" in str(e.value) and "optimizer_on_devices" not in str(e.value)


def test_exact_mode_warns_of_the_state_its_optimizer_would_add(monkeypatch):
    """In exact mode the user's optimizer allocates its state: a budget that holds rpcompile's
    buffers but not AdamW's state trains, with a warning that says so."""
    cm, _, _ = _run(None, mode="exact", steps=1)
    hm = cm.plan.host_memory
    with pytest.warns(UserWarning, match="with AdamW's state"):
        _run(None, mode="exact", host=hm.total - hm.optimizer_state // 2, steps=1)


def test_the_default_budget_is_the_hosts(monkeypatch):
    """With no Config.host_memory_budget the host's available memory decides: a host with
    almost nothing free stops the first step with the error, naming the default."""
    monkeypatch.setattr(host_memory, "host_memory_now", lambda: (4096, 1 << 30))
    with pytest.raises(host_memory.HostMemoryError, match=r"Config\.host_memory_budget=None"):
        _run(None, share=0.0, steps=1)


def test_a_longer_sequence_keeps_the_state_the_host_has_no_room_for(monkeypatch):
    """Where the host needed the share, a longer sequence whose jobs do not fit beside it stops
    with the planner's error instead of bringing the state home (which a share the plan chose
    for the device room alone does: test_optimizer_on_devices.py); the short length trains on."""
    from rpcompile import passes
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")

    def compiled(**kw):
        model = _qwen()
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       lm_head_shards=4, **kw))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return model, cm

    _, probe = compiled(memory_budget=1, optimizer_on_devices=0.0)
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=4, seq=256, vocab=256, seed=0))
    budget = e.value.min_budget + 1000                      # 256 tokens fit with nothing beside the jobs
    _, home = compiled(memory_budget=budget, optimizer_on_devices=0.0)
    home.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
    hm = home.plan.host_memory
    model, cm = compiled(memory_budget=budget, host_memory_budget=hm.total - hm.optimizer_state // 2)
    cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
    assert cm.plan.host_share > 0 and cm.runner.host_share == cm.plan.host_share
    cm.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch(batch=4, seq=256, vocab=256, seed=1))
    assert not isinstance(e.value, host_memory.HostMemoryError)
    assert cm.runner.optimizer_share > 0 and cm.runner.overlapped.masters.on_devices
    cm.synchronize()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=2))


def test_planning_again_holds_back_more_until_the_plan_fits(monkeypatch):
    """compile_graph plans again while a plan's cut puts more on the host than its share left room
    for, each time holding back at least what the last cut took (Llama-3.1-8B on one H200 within
    90 GiB needed four plans), and stops with the error after HOST_TRIES."""
    from rpcompile import passes
    cuts, held = [8, 10, 12], []

    def run(st):
        held.append(st.host_cut)
        if len(held) <= len(cuts):
            e = host_memory.HostMemoryError("over", needed=100 + cuts[len(held) - 1], budget=100)
            e.cut = cuts[len(held) - 1]
            raise e
        return "plan"
    monkeypatch.setattr(passes, "_run_passes", run)
    config = rpcompile.Config(devices=DEVICES)
    assert passes.compile_graph(None, config, "train", budgets=Budgets(host=100)) == "plan"
    assert held == [0, 8, 10, 12]
    held.clear()
    cuts[:] = [8 + k for k in range(passes.HOST_TRIES)]
    with pytest.raises(host_memory.HostMemoryError):
        passes.compile_graph(None, config, "train", budgets=Budgets(host=100))
    assert len(held) == passes.HOST_TRIES


def test_a_later_length_whose_activations_the_host_has_no_room_for_stops_before_it_runs():
    """The first train plan sets the host's buffers within the budget; a later call at a longer
    length (a train step or a forward call), whose activations and checkpoints would take the
    host past that budget, stops with a HostMemoryError before it runs, saying the longest
    length that fits, and training at the first length goes on as if it had not been tried."""
    def compiled(host=None):
        model = _qwen(layers=2)
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       host_memory_budget=host))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return model, cm

    short = [lm_batch(batch=4, seq=8, vocab=256, seed=t) for t in range(3)]
    long = lm_batch(batch=4, seq=64, vocab=256, seed=0)
    model, cm = compiled()
    losses = [float(cm.train_step(**b)) for b in short]
    cm.synchronize()
    at_short = cm.plan.host_memory
    reference = [p.detach().clone() for p in model.parameters()]
    _, cm = compiled()
    cm.train_step(**long)
    at_long = cm.plan.host_memory           # (a first plan at the longer length)
    assert at_long.activations > at_short.activations and at_long.total > at_short.total

    host = (at_short.total + at_long.total) // 2
    model, cm = compiled(host)
    got = [float(cm.train_step(**short[0]))]
    assert cm.plan.host_memory.budget == host
    cm.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(rpcompile.HostMemoryError, match="at this call's sizes its activations and checkpoints") as e:
        cm.train_step(**long)
    assert e.value.budget == host < e.value.needed
    assert "shorter sequences" in str(e.value) and "at the model's first train step" not in str(e.value)
    assert "(Config.host_memory_budget)" in str(e.value)
    longest = int(re.search(r"sequences of at most (\d+) tokens fit", str(e.value)).group(1))
    assert 8 < longest < 64
    with torch.no_grad(), pytest.raises(rpcompile.HostMemoryError, match="activations and checkpoints"):
        cm(**long)
    cm.synchronize()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    got += [float(cm.train_step(**b)) for b in short[1:]]
    cm.synchronize()
    assert got == pytest.approx(losses, rel=1e-6)
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)
    # the longest length the error said fits trains
    assert torch.isfinite(cm.train_step(**lm_batch(batch=4, seq=longest, vocab=256, seed=3)))
