"""Host gradient buffers (runtime/grads.py): each job's gradients come down in one copy into
a flat host buffer that is allocated once and reused, and a step never rewrites gradients the
optimizer still reads (Note [host gradient buffers])."""
import copy
import threading
import time

import pytest
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


def test_delayed_step_does_not_rewrite_gradients_the_optimizer_holds():
    """The optimizer is held on step 0's gradients while step 1 runs to the end: step 1
    writes the other set, so what the optimizer then reads is still step 0's."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "delayed")
    hold = threading.Event()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = RecordingSGD(model.parameters(), names, hold=hold)
    cm.attach_optimizer(opt)
    try:
        cm.train_step(**_batch(0))
        cm.train_step(**_batch(1))          # delayed: runs while optimizer step 0 is held
        assert cm.runner.overlapped._completed == 0
    finally:
        hold.set()
    cm.synchronize()
    seen = _steps_seen(opt, 2)
    for t in range(2):     # steps 0 and 1 both compute at the initial parameters
        want = _eager_grads(ref, _batch(t))
        for name, g in want.items():
            close(seen[t][name], g, 1e-4, 1e-6, f"step {t}: grad of {name}")


def test_overlapped_next_step_waits_before_writing_gradients():
    """The optimizer steps chunk by chunk, slowly; the next step writes the one set of host
    gradients only where the optimizer is done, so every chunk steps with its own step's."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, "overlapped")
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


@pytest.mark.parametrize("mode", ["exact", "overlapped", "delayed"])
def test_host_gradients_are_reused_across_steps(mode):
    """The host gradient buffers of a step are the same memory every step (two sets that
    alternate in delayed mode); exact mode's param.grad are copies, equal to eager's."""
    model = qwen3(tied=True, vocab=VOCAB)
    ref = copy.deepcopy(model)
    cm = _compile(model, mode)
    if mode != "exact":
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    flats = []
    real = cm.runner.new_step

    def new_step(*args, **kwargs):
        step = real(*args, **kwargs)
        flats.append(step.grads.flat().data_ptr())
        return step
    cm.runner.new_step = new_step
    for t in range(4):
        cm.train_step(**_batch(t))
        if mode == "exact":
            ref(**_batch(t)).loss.backward()
            check_grads(model, ref)
            assert all(p.grad.untyped_storage().data_ptr() not in flats for p in model.parameters())
            model.zero_grad(), ref.zero_grad()
    cm.synchronize()
    sets = 2 if mode == "delayed" else 1
    assert flats[sets:] == flats[:-sets] and len(set(flats)) == sets
    assert len(cm.runner.host_grads._sets) == 1
