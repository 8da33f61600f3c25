"""A budget no plan meets at a call's length: PlanningError says the longest length that fits
(Note [longest length] in rpcompile/passes/longest.py), at planning time, before anything runs."""
import copy
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.passes import longest
from rpcompile.passes.longest import longest_fitting

from models import lm_batch, qwen3

ROWS, MICRO = 4, 2          # 2 rows per microbatch
SHORT, LONG = 16, 48


def _cfg(**kw):
    return rpcompile.Config(devices=["cpu"] * 2, num_microbatches=MICRO, **kw)


def _search_cases():
    yield "affine", lambda L: 1000 + 37 * L
    yield "quadratic", lambda L: 5000 + 3 * L + L * L // 7
    yield "steep", lambda L: 10 + L ** 3
    yield "concave", lambda L: int(4000 * math.sqrt(L))
    yield "steps", lambda L: 100 * (L // 64) + 50
    g = random.Random(0)
    inc = [g.randrange(0, 50) for _ in range(1 << 15)]
    prefix = [0]
    for x in inc:
        prefix.append(prefix[-1] + x)
    yield "random increasing", lambda L: prefix[L]


@pytest.mark.parametrize("name,need", list(_search_cases()), ids=[n for n, _ in _search_cases()])
def test_search_finds_the_edge_in_few_calls(name, need):
    """need(L) <= budget < need(L + 1), with at most 1 + 3 log2(length) calls; a few where need
    is affine or quadratic in L."""
    for length in (2, 3, 100, 1 << 15):
        for budget in {need(1) - 1, need(1), need(length // 2), need(length - 1), need(length) - 1}:
            if need(length) <= budget:
                continue
            got, calls = longest_fitting(need, budget, length, need(length))
            if need(1) > budget:
                assert got is None
                continue
            assert 1 <= got < length and need(got) <= budget, (length, budget, got)
            assert got + 1 == length or need(got + 1) > budget, (length, budget, got)
            assert calls <= 1 + 3 * math.ceil(math.log2(length)), (length, budget, calls)
            if name in ("affine", "quadratic"):   # what device memory is, per job
                assert calls <= {"affine": 3, "quadratic": 6}[name], (length, budget, calls)


def test_a_length_over_the_budget_says_the_longest_that_fits(monkeypatch):
    """qwen3, 2 devices, 2 rows per microbatch, a budget that fits at 16 tokens but not at 48:
    at 48 the PlanningError (before anything runs, parameters and .grad untouched) says
    max_length; a step at max_length trains with the same compiled model, max_length + 1 (the
    search's granularity: one token) fails again with the same answer."""
    model = qwen3()
    probe = rpcompile.compile(copy.deepcopy(model), _cfg(memory_budget=1))
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=ROWS, seq=LONG))
    assert e.value.max_length is None                  # not even 1 token fits 1 byte
    assert "No sequence length fits this budget at 2 rows per microbatch" in str(e.value)
    budget = int(e.value.min_budget * 0.7)

    cm = rpcompile.compile(model, _cfg(memory_budget=budget))
    cm.train_step(**lm_batch(batch=ROWS, seq=SHORT))
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    runs, searches = [], []
    real = cm.runner.train_step
    monkeypatch.setattr(cm.runner, "train_step", lambda *a, **k: runs.append(a) or real(*a, **k))
    search = longest.longest_fitting
    monkeypatch.setattr(longest, "longest_fitting", lambda *a: searches.append(search(*a)) or searches[-1])

    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch(batch=ROWS, seq=LONG))
    err = e.value
    assert runs == [], "planning fails before the step runs"
    for p, q, g in zip(model.parameters(), params, grads):
        assert p.grad is not None and not p.grad.requires_grad
        assert p.grad is not g and p.grad.data_ptr() != g.data_ptr()
        assert p.grad.equal(g) and p.detach().equal(q)
    max_len = err.max_length
    assert SHORT <= max_len < LONG
    assert searches == [(max_len, searches[0][1])] and searches[0][1] <= 5, searches   # solver calls
    msg = str(err)
    assert err.min_budget > budget and "Raise Config.memory_budget to at least" in msg     # kept
    assert (f"The longest sequence that fits this budget is {max_len:,} tokens (at 2 rows per microbatch; "
            f"this call's is {LONG})") in msg
    assert "shorten sequences to that" in msg and "use more microbatches" in msg

    cm.train_step(**lm_batch(batch=ROWS, seq=max_len, seed=3))
    assert runs and max(cm.plan.stage_plan.job_memory) <= budget
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch(batch=ROWS, seq=max_len + 1, seed=4))
    assert e.value.max_length == max_len


class _InBlocks(nn.Module):
    """Tokens mixed in blocks of 8 by a Python loop over the blocks, as MiniMax's lightning
    attention: the capture at 16 tokens unrolls two blocks, the second Min(16, L) - 8 long."""

    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(128, 16), nn.Linear(16, 16), nn.Linear(16, 128)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        L = h.shape[1]
        blocks = (L + 7) // 8       # (a count the capture guards: L stays a symbol, in 9..16)
        h = torch.cat([self.mix(h[:, 8 * i:min(8 * i + 8, L)].cumsum(1)) for i in range(blocks)], 1)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_graph_whose_sizes_go_negative_at_shorter_lengths_says_the_budget_alone():
    """Note [lengths a model cannot run at]: at a length shorter than its capture's guards allow,
    a size of such a graph comes out negative (Min(16, L) - 8 at 1 token), and the search for the
    longest length that fits raised the solver's ValueError ("segment 3: work_bytes must be >= 0",
    MiniMax) in place of the PlanningError; now the error says the budget alone."""
    ids = torch.randint(0, 128, (ROWS, 16))
    cm = rpcompile.compile(_InBlocks(), _cfg(memory_budget=1))
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(input_ids=ids, labels=ids)
    assert e.value.max_length is None and e.value.min_budget > 1
    assert "Raise Config.memory_budget to at least" in str(e.value)


def test_static_lengths_say_no_length():
    """Config(dynamic_lengths=False): the length is not a symbol, so max_length is None and the
    message is the budget's alone."""
    model = qwen3()
    probe = rpcompile.compile(copy.deepcopy(model), _cfg(memory_budget=1, dynamic_lengths=False))
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=ROWS, seq=LONG))
    err = e.value
    assert err.max_length is None and err.min_budget > 1
    msg = str(err)
    assert "Raise Config.memory_budget to at least" in msg
    assert "longest" not in msg and "sequence" not in msg and "tokens" not in msg


def test_a_first_call_over_the_budget_says_what_a_fresh_capture_fits():
    """The failed call is its capture's first, so the compiled model captures anew at the next
    length, and a capture chooses the LM head's shard count at its own sizes (vocab 2048: 7
    shards at 8 tokens, 5 at 48, fewer longer). max_length is what such a capture plans: the same compiled
    model (which kept no capture) fails at max_length + 1 with the same answer and trains at
    max_length; with the failed capture's shard count at every length it said 48 < 64."""
    V, FIT, LONG = 2048, 64, 128
    model = qwen3(vocab=V)
    probe = rpcompile.compile(copy.deepcopy(model), _cfg(memory_budget=1))
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=ROWS, seq=FIT, vocab=V))
    budget = e.value.min_budget                       # what a capture at FIT needs

    cm = rpcompile.compile(model, _cfg(memory_budget=budget))
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch(batch=ROWS, seq=LONG, vocab=V))
    max_len = e.value.max_length
    assert FIT <= max_len < LONG
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch(batch=ROWS, seq=max_len + 1, vocab=V, seed=4))
    assert e.value.max_length == max_len
    cm.train_step(**lm_batch(batch=ROWS, seq=max_len, vocab=V, seed=3))
    assert max(cm.plan.stage_plan.job_memory) <= budget and cm.plan.lm_head["K"] > 1
