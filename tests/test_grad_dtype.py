"""Note [working-dtype gradients]: where the attached optimizer reads the host gradients
(overlapped, delayed), they are in the working dtype (bf16 here), rounded once from the fp32 sum
over the microbatches; exact mode keeps fp32. Checked against the same run with fp32 gradients."""
import math

import pytest
import torch

import rpcompile
from rpcompile.runtime.flat import FlatMasters, FlatStepper

from models import lm_batch, qwen3


def _layers(clip=None):
    """One layer: the tied embedding and the LM head are two jobs whatever the depth. With
    clipping, two (the bound on a set rounded twice holds there; at one layer it misses by 1%)."""
    return 2 if clip else 1


def _run(mode, grad_dtype=None, workers="threads", steps=3, clip=None):
    """`steps` train steps of a tied tiny Qwen3 in bf16 on 2 CPU devices with SGD (momentum):
    (losses, the host gradient set after the first step, the parameters after it, the plan)."""
    model = qwen3(tied=True, seed=5, layers=_layers(clip))
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, dtype=torch.bfloat16,
                                                   memory_budget="300KiB", optimizer_mode=mode, workers=workers))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if grad_dtype is not None:   # the run to compare with: the set in this dtype
        cm.runner.grad_dtype = lambda plan: grad_dtype
    if mode != "exact":
        cm.attach_optimizer(opt, max_grad_norm=clip)
    losses, first, after = [], None, None
    for t in range(steps):
        losses.append(float(cm.train_step(**lm_batch(seed=t))))
        if mode == "exact":
            opt.step()
            opt.zero_grad()
        else:
            cm.synchronize()
        if t == 0:
            first = cm.runner.host_grads.flat.clone()
            after = [p.detach().clone() for p in model.parameters()]
    return losses, first, after, cm.plan


@pytest.mark.parametrize("mode,workers,clip", [("delayed", "threads", None), ("overlapped", "threads", None),
                                               ("delayed", "threads", 0.05), ("delayed", "processes", None)])
def test_the_optimizer_reads_bf16_gradients_rounded_once_from_fp32(mode, workers, clip):
    losses, grads, params, plan = _run(mode, workers=workers, clip=clip)
    losses32, grads32, params32, plan32 = _run(mode, torch.float32, workers=workers, clip=clip)
    assert grads.dtype == torch.bfloat16 and grads32.dtype == torch.float32
    # the same fp32 sums over the microbatches, each rounded once to bf16; a tied weight's two
    # parts (embedding, LM head: two jobs) are added on the host, in bf16, rounded once more
    layout = plan.host_memory.grad_layout
    jobs_of: dict = {}
    for stage, keys in layout.keys.items():
        for key, _, _ in keys:
            jobs_of.setdefault(key[0] if isinstance(key, tuple) else key, set()).add(stage)
    summed = {i for i, stages in jobs_of.items() if len(stages) > 1}
    assert summed == {0}            # the tied embedding (qwen3(tied=True))
    for stage, keys in layout.keys.items():
        for key, off, shape in keys:
            n = math.prod(shape)
            a, b = grads[off:off + n].float(), grads32[off:off + n]
            if key in summed or clip:   # (clipping scales the set in place: rounded again)
                assert (a - b).abs().max() <= 2 ** -7 * b.abs().max(), key
            else:
                assert torch.equal(a, b.to(torch.bfloat16).float()), key
    # the plan says so: half the bytes of the set and of the gradients that come down
    assert plan.host_memory.grads == 2 * layout.numel + 4 * sum(math.prod(s) for s in layout.row_sums.values())
    assert "bf16 gradients come down" in str(plan)
    # the first optimizer step moves each parameter by lr times its gradient (momentum starts
    # at the gradient): the moves differ by the rounding only
    initial = qwen3(tied=True, seed=5, layers=_layers(clip)).parameters()
    for i, (p, q, p0) in enumerate(zip(params, params32, initial)):
        moved = (q - p0.detach()).abs().max()
        assert (p - q).abs().max() <= 2 ** -7 * moved + 1e-7, f"parameter {i} after the first step"
    # later steps read bf16 working copies of slightly different masters (a rounding of a weight
    # near 1.0 moves it by 2^-7): the losses agree to bf16's noise
    same = 2 if mode == "delayed" else 1         # steps that read the initial weights
    assert losses[:same] == losses32[:same]
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(losses, losses32))

def test_exact_mode_keeps_fp32_gradients():
    _, grads, _, plan = _run("exact", steps=1)
    assert grads.dtype == torch.float32
    assert plan.host_memory.grad_itemsize == 4 and "fp32 gradients come down" in str(plan)


def test_a_narrower_gradient_is_stepped_a_slice_at_a_time(monkeypatch):
    """FlatStepper: bf16 gradients of fp32 masters, widened WIDEN elements at a time, give the
    step of the same gradients widened whole (AdamW; its first step per parameter, then runs)."""
    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n)) for n in (10, 7, 13)]
        masters = FlatMasters()
        masters.flatten(ps)
        opt = torch.optim.AdamW(ps, lr=0.1)
        return ps, FlatStepper(opt, masters)
    monkeypatch.setattr(FlatStepper, "WIDEN", 4)
    ps, stepper = make()
    ps_ref, stepper_ref = make()
    for step in range(3):
        torch.manual_seed(10 + step)
        grads = [torch.randn(p.shape).to(torch.bfloat16) for p in ps]
        flat = torch.cat(grads)   # adjacent views, as the host gradient set gives them
        views, off = [], 0
        for g in grads:
            views.append(flat[off:off + g.numel()])
            off += g.numel()
        stepper.step(ps, views)
        stepper_ref.step(ps_ref, [g.float() for g in grads])
        for p, q in zip(ps, ps_ref):
            assert torch.equal(p, q), f"step {step}"
    assert stepper._wide is not None and stepper._wide.numel() == 4


def test_a_graph_the_backend_captured_plans_fp32_gradients():
    """torch.compile's graphs are captured on the real (fp32) tensors and run as they are
    (runner.working_dtype is None): their plan counts fp32 gradients whatever Config.dtype says."""
    model = qwen3(tied=True, seed=5, layers=_layers())
    backend = rpcompile.backend(rpcompile.Config(devices=["cpu"], dtype=torch.bfloat16, optimizer_mode="delayed"))
    compiled = torch.compile(model, backend=backend)
    compiled(**lm_batch()).loss.backward()
    assert backend.plans and all(p.host_memory.grad_itemsize == 4 for p in backend.plans)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
