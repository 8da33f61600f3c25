"""Dynamic sequence lengths (Note [dynamic lengths] in rpcompile/lengths.py, Note [plans per
length] in rpcompile/plan_cache.py): one capture serves every length, a call whose sizes break
the capture's relations captures again, and a length that breaks the memory budget re-plans."""
import copy

import pytest
import torch
import torch.nn as nn

import rpcompile
from rpcompile import compiled as compiled_mod
from rpcompile.passes import regions
from rpcompile.passes.at_sizes import job_memory_at

from models import lm_batch, qwen3
from parity import scalar_loss_step, train_both


@pytest.fixture
def captures(monkeypatch):
    """Counts capture_call calls (dynamo traces of the model)."""
    calls = []
    real = compiled_mod.capture_call

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(compiled_mod, "capture_call", counting)
    return calls


def _batches(lengths, batch=5):
    return [lm_batch(batch=batch, seq=L, seed=i) for i, L in enumerate(lengths)]


def test_one_capture_serves_every_length(captures):
    """Qwen3 at lengths 16, 24, 16, 40 on 2 devices, 2 microbatches: one capture, one plan, and
    the loss, every gradient and the parameters after SGD-momentum steps equal eager at every step."""
    lengths = [16, 24, 16, 40]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    cm = train_both(qwen3(), _batches(lengths), cfg, steps=len(lengths), check_every_step=True)
    assert len(captures) == 1
    assert len(cm._plans.plans()) == 1
    length = next(s for s, _, what in cm.plan.symbol_legend() if "input_ids" in what and "dynamic size" in what)
    assert [d[length] for d in cm.plan.served] == [16, 24, 40]
    assert f"{length} = 16, 24, 40" in str(cm.plan)


def test_static_lengths_capture_each_length(captures):
    """Config(dynamic_lengths=False): the old behaviour, a capture per length (the test above can fail)."""
    lengths = [16, 24, 16]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, dynamic_lengths=False)
    # (1 layer: what is counted is captures, each a dynamo trace of the model)
    train_both(qwen3(layers=1), _batches(lengths), cfg, steps=len(lengths), min_stages=0)
    assert len(captures) == 2


class _SameLengthBranch(nn.Module):
    """Takes another path when its two sequences differ in length: the capture at equal lengths
    holds only while they are equal (dynamo guards the branch)."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.b = nn.Linear(8, 8)

    def forward(self, x, y, t):
        h = x
        for layer in self.a:
            h = torch.tanh(layer(h))
        g = self.b(y)
        if x.shape[1] == y.shape[1]:
            h = h * torch.sigmoid(g)               # position by position
        else:
            h = h * torch.sigmoid(g.mean(1, keepdim=True))
        return ((h.mean(1) - t) ** 2).mean()


def test_sizes_that_break_the_capture_capture_again(captures):
    g = torch.Generator().manual_seed(0)

    def batch(lx, ly):
        return {"x": torch.randn(6, lx, 8, generator=g), "y": torch.randn(6, ly, 8, generator=g),
                "t": torch.randn(6, 8, generator=g)}

    batches = [batch(16, 16), batch(24, 24), batch(24, 32), batch(40, 40), batch(24, 32)]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    cm = train_both(_SameLengthBranch(), batches, cfg, eager_step=scalar_loss_step, steps=len(batches),
                    min_stages=0, check_every_step=True)
    # 16/16 captured; 24/24 reused it; 24/32 broke the guard x.shape[1] == y.shape[1]: captured
    # again; 40/40 back to the first; 24/32 again: the second capture.
    assert len(captures) == 2
    assert len(cm._plans.plans()) == 2


def test_length_over_the_memory_budget_replans(captures):
    """A budget that the plan made at length 16 fits but not at 48: at 48 the same capture is
    planned again, with more stage jobs, and trains like eager."""
    model = qwen3(layers=2)
    short, long = lm_batch(batch=4, seq=16), lm_batch(batch=4, seq=48, seed=2)

    def min_budget(batch):
        probe = rpcompile.compile(copy.deepcopy(model), rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2,
                                                                         memory_budget=1))
        with pytest.raises(rpcompile.PlanningError) as e:
            probe.train_step(**batch)
        return e.value.min_budget

    budget = int(min_budget(long) * 1.02)
    captures.clear()
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=budget)
    cm = train_both(model, [short, long, short], cfg, steps=3, check_every_step=True, min_stages=0)
    assert len(captures) == 1          # one capture, planned twice
    first, second = cm._plans.plans()
    at_long = {**first.bindings, **{s: 48 for s, _, what in first.symbol_legend() if "dynamic size" in what}}
    assert max(job_memory_at(first, cfg, at_long)) > budget, "the test needs a plan that does not fit at 48"
    assert len(second.stages) > len(first.stages)
    assert max(second.stage_plan.job_memory) <= budget
    assert cm.plan is first            # back at 16, the first plan serves
    # the rewriting passes' texts: the re-plan's are the first plan's, rendered once per capture
    rewrites = [k for k, (name, _, _) in enumerate(first.passes) if name in ("capture", "causal_attention")]
    for k in rewrites:
        assert second.passes[k][2] is first.passes[k][2] and "def forward" in first.passes[k][2]


def test_a_later_plan_keeps_the_device_budget_the_first_plan_measured(monkeypatch):
    """Config.memory_budget=None: a device's budget is its free memory when the model's first plan
    is made (Note [device budget measured once]); a later plan at a length the first cannot serve
    keeps that figure, not the free memory left beside what the model holds by then (here a fiftieth
    of it, too little for any plan: a GPU's after its first steps)."""
    from rpcompile.passes import budgets as passes_budgets
    model = qwen3(layers=2)
    short, long = lm_batch(batch=4, seq=16), lm_batch(batch=4, seq=48, seed=2)
    probe = rpcompile.compile(copy.deepcopy(model), rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2,
                                                                     memory_budget=1))
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**long)
    budget = int(e.value.min_budget * 1.02)
    measured = []

    def free_memory(config):      # what a device has free: less once the model holds its part
        measured.append(budget if not measured else budget // 50)
        return measured[-1]
    monkeypatch.setattr(passes_budgets, "free_memory_budget", free_memory)
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2)
    cm = train_both(model, [short, long, short], cfg, steps=3, check_every_step=True, min_stages=0)
    first, second = cm._plans.plans()
    assert first.memory_budget == second.memory_budget == budget and first.device_budget == budget
    assert len(second.stages) > len(first.stages) and max(second.stage_plan.job_memory) <= budget


def test_compiled_pieces_compile_once_for_every_length(monkeypatch):
    """compile_stages with aot_eager standing in for Inductor: stage programs are made once, and
    dynamo compiles each piece once, symbolic in the length from the first call (Note
    [length-dynamic pieces] in runtime/programs.py), whatever the lengths. Every
    stage is cut (fwd, fused and bwd jobs, 2 microbatches): gradients chain through the pieces'
    AOTAutograd functions across stages, and loss, gradients (every step) and parameters equal
    eager at every length."""
    monkeypatch.setattr(regions, "MIN_REPEATS", 1)
    from torch._dynamo.backends.registry import lookup_backend
    aot_eager = lookup_backend("aot_eager")
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda gm, **kw: compile_(gm, **{**kw, "backend": kw.get("backend", counting)}))
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, compile_stages=True)
    lengths = [16, 24, 40, 24]
    counts, programs = [], []

    def step(cm, batch):
        loss = cm.train_step(**batch)
        counts.append(len(graphs))
        programs.append(len(cm.runner._programs))
        return loss

    # 1 layer: fwd, fused and bwd jobs, each a few pieces
    cm = train_both(qwen3(layers=1), _batches(lengths), cfg, call=step, steps=len(lengths), check_every_step=True)
    assert counts[0] == counts[1] == counts[2] == counts[3], f"dynamo compiles after the first length: {counts}"
    assert programs[0] == programs[-1]
    assert {st.kind for st in cm.plan.stages} == {"fwd", "fused", "bwd"}
    # a forward job's compute may be several parts (Note [forward parts] in passes/codegen.py)
    split = {prog for prog in cm.runner._programs.values()
             for name, g in prog.named_children() if name.startswith(("forward_", "backward_"))
             and "rp_regions" in getattr(getattr(g.inner, "compute", g.inner), "meta", {})}
    assert len(split) >= 3


def test_dynamo_backend_trains_at_several_lengths():
    """torch.compile(model, backend=rpcompile.backend(...)): dynamo's own dynamic shapes decide
    the graphs; at each length the loss and gradients equal eager."""
    torch._dynamo.reset()
    model = qwen3(layers=1)      # (1 layer: dynamo traces the model at each of its graphs' lengths)
    ref = copy.deepcopy(model)
    backend = rpcompile.backend(rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    compiled = torch.compile(model, backend=backend)
    try:
        for batch in _batches([16, 24, 40]):
            loss = compiled(**batch).loss
            loss.backward()
            expected = ref(**batch).loss
            expected.backward()
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()
    assert len(backend.plans) <= 2, "dynamo makes the length dynamic at the second one"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-4 * q.grad.abs().max().item())


def test_a_plan_at_a_new_length_splits_the_lm_head_as_a_capture_there_would(monkeypatch):
    """Note [shards by memory]: the LM head's shard count follows the length a plan is made at.
    Every new length re-planned (PlanCache._fits refusing other lengths' plans), a budget whose
    memory rule asks for more shards as the logits grow: the plan at 64 tokens has as many shards
    as a fresh capture at 64 chooses, more than the plan at 16 (the held capture's count before),
    and the loss, every gradient and the parameters equal eager at every step."""
    from rpcompile import plan_cache
    from rpcompile.passes import lm_head
    monkeypatch.setattr(lm_head, "SHARD_SHARE", 1024)
    monkeypatch.setattr(plan_cache.PlanCache, "_fits",
                        lambda self, plan, at: all(plan.bindings.get(s) == v for s, v in at.items()))
    V, lengths = 2048, [16, 64, 16]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="64MiB")
    batches = [lm_batch(batch=4, seq=L, vocab=V, seed=i) for i, L in enumerate(lengths)]
    cm = train_both(qwen3(vocab=V), batches, cfg, steps=len(lengths), check_every_step=True, min_stages=0)
    short, long = cm._plans.plans()
    fresh = rpcompile.compile(qwen3(vocab=V), cfg)
    fresh.train_step(**batches[1])
    assert long.lm_head["K"] == fresh.plan.lm_head["K"] > short.lm_head["K"] > 1, (
        short.lm_head["K"], long.lm_head["K"], fresh.plan.lm_head["K"])
    assert cm.plan is short            # back at 16, the first plan serves
