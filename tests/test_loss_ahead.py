"""A differentiable call in training mode runs the loss's stage job forward and backward in its
forward run (Note [the loss's backward ahead] in rpcompile/runner.py): `loss.backward()` then
runs the other backward jobs only, and any other gradient makes that job run again."""
import pytest
import torch

import rpcompile
from models import lm_batch, qwen3
from parity import TIGHT, train_both


def _step(loss_of):
    """A train_both step, compiled or eager alike: the call differentiated through loss_of(out)."""
    def step(m, b):
        loss = loss_of(m(**b))
        loss.backward()
        return loss
    return step


LOSSES = {
    "loss": lambda out: out.loss,
    # gradient accumulation's division: the backward jobs' results times 0.25
    "quarter": lambda out: out.loss / 4,
    # a gradient for the logits too: the loss's job runs again as a backward job
    "with_logits": lambda out: out.loss + 0.5 * out.logits.float().pow(2).mean(),
    "logits_only": lambda out: out.logits.float().pow(2).mean(),
}


@pytest.mark.parametrize("workers", ["threads", "processes"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_call_trains_as_eager_whatever_it_differentiates(loss, workers):
    """Gradients and parameters after SGD steps equal eager's, with the embedding tied to the
    LM head (its gradient from both ends of the chain), whether the backward brings the loss's
    gradient alone (scaled or not) or others as well."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=TIGHT, workers=workers)
    cm = train_both(qwen3(tied=True), [lm_batch(seed=s) for s in range(2)], cfg, call=_step(LOSSES[loss]),
                    eager_step=_step(LOSSES[loss]), steps=2)
    backward = str(cm.last_schedule).split()
    fused = next(st.index for st in cm.plan.stages if st.kind == "fused")
    # the loss's job ran in the forward run; only another gradient runs it in the backward's
    assert any(a.startswith(f"{fused}B@") for a in backward) == (loss in ("with_logits", "logits_only"))


def test_the_forward_run_computes_the_loss_jobs_backward_only_in_training_mode():
    """The forward run's schedule: the loss's job fused (FB) in training mode, forward only (F)
    in eval mode, whose backward runs it again; gradients as eager's either way."""
    torch.manual_seed(0)
    model, ref = qwen3(tied=False), qwen3(tied=False)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    fused = None
    for training in (True, False):
        model.train(training), ref.train(training)
        b = lm_batch(seed=3)
        out = cm(**b)
        forward = str(cm.last_schedule).split()
        fused = next(st.index for st in cm.plan.stages if st.kind == "fused")
        assert any(a.startswith(f"{fused}{'FB' if training else 'F'}@") for a in forward), forward
        out.loss.backward()
        backward = str(cm.last_schedule).split()
        assert any(a.startswith(f"{fused}B@") for a in backward) != training
        ref(**b).loss.backward()
        largest = max(q.grad.abs().max() for q in ref.parameters())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad - q.grad).abs().max() <= 1e-4 * largest, name
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)


def test_a_hidden_state_differentiated_beside_the_loss():
    """A hidden state's gradient (an output of a job before the loss's) with the loss's: the
    gradients the loss's job left for the backward jobs are dropped and made again, not added
    to the new ones twice."""
    loss_of = lambda out: out.loss + 0.5 * sum(h.float().pow(2).mean() for h in out.hidden_states[1:])  # noqa: E731
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=TIGHT)

    def step(m, b):      # (compiled and eager alike)
        return _step(loss_of)(m, {**b, "output_hidden_states": True})
    train_both(qwen3(tied=False, layers=3), [lm_batch(seed=s) for s in range(2)], cfg, call=step,
               eager_step=step, steps=2)


def test_a_call_on_one_device_backward_runs_no_job():
    """A plan of one fused job: the call's forward run did all of its backward; loss.backward()
    runs no job and the gradients are eager's."""
    cm = train_both(qwen3(tied=False), [lm_batch(seed=s) for s in range(2)],
                    rpcompile.Config(devices=["cpu"], num_microbatches=2), call=_step(LOSSES["quarter"]),
                    eager_step=_step(LOSSES["quarter"]), steps=2, min_stages=0)
    assert [st.kind for st in cm.plan.stages] == ["fused"]
    assert str(cm.last_schedule) == "0FB@0"      # (the forward run's: no backward run since)


def test_float16_devices_run_the_loss_job_again():
    """Where the devices compute in float16 the seed must carry the loss's scale (GradScaler's),
    which the forward run does not know: no backward ahead there."""
    from rpcompile.runner import _loss_job
    cm = rpcompile.compile(qwen3(tied=False), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    cm(**lm_batch()).loss.backward()
    fused = next(k for k, st in enumerate(cm.plan.stages) if st.kind == "fused")
    assert _loss_job(cm.plan, torch.bfloat16) == fused and _loss_job(cm.plan, torch.float32) == fused
    assert _loss_job(cm.plan, torch.float16) is None
