"""Host gradient buffers (runtime/grads.py): each job's gradients come down in one copy into
a flat host buffer that is allocated once and reused, and a step never rewrites gradients the
optimizer still reads (Note [host gradient buffers])."""
import copy
import threading
import time

import torch

import rpcompile

from models import lm_batch, qwen3
from parity import check_grads, close

VOCAB = 127


def _compile(model, mode):
    # a tied embedding and a head split over the vocabulary: whole and row gradients of one parameter
    return rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                     memory_budget="300KiB", lm_head_shards=3,
                                                     optimizer_mode=mode))


def _batch(seed):
    return lm_batch(vocab=VOCAB, seed=seed)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it steps with, after an optional hold."""

    def __init__(self, params, names, hold=None, sleep=0.0):
        super().__init__(params, lr=0.1)
        self.names, self.hold, self.sleep, self.seen = names, hold, sleep, []

    def step(self, closure=None):
        if self.hold is not None:
            self.hold.wait(60)
        time.sleep(self.sleep)       # the next step's jobs get time to run ahead, if they may
        self.seen.append({self.names[id(p)]: p.grad.clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None})
        return super().step(closure)


def _eager_grads(model, batch):
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _steps_seen(opt, count):
    """The gradients the optimizer stepped with, per submission (chunks merged in order)."""
    merged, it = [], iter(opt.seen)
    for _ in range(count):
        got = {}
        while len(got) < len(opt.names):
            got.update(next(it))
        merged.append(got)
    return merged


def _record_grad_buffers(cm):
    """The address of each step's flat host gradient buffer, in order (appended as steps start)."""
    flats = []
    real = cm.runner.new_step

    def new_step(*args, **kwargs):
        step = real(*args, **kwargs)
        flats.append(step.grads.flat().data_ptr())
        return step
    cm.runner.new_step = new_step
    return flats


def _assert_one_gradient_set(cm, flats, steps):
    """Every step wrote the same host gradient memory (Note [one gradient set])."""
    assert len(flats) == steps and len(set(flats)) == 1
    assert len(cm.runner.host_grads._sets) == 1


def test_delayed_step_does_not_rewrite_gradients_the_optimizer_holds():
    """The optimizer is held on step 0's gradients while step 1 runs: step 1's backward jobs
    wait before writing the pieces it still reads (Note [one gradient set]), so what the
    optimizer then reads is step 0's, and step 1's are step 1's. Every step, held or not,
    writes the same host gradient buffer (test_host_gradients_are_reused_across_steps for
    delayed mode)."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "delayed")
    flats = _record_grad_buffers(cm)
    hold = threading.Event()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = RecordingSGD(model.parameters(), names, hold=hold)
    cm.attach_optimizer(opt)
    second = threading.Thread(target=cm.train_step, kwargs=_batch(1))
    try:
        cm.train_step(**_batch(0))
        second.start()                      # delayed: starts while optimizer step 0 is held
        second.join(1.0)
        assert second.is_alive() and cm.runner.overlapped._completed == 0
    finally:
        hold.set()
    second.join(60)
    assert not second.is_alive()
    cm.synchronize()
    seen = _steps_seen(opt, 2)
    for t in range(2):     # steps 0 and 1 both compute at the initial parameters
        want = _eager_grads(ref, _batch(t))
        for name, g in want.items():
            close(seen[t][name], g, 1e-4, 1e-6, f"step {t}: grad of {name}")
    for t in (2, 3):       # two more steps, the optimizer no longer held
        cm.train_step(**_batch(t))
    cm.synchronize()
    _assert_one_gradient_set(cm, flats, 4)


def test_overlapped_next_step_waits_before_writing_gradients():
    """The optimizer steps chunk by chunk, slowly; the next step writes the one set of host
    gradients only where the optimizer is done, so every chunk steps with its own step's; every
    step writes the same host gradient buffer (test_host_gradients_are_reused_across_steps for
    overlapped mode)."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "overlapped")
    flats = _record_grad_buffers(cm)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = RecordingSGD(model.parameters(), names, sleep=0.02)
    cm.attach_optimizer(opt, chunks=4)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for t in range(3):
        cm.train_step(**_batch(t))
        want.append(_eager_grads(ref, _batch(t)))
        opt_ref.step()
    cm.synchronize()
    for t, seen in enumerate(_steps_seen(opt, 3)):
        for name, g in want[t].items():
            close(seen[name], g, 1e-4, 1e-6, f"step {t}: grad of {name}")
    _assert_one_gradient_set(cm, flats, 3)


def test_host_gradients_are_reused_across_steps():
    """The host gradient buffers of a step are the same memory every step (Note [one gradient
    set]); exact mode lends their views as param.grad (Note [lent gradients]), equal to eager's.
    (Overlapped and delayed mode: test_overlapped_next_step_waits_before_writing_gradients and
    test_delayed_step_does_not_rewrite_gradients_the_optimizer_holds check the same.)"""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "exact")
    flats = _record_grad_buffers(cm)
    for t in range(4):
        cm.train_step(**_batch(t))
        ref(**_batch(t)).loss.backward()
        check_grads(model, ref)
        lent = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert lent <= set(flats) | _row_sum_storages(cm), "a gradient was copied out of the host set"
        model.zero_grad(), ref.zero_grad()
    cm.synchronize()
    _assert_one_gradient_set(cm, flats, 4)


def _row_sum_storages(cm):
    return {t.untyped_storage().data_ptr() for t in cm.runner.host_grads._sums.values()}


def test_gradients_the_user_holds_survive_the_next_step():
    """Exact mode: gradients kept in param.grad over train_steps (no zero_grad: accumulation, or
    zero_grad(set_to_none=False)) are copied out of the host set before the next step writes
    it (Note [lent gradients]), so they add up as eager's do."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "exact")
    for t in range(2):                       # lent views, then held across a step
        cm.train_step(**_batch(t))
        ref(**_batch(t)).loss.backward()
    check_grads(model, ref)
    model.zero_grad(set_to_none=False), ref.zero_grad(set_to_none=False)
    cm.train_step(**_batch(2))               # param.grad held (zeros): added into
    ref(**_batch(2)).loss.backward()
    held = {n: p.grad for n, p in model.named_parameters()}
    cm.train_step(**_batch(3))
    ref(**_batch(3)).loss.backward()
    check_grads(model, ref)
    assert all(p.grad is held[n] for n, p in model.named_parameters())
    lent = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert not lent & ({cm.runner.host_grads.flat.untyped_storage().data_ptr()} | _row_sum_storages(cm))
    model.zero_grad(), ref.zero_grad()
    cm.train_step(**_batch(4))               # lent views, one kept by the user past zero_grad()
    ref(**_batch(4)).loss.backward()
    kept = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model.zero_grad(), ref.zero_grad()
    cm.train_step(**_batch(5))
    ref(**_batch(5)).loss.backward()
    scale = max(w.abs().max().item() for w in want.values())
    for n, g in kept.items():
        close(g, want[n], 0.0, 1e-4 * scale, f"kept gradient of {n} after the next step")
    check_grads(model, ref)


def test_a_calls_gradient_set_is_lent_again_once_let_go():
    """Note [call gradient sets]: `loss = cm(...).loss; loss.backward(); opt.step();
    opt.zero_grad()` with worker threads: once a call's gradients are let go, the next call's set
    is the same memory (an untied head split over the vocabulary: row sums too); a gradient the
    user keeps past zero_grad keeps its buffer, unchanged by the calls after; a train step lets
    the spare sets go. The logits (lent memory too) may be written in place. Parameters after
    SGD with momentum as eager's."""
    from rpcompile.runtime import host_buffers
    model = qwen3(tied=False, vocab=VOCAB, seed=4)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="300KiB",
                                                   lm_head_shards=3, workers="threads"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    made = []                           # call gradient buffers allocated by each step
    for s in range(4):
        before = host_buffers.snapshot()[1]["call gradients"]
        batch = _batch(s)
        for m, opt in ((cm, opts[0]), (ref, opts[1])):
            out = m(**batch)
            out.logits.mul_(1.0)            # an output written in place, as eager's may be
            loss = out.loss
            del out
            loss.backward()
            if s == 1 and m is cm:          # a gradient kept past zero_grad(): its set stays the user's
                kept = model.model.layers[0].mlp.down_proj.weight.grad
                kept_value = kept.clone()
            opt.step()
            opt.zero_grad()
        made.append(host_buffers.snapshot()[1]["call gradients"] - before)
    assert made[0] > 0 and made[1] == 0, f"the second call made a gradient set of its own: {made}"
    # (the kept gradient's flat buffer is made anew; the set's other buffers were let go and lent again)
    assert made[2] == 1 and made[3] == 0, f"a kept gradient's set was lent again, or none was: {made}"
    close(kept, kept_value, 0.0, 0.0, "a kept gradient after two more calls")
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-5, "parameters after 4 steps")
    assert cm.runner.host_grads.calls.free
    cm.train_step(**_batch(5))
    assert cm.runner.host_grads.calls.free == []


def _layout(stage_keys, shapes):
    """The GradLayout of stages with the given gradient keys, over parameters of `shapes`."""
    from types import SimpleNamespace

    from rpcompile.passes.host_memory import grad_layout
    params = [torch.empty(s) for s in shapes]
    stages = [SimpleNamespace(index=s, grad_params=keys) for s, keys in enumerate(stage_keys)]
    return grad_layout(SimpleNamespace(captured=SimpleNamespace(params=params), stages=stages))


def test_row_gradients_of_one_stage_are_the_whole_gradient_in_place():
    """An untied head's vocabulary shards in one stage lie one after the other in row order:
    they are its whole gradient, with no buffer to sum them into; shards in two stages are summed
    into a buffer of their own; a tied weight's rows are added into its whole gradient."""
    from rpcompile.runtime.grads import GradSet
    from rpcompile.runtime.modes import sum_param_grads
    # param 0: head (6, 2) in one stage, its shards listed out of order; 1: another (4, 2) in two
    # stages; 2: tied (4, 2), whole in stage 0 and rows in stage 1
    layout = _layout([[2, (1, 0, 2)], [(0, 3, 6), 3, (0, 0, 3), (1, 2, 4), (2, 0, 4)]],
                     [(6, 2), (4, 2), (4, 2), (5,)])
    assert layout.whole_rows == {0: (12, (6, 2))} and layout.row_sums == {1: (4, 2)}
    offsets = {k: off for keys in layout.keys.values() for k, off, _ in keys}
    assert offsets[(0, 0, 3)] == 12 and offsets[(0, 3, 6)] == 18
    assert layout.numel == 8 + 4 + 12 + 5 + 4 + 8
    assert layout.nbytes(2) == 4 * (2 * layout.numel + 8)

    gs = GradSet(layout, False, {1: torch.empty(4, 2)}, "gradients")
    jobs = {}
    for s in (0, 1):
        views = gs.host_views(s)
        for key, v in views.items():
            v.copy_(torch.randn(v.shape))
        jobs[s] = dict(views)
    want_head = torch.cat([jobs[1][(0, 0, 3)], jobs[1][(0, 3, 6)]])
    want_other = torch.cat([jobs[0][(1, 0, 2)], jobs[1][(1, 2, 4)]])
    want_tied = jobs[0][2] + jobs[1][(2, 0, 4)]
    totals = sum_param_grads(jobs, gs.row_sums)
    assert totals[0].data_ptr() == jobs[1][(0, 0, 3)].data_ptr() and torch.equal(totals[0], want_head)
    assert totals[1] is gs.row_sums[1] and torch.equal(totals[1], want_other)
    assert torch.equal(totals[2], want_tied) and torch.equal(totals[3], jobs[1][3])


def test_plans_share_the_gradient_buffers():
    """Two layouts (two plans of one model) view one buffer, as large as the larger; a larger
    layout's set replaces the buffer, and the smaller layout's set is made anew on it; a switch
    of layout is said, so the runner can wait for the optimizer first. The replaced buffer and
    the counters of the sets on it are let go (worker processes forget their files), once."""
    from rpcompile.runtime import host_buffers
    from rpcompile.runtime.grads import HostGrads
    small, large = _layout([[0], [1]], [(3, 2), (4,)]), _layout([[0, 1]], [(3, 2), (8,)])
    dropped = []
    hg = HostGrads(pin=False, drop=dropped.extend)
    before = host_buffers.snapshot()[0]
    a0 = hg.set_for(small)
    a0.flat()
    assert not hg.switches(small) and hg.switches(large)
    b0 = hg.set_for(large)
    assert not dropped
    assert b0.flat().numel() == large.numel and b0.flat().data_ptr() != a0.flat().data_ptr()
    assert [t.data_ptr() for t in dropped] == [a0.flat().data_ptr(), a0.consumed.data_ptr()]
    c0 = hg.set_for(small)            # the small layout's set, anew on the larger buffer
    assert c0 is not a0 and c0.flat().data_ptr() == b0.flat().data_ptr()
    assert hg.set_for(small) is c0
    grown = host_buffers.snapshot()[0] - before
    assert grown["gradients"] == 4 * (small.numel + large.numel)
    hg.set_for(large).flat()          # a smaller layout never allocates again, nor does the larger
    assert host_buffers.snapshot()[0] - before == grown
    assert len(dropped) == 2
    # a set in another dtype replaces the layout's set: its counters go, then the buffer
    d0 = hg.set_for(small, torch.bfloat16)
    assert [id(t) for t in dropped[2:]] == [id(c0.consumed)]
    d0.flat()
    assert d0.flat().dtype == torch.bfloat16
    assert [t.data_ptr() for t in dropped[3:]] == [b0.flat().data_ptr(), b0.consumed.data_ptr()]
