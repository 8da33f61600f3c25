"""Note [finer microbatches] (passes/__init__.py): the model's first train plan may split each
microbatch further where its jobs recompute; the plans after it split as it does."""
import pytest
import torch

import rpcompile
from rpcompile import passes
from rpcompile.capture import capture_call
from rpcompile.runtime.schedule import microbatch_shares

from models import llama, lm_batch
from parity import train_both

# a tiny Llama whose copies at M=2 under this budget recompute, and whose plan at M=4 is
# estimated clearly shorter (CPU cost model; sequences long enough that the compute a finer split
# saves outweighs the gradients each microbatch adds: Note [gradients added per microbatch])
BUDGET, SEQ = "900KiB", 24


def _config(**kw):
    kw = {"devices": ["cpu", "cpu"], "num_microbatches": 2, "memory_budget": BUDGET, "data_parallel": True,
          "split_microbatches": True, **kw}
    return rpcompile.Config(**kw)


def _capture():
    return capture_call(llama(layers=4), (), {**lm_batch(batch=8, seq=SEQ), "use_cache": False}, dtype=None,
                        device=torch.device("cpu"), dynamic_lengths=True)


def test_the_first_train_plan_takes_the_shortest_count_it_weighs():
    cap = _capture()
    plain = passes.compile_graph(cap, _config(), "train")
    finer = passes.compile_graph(cap, _config(), "train", split_finer=True)
    assert plain.num_microbatches == 2 and plain.finer == []
    assert plain.stage_plan.fused[0] > 0                    # it recomputes: the plan weighs finer counts
    counts = [m for m, _, _ in finer.finer]
    assert counts[0] == 2 and counts[1:] == [4, 8]          # rows allowing (8 rows), none without recompute
    assert finer.finer[0][1] == pytest.approx(plain.est_step_time + plain.upload_wait_s)
    best = min(finer.finer, key=lambda w: w[1])
    assert best[1] < (1 - passes.FINER_MARGIN) * finer.finer[0][1]    # (so the test splits finer)
    assert finer.num_microbatches == best[0] == 4
    assert finer.est_step_time + finer.upload_wait_s == pytest.approx(best[1])
    again = passes.compile_graph(cap, _config(num_microbatches=4), "train")
    assert again.est_step_time == pytest.approx(finer.est_step_time)  # the plan an M=4 config makes
    assert "4 microbatches: Config.num_microbatches=2 split finer, where the jobs recompute less" in str(finer)
    assert "# 4 microbatches (weighed 2 microbatches: " in dict((n, t) for n, _, t in finer.passes)["split_finer"]


def test_no_finer_split_where_not_allowed_or_nothing_recomputes():
    cap = _capture()
    for cfg in (_config(split_microbatches=False), _config(split_microbatches=None),   # (None: GPUs only)
                _config(memory_budget=None)):                                         # one fused job
        plan = passes.compile_graph(cap, cfg, "train", split_finer=True)
        assert plan.num_microbatches == 2 and plan.finer == []
        assert "split finer" not in str(plan)
    with pytest.raises(ValueError, match="split_microbatches"):
        rpcompile.Config(split_microbatches="yes")


def test_by_default_gpus_split_finer_only_into_the_whole_model_a_device(monkeypatch):
    """Config.split_microbatches=None: GPUs (any number) weigh finer counts but take only one whose
    plan is the whole model in one fused job a device (measured faster on one GPU; copies of
    three jobs on 2 GPUs at 8 microbatches were slower), CPU devices none; True: any devices, any
    count; False: none. Planned for GPUs on CPU "devices" (GPU cost model)."""
    from types import SimpleNamespace as NS
    one_gpu, two_gpus, cpu = (NS(split_microbatches=None, on_gpu=g, devices=d) for g, d in
                              ((True, ["cuda:0"]), (True, ["cuda:0", "cuda:1"]), (False, ["cpu"])))
    assert passes.finer_allowed(one_gpu) and passes.finer_allowed(two_gpus) and not passes.finer_allowed(cpu)
    for cfg in (one_gpu, two_gpus, cpu):
        assert passes.finer_allowed(NS(**{**vars(cfg), "split_microbatches": True}))
        assert not passes.finer_allowed(NS(**{**vars(cfg), "split_microbatches": False}))
    monkeypatch.setattr(rpcompile.Config, "on_gpu", property(lambda self: True))
    monkeypatch.setattr(rpcompile.Config, "repeats_a_gpu", property(lambda self: False))
    cap = _capture()

    def plan(budget, split):
        return passes.compile_graph(cap, _config(memory_budget=budget, split_microbatches=split, workers="threads"),
                                    "train", split_finer=True)
    several, default = plan("400KiB", True), plan("400KiB", None)    # finer counts recompute less, in several jobs
    assert several.num_microbatches == 8 and several.replicas == 2 and len(several.stages) > 1
    assert default.num_microbatches == 2 and [m for m, _, _ in default.finer] == [2, 4, 8]
    assert min(p for _, p, _ in default.finer) < (1 - passes.FINER_MARGIN) * default.finer[0][1]   # (faster, not taken)
    whole = plan("1000KiB", None)                                      # 8: one fused job a copy
    assert whole.num_microbatches == 8 and whole.replicas == 2 and len(whole.stages) == 1
    assert "8 microbatches: Config.num_microbatches=2 split finer, where the jobs recompute nothing" in str(whole)


def _delayed(config, steps=3):
    """Delayed-mode SGD-momentum steps of the tiny Llama: the losses and parameters after them."""
    model = llama(layers=4)
    cm = rpcompile.compile(model, config)
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    losses = [cm.train_step(**lm_batch(batch=8, seq=SEQ, seed=t)) for t in range(steps)]
    cm.synchronize()
    return cm, losses, [p.detach().clone() for p in model.parameters()]


def _check_split(cm):
    """The plan splits into 4 and the copies run their shares of the 4 microbatches."""
    assert cm.plan.num_microbatches == 4
    text = str(cm.last_schedule)
    for r, share in enumerate(microbatch_shares(4, 2)):
        assert f"@{r}[{share.start}:{share.stop}]" in text


def test_a_finer_split_trains_as_eager_and_later_plans_keep_it():
    """Loss, gradients and parameters after SGD-momentum steps as in eager PyTorch, the batch split
    into the plan's count; a plan made at a longer length splits as the first did."""
    cm = train_both(llama(layers=4), [lm_batch(batch=8, seq=SEQ, seed=s) for s in range(3)], _config(), check_every_step=True)
    _check_split(cm)
    cm.train_step(**lm_batch(batch=8, seq=32, seed=7))    # more activations: the first plan does not fit
    plans = cm._plans.plans()
    assert len(plans) == 2 and [p.num_microbatches for p in plans] == [4, 4]
    assert plans[1].finer == []                           # (chosen once)


def test_a_finer_split_in_delayed_mode_equals_that_count_asked_for():
    cm, losses, params = _delayed(_config(optimizer_mode="delayed"))
    _check_split(cm)
    _, ref_losses, ref_params = _delayed(_config(optimizer_mode="delayed", num_microbatches=4, split_microbatches=False))
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=0)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
