"""A plain PyTorch training loop around a compiled model, as eager runs it: optimizers that write
through `p.data`, param groups added mid-run, another optimizer attached mid-run, checkpoints
loaded mid-run or into a fresh model, an evaluation between train steps with dropout, a
submodule put in eval mode, a differentiable call and clipping beside train_step. Checked
against eager PyTorch (delayed mode: against its one-step-delay recurrence) with SGD with
momentum."""
import copy

import pytest
import torch

import rpcompile

from models import lm_batch, qwen3
from parity import check_grads, close


def _config(mode="exact", workers="threads", **kw):
    return rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="300KiB",
                            optimizer_mode=mode, workers=workers, **kw)


def _eager(model, batches, make_opt, changes=None, delayed=False):
    """Eager training of a copy of `model`: losses, the model, its optimizer. changes: {t:
    change(model, opt)} before step t (it may return an optimizer to attach). delayed: step t
    computes its gradients at the parameters after optimizer steps 0..t-2 (Note [delayed
    optimizer]), counted from the last attach."""
    live = copy.deepcopy(model)
    opt = make_opt(live)
    work = copy.deepcopy(model) if delayed else live
    snapshots = [copy.deepcopy(live.state_dict())] * 2
    losses = []
    for t, batch in enumerate(batches):
        if changes and t in changes:
            attached = changes[t](live, opt)
            if attached is not None:
                opt = attached
                snapshots[t:] = [copy.deepcopy(live.state_dict())] * 2
        if delayed:
            work.load_state_dict(snapshots[t])
        loss = work(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        if delayed:
            for p, q in zip(live.parameters(), work.parameters()):
                p.grad, q.grad = q.grad, None
        opt.step()
        live.zero_grad()
        snapshots.append(copy.deepcopy(live.state_dict()))
    return losses, live, opt


def _train(model, batches, mode, make_opt, changes=None, workers="threads"):
    """The same with rpcompile (changes made after cm.synchronize(), as a user makes them)."""
    cm = rpcompile.compile(model, _config(mode, workers))
    opt = make_opt(model)
    if mode != "exact":
        cm.attach_optimizer(opt)
    losses = []
    for t, batch in enumerate(batches):
        if changes and t in changes:
            cm.synchronize()
            attached = changes[t](model, opt)
            if attached is not None:
                opt = attached
                if mode != "exact":
                    cm.attach_optimizer(opt)
        losses.append(cm.train_step(**batch))
        if mode == "exact":
            opt.step()
            model.zero_grad()
    cm.synchronize()
    return losses, model, opt


def _same(losses, model, ref_losses, ref, what):
    for t, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        close(a, b, 1e-5, 1e-6, f"{what}: loss at step {t}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, f"{what}: {name}")


class DataSGD(torch.optim.Optimizer):
    """SGD with momentum written as old-style optimizers (and C++ CPU Adams) are: through `p.data`,
    which moves no `_version`."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum_buffer")
                buf = self.state[p]["momentum_buffer"] = p.grad.clone() if buf is None else \
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.data.add_(buf, alpha=-group["lr"])


@pytest.mark.parametrize("mode, workers", [("exact", "processes"), ("overlapped", "processes"),
                                           ("delayed", "threads")])
def test_an_optimizer_writing_through_data_is_seen_by_the_next_steps(mode, workers):
    """Note [steps through .data] (runtime/weights.py): the working copies (worker processes'
    shared ones; delayed mode's two; every mode's on GPUs) are refreshed where `_version` moved,
    which a write through `p.data` does not move: the jobs trained at the first weights for ever
    (the loss 0.0028 off eager's at step 1, the parameters 0.11 off after 4 steps)."""
    model = qwen3(layers=2)
    batches = [lm_batch(seed=t) for t in range(4)]
    ref_losses, ref, _ = _eager(model, batches, lambda m: DataSGD(m.parameters()), delayed=mode == "delayed")
    losses, model, _ = _train(model, batches, mode, lambda m: DataSGD(m.parameters()), workers=workers)
    _same(losses, model, ref_losses, ref, f"{mode}, {workers}")


def _two_groups(model):
    """SGD with momentum over every parameter but layer 1's: the MLPs with their own lr and weight decay."""
    named = [(n, p) for n, p in model.named_parameters() if "layers.1." not in n]
    return torch.optim.SGD([{"params": [p for n, p in named if "mlp" in n], "lr": 0.05, "weight_decay": 0.1},
                            {"params": [p for n, p in named if "mlp" not in n]}], lr=0.1, momentum=0.9)


def _add_layer_1(model, opt):
    opt.add_param_group({"params": list(model.model.layers[1].parameters()), "lr": 0.05, "momentum": 0.5})


@pytest.mark.parametrize("mode", ["overlapped", "delayed"])
def test_param_groups_and_add_param_group_mid_run(mode):
    """Groups of their own lr and weight decay, and a group added after two steps (layer 1, which
    trained with no optimizer until then): losses, parameters and every parameter's momentum in
    `opt.state` as eager's. The added parameters were taken as stepped before they were added,
    and then stepped flat with their momentum in the optimizer's twin only: `opt.state` (and so
    a checkpoint's state_dict) had none for them."""
    model = qwen3(layers=2)
    batches = [lm_batch(seed=t) for t in range(5)]
    ref_losses, ref, ref_opt = _eager(model, batches, _two_groups, {2: _add_layer_1}, delayed=mode == "delayed")
    losses, model, opt = _train(model, batches, mode, _two_groups, {2: _add_layer_1})
    _same(losses, model, ref_losses, ref, mode)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert "momentum_buffer" in opt.state[p], f"{name}: no momentum in optimizer.state"
        close(opt.state[p]["momentum_buffer"].cpu(), ref_opt.state[q]["momentum_buffer"], 1e-4, 1e-6, f"momentum of {name}")


@pytest.mark.parametrize("mode", ["overlapped", "delayed"])
def test_another_optimizer_attached_mid_run(mode):
    """A new optimizer (its own lr and momentum) attached after two steps steps the rest, as eager's
    would; in delayed mode the one step of delay starts again there (compiled.attach_optimizer)."""
    model = qwen3(layers=2)
    batches = [lm_batch(seed=t) for t in range(5)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)      # noqa: E731
    change = {2: lambda m, opt: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)}
    ref_losses, ref, _ = _eager(model, batches, sgd, change, delayed=mode == "delayed")
    losses, model, _ = _train(model, batches, mode, sgd, change)
    _same(losses, model, ref_losses, ref, mode)


def test_checkpoints_loaded_mid_run_and_into_a_fresh_model_train_on_as_straight_through():
    """Overlapped mode: the model's and optimizer's state_dicts saved after step 1; two more steps,
    then both loaded back into the running model (a rollback), and into a fresh model with a new
    optimizer and compiled model (a resume): steps 2-4 as a straight run's (eager's)."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)     # noqa: E731
    model = qwen3(layers=2)
    fresh = qwen3(layers=2, seed=7)
    batches = [lm_batch(seed=t) for t in range(5)]
    ref_losses, ref, _ = _eager(model, batches, sgd)
    cm = rpcompile.compile(model, _config("overlapped"))
    opt = sgd(model)
    cm.attach_optimizer(opt)
    for t in range(2):
        cm.train_step(**batches[t])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))     # (state_dict synchronizes itself)
    for t in range(2, 4):
        cm.train_step(**batches[t])
    model.load_state_dict(saved[0])
    opt.load_state_dict(copy.deepcopy(saved[1]))      # (load_state_dict keeps the tensors it is given)
    losses = [cm.train_step(**batches[t]) for t in range(2, 5)]
    cm.synchronize()
    _same(losses, model, ref_losses[2:], ref, "rolled back")
    fresh.load_state_dict(saved[0])
    cm = rpcompile.compile(fresh, _config("overlapped"))
    opt = sgd(fresh)
    opt.load_state_dict(saved[1])
    cm.attach_optimizer(opt)
    losses = [cm.train_step(**batches[t]) for t in range(2, 5)]
    cm.synchronize()
    _same(losses, fresh, ref_losses[2:], ref, "resumed")


def test_an_evaluation_between_train_steps_leaves_dropout_as_without_it():
    """Dropout (attention dropout 0.2): an evaluation call in eval mode between train steps draws
    nothing from torch's generator, as eager's draws nothing: the run goes on exactly as the same
    run without it, and two runs from the same seed are equal. (The masks are rpcompile's own
    streams, not eager's: README, dropout.)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def run(evaluate):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             max_position_embeddings=64, attention_dropout=0.2))
        cm = rpcompile.compile(model, _config())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(123)
        losses = []
        for t in range(4):
            if t == 2 and evaluate:
                model.eval()
                with torch.no_grad():
                    close(cm(**lm_batch(seed=9)).loss, model(**lm_batch(seed=9)).loss, 1e-5, 1e-6, "eval loss")
                model.train()
            losses.append(cm.train_step(**lm_batch(seed=t)))
            opt.step()
            opt.zero_grad()
        assert any(st.random for st in cm.plan.stages)
        return losses, model

    plain, plain_model = run(False)
    again, _ = run(False)
    evaluated, model = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, again)), "two runs from one seed differ"
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated)), "an evaluation changed the training"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))


def test_a_call_and_clipping_beside_train_step_in_worker_processes():
    """Exact mode, worker processes: train_step and a differentiable call's backward add into one
    step's `.grad`, clipped by norm or by value, at a batch size that changes every step; losses,
    gradients and parameters as eager's."""
    model = qwen3(layers=2)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, _config(workers="processes"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for t in range(4):
        train, call = lm_batch(seed=t, batch=5 + t), lm_batch(seed=10 + t, batch=3)
        ref_loss = ref(**train).loss
        ref_loss.backward()
        close(cm.train_step(**train), ref_loss.detach(), 1e-5, 1e-6, f"train_step's loss at step {t}")
        loss, ref_loss = cm(**call).loss, ref(**call).loss
        loss.backward(), ref_loss.backward()
        close(loss.detach(), ref_loss.detach(), 1e-5, 1e-6, f"the call's loss at step {t}")
        if t == 0:
            check_grads(model, ref)
        for m in (model, ref):
            if t % 2:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            else:
                torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, name)


def test_a_submodule_put_in_eval_mode_gets_a_plan_of_its_own():
    """A frozen BatchNorm (`model.bn1.eval()` while the rest trains): eager normalizes with its
    running statistics and leaves them; the plan key held the model's own train/eval mode only, so
    the train-mode plan ran on, with batch statistics and their updates (also dropout left on in
    layers put in eval mode: gradients 0.65 of the largest off eager's), silently."""
    import torch.nn.functional as F

    from models import WithBatchNorm
    model = WithBatchNorm()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, loss_fn=F.mse_loss,
                                                   memory_budget=6000))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    g = torch.Generator().manual_seed(3)
    for t in range(4):
        if t == 2:
            model.bn1.eval(), ref.bn1.eval()
        x, y = torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g)
        loss = cm.train_step(x, target=y)
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):     # microbatches one at a time: the statistics' updates
            part = F.mse_loss(ref(xs), ys) / 2
            part.backward()
            ref_loss += part.detach()
        close(loss, ref_loss, 1e-5, 1e-6, f"loss at step {t}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len(cm.plan.stages) >= 2, cm.plan
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-6, name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        close(b.float(), c.float(), 1e-4, 1e-6, f"buffer {name}")


def _slow_steps(monkeypatch):
    """The optimizer thread's steps take 30 ms each (a busy host): a user's change right after
    train_step lands while that step's update is still being stepped."""
    import time

    from rpcompile.runtime.flat import FlatStepper
    step = FlatStepper.step

    def slow(self, *args, **kw):
        time.sleep(0.03)
        return step(self, *args, **kw)
    monkeypatch.setattr(FlatStepper, "step", slow)


@pytest.mark.parametrize("mode, workers, kind", [("overlapped", "threads", torch.optim.SGD),
                                                 ("overlapped", "processes", torch.optim.SGD),
                                                 ("delayed", "threads", torch.optim.SGD),
                                                 ("overlapped", "threads", DataSGD)])
def test_learning_rates_set_right_after_train_step_reach_the_next_update(monkeypatch, mode, workers, kind):
    """Note [hyperparameters per submission] (runtime/optimizer.py): the loop eager runs, `loss =
    train_step(); for g in opt.param_groups: g["lr"] = ...` with no synchronize between, beside an
    attached scheduler. The optimizer thread read param_groups as it stepped each chunk, so a rate
    set while a step's update still ran reached that update's later chunks (parameters 0.25 off
    eager's after 4 steps, silently); and the attached scheduler stepped in that thread, so
    `get_last_lr()` read right after train_step could be the step before's. DataSGD is stepped
    per parameter by the user's optimizer (not flat), by a twin with the submission's groups."""
    _slow_steps(monkeypatch)
    model = qwen3(layers=2)
    batches = [lm_batch(seed=t) for t in range(4)]
    rates = [0.2, 0.02, 0.3, 0.05]

    def sgd(m):
        opt = kind([{"params": [p for n, p in m.named_parameters() if "mlp" in n]},
                    {"params": [p for n, p in m.named_parameters() if "mlp" not in n], "lr": 0.05}],
                   lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    # eager: step t computes at the parameters after updates 0..t-1 (delayed: 0..t-2)
    live = copy.deepcopy(model)
    ref_opt, ref_sched = sgd(live)
    work = copy.deepcopy(model) if mode == "delayed" else live
    snapshots = [copy.deepcopy(live.state_dict())] * 2
    ref_losses, ref_rates = [], []
    for t, batch in enumerate(batches):
        if mode == "delayed":
            work.load_state_dict(snapshots[t])
        loss = work(**batch).loss
        loss.backward()
        ref_losses.append(loss.detach())
        if mode == "delayed":
            for p, q in zip(live.parameters(), work.parameters()):
                p.grad, q.grad = q.grad, None
        ref_opt.step()
        ref_sched.step()
        live.zero_grad()
        ref_rates.append(ref_sched.get_last_lr())
        ref_opt.param_groups[0]["lr"] = rates[t]
        snapshots.append(copy.deepcopy(live.state_dict()))

    cm = rpcompile.compile(model, _config(mode, workers))
    opt, sched = sgd(model)
    cm.attach_optimizer(opt, lr_scheduler=sched, chunks=4)
    losses, got_rates = [], []
    for t, batch in enumerate(batches):
        losses.append(cm.train_step(**batch))
        got_rates.append(sched.get_last_lr())
        opt.param_groups[0]["lr"] = rates[t]
    cm.synchronize()
    assert got_rates == ref_rates
    _same(losses, model, ref_losses, live, f"{mode}, {workers}")


def _momentum_on(model, opt):
    for g in opt.param_groups:
        g["momentum"] = 0.9


@pytest.mark.parametrize("mode", ["overlapped", "delayed"])
def test_momentum_turned_on_mid_run_is_in_the_optimizer_state(mode):
    """SGD without momentum (no state) for two steps, then with: the momentum buffers are made as
    eager's are and live in `opt.state` (a checkpoint's state_dict holds them). The parameters
    stepped flat made them in the optimizer's twins only, so `opt.state` had none."""
    model = qwen3(layers=2)
    batches = [lm_batch(seed=t) for t in range(5)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)      # noqa: E731
    ref_losses, ref, ref_opt = _eager(model, batches, sgd, {2: _momentum_on}, delayed=mode == "delayed")
    losses, model, opt = _train(model, batches, mode, sgd, {2: _momentum_on})
    _same(losses, model, ref_losses, ref, mode)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(opt.state[p].get("momentum_buffer"), torch.Tensor), f"{name}: no momentum in optimizer.state"
        close(opt.state[p]["momentum_buffer"].cpu(), ref_opt.state[q]["momentum_buffer"], 1e-4, 1e-6, f"momentum of {name}")
