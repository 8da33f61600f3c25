"""Flat host optimizer (Note [flat host optimizer], runtime/flat.py): runs of parameters stepped
as one tensor give the user's optimizer's own results, state and state_dict."""
import copy

import pytest
import torch

from rpcompile.runtime.flat import FlatMasters, FlatStepper, merge_adjacent


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _grads(params, step):
    """Gradients as views of one flat buffer, in the parameters' order (as GradLayout lays them)."""
    g = torch.Generator().manual_seed(step)
    flat = torch.randn(sum(p.numel() for p in params), generator=g)
    out, off = [], 0
    for p in params:
        out.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    return out


def _step_both(stepper, params, ref_opt, ref_params, steps, dtype=None):
    """Step the flat stepper and the reference optimizer with the same gradients (the stepper's
    in `dtype` if given); parameters equal after each step."""
    for step in steps:
        grads = [g.to(dtype or g.dtype) for g in _grads(params, step)]
        stepper.step(params, grads)
        for p, g in zip(ref_params, grads):
            p.grad = g.to(p.dtype, copy=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def _step_skipping(stepper, params, ref_opt, ref_params, step, skip=()):
    """One step of both with the parameters in `skip` left without a gradient; parameters equal after it."""
    grads = _grads(params, step)
    keep = [i for i in range(len(params)) if i not in skip]
    stepper.step([params[i] for i in keep], [grads[i] for i in keep])
    for i in keep:
        ref_params[i].grad = grads[i].clone()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, dampening=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_runs_step_as_the_users_optimizer(name):
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = OPTIMIZERS[name](params), OPTIMIZERS[name](ref_params)
    masters = FlatMasters()
    masters.flatten(params)
    assert len(masters.buffers) == 1 and params[1].data_ptr() == params[0].data_ptr() + 4 * params[0].numel()
    stepper = FlatStepper(opt, masters)
    stepper.PIECE = 100          # a first step in slices, each slice's state moved before the next
    _step_both(stepper, params, ref_opt, ref_params, range(4))
    # the first step went per parameter; the next ones as one run
    assert len(stepper._twins) == 1
    # the user's state and state_dict are the optimizer's own
    got, want = opt.state_dict(), ref_opt.state_dict()
    for i in want["state"]:
        assert got["state"][i].keys() == want["state"][i].keys()
        for key, v in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][key], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw-fused", "sgd-nesterov"])
def test_a_parameter_larger_than_a_piece_never_has_its_whole_first_state_made_at_once(name):
    """Its first step goes by twins a PIECE at a time: the user's optimizer never steps it
    whole (which makes its whole state, and a widened gradient, on the host at once)."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = OPTIMIZERS[name](params), OPTIMIZERS[name](ref_params)
    masters = FlatMasters()
    masters.flatten(params)
    stepper = FlatStepper(opt, masters)
    stepper.PIECE = 100
    stepped_whole = []
    opt.register_step_pre_hook(lambda o, args, kwargs: stepped_whole.extend(
        p.numel() for g in o.param_groups for p in g["params"] if p.grad is not None))
    _step_both(stepper, params, ref_opt, ref_params, range(2))
    assert stepped_whole and max(stepped_whole) <= 100 and params[0].numel() > 100
    assert opt.state[params[0]]["momentum_buffer" if name.startswith("sgd") else "exp_avg"].data_ptr() == \
        stepper._state_bufs[(0, "momentum_buffer" if name.startswith("sgd") else "exp_avg", None)].data_ptr()


def test_load_state_dict_and_a_missing_gradient():
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    masters = FlatMasters()
    masters.flatten(params)
    stepper = FlatStepper(opt, masters)

    def both(step, skip=()):
        _step_skipping(stepper, params, ref_opt, ref_params, step, skip)

    both(0)
    both(1)
    both(2, skip={1})         # parameter 1 has no gradient: its step count falls behind
    both(3)                   # so its run is split (or stepped per parameter), not stepped as one
    assert opt.state[params[1]]["step"] != opt.state[params[0]]["step"]
    # load_state_dict replaces the state tensors: they are moved into the flat buffers again
    saved = copy.deepcopy(ref_opt.state_dict())
    opt.load_state_dict(saved)
    both(4)
    both(5)
    exp_avg = opt.state[params[2]]["exp_avg"]
    buf = stepper._state_bufs[(0, "exp_avg", None)]
    assert exp_avg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_other_optimizers_step_per_parameter():
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = torch.optim.Adagrad(params, lr=1e-2), torch.optim.Adagrad(ref_params, lr=1e-2)
    masters = FlatMasters()
    masters.flatten(params)
    stepper = FlatStepper(opt, masters)
    _step_both(stepper, params, ref_opt, ref_params, range(2))
    assert not stepper._twins


def test_flatten_keeps_values_and_bumps_versions_when_stepped():
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    masters = FlatMasters()
    masters.flatten(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    stepper = FlatStepper(torch.optim.SGD(params, lr=0.1), masters)
    stepper.step(params, _grads(params, 0))          # per parameter (first step)
    versions = [p._version for p in params]
    stepper.step(params, _grads(params, 1))          # one run
    assert len(stepper._twins) == 1
    assert all(p._version > v for p, v in zip(params, versions))


def test_merge_adjacent_copies_runs_once():
    a, b = torch.zeros(10), torch.arange(10.0)
    dsts = [a[0:3], a[3:7], a[8:10]]
    srcs = [b[0:3], b[3:7], b[8:10]]
    d, s = merge_adjacent(dsts, srcs)
    assert [t.numel() for t in d] == [7, 2] and [t.numel() for t in s] == [7, 2]
    torch._foreach_copy_(d, s)
    assert a.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 8, 9]
    # sources not adjacent: no merge
    d, s = merge_adjacent([a[0:2], a[2:4]], [b[4:6], b[0:2]])
    assert len(d) == 2


def test_delayed_mode_steps_the_model_in_a_few_runs():
    import rpcompile
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from models import lm_batch
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   optimizer_mode="delayed"))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    for t in range(3):
        cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=t))
    cm.synchronize()
    opt = cm.runner.overlapped
    buf = opt.masters.buffers[0]
    assert len(opt.masters.buffers) == 1
    assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in model.parameters())
    # a run per piece of the gradient buffer (Note [one gradient set]), not one per tensor
    pieces = len(cm.plan.host_memory.grad_layout.stages)
    assert 1 <= len(opt.stepper._twins) <= pieces + 1 < len(list(model.parameters())), len(opt.stepper._twins)
