"""transformers' Trainer and accelerate with rpcompile: rpcompile.trainer.RPTrainer against eager Trainer, accelerate's loop against its eager one,."""

import pytest
import torch
from models import qwen3

import rpcompile

VOCAB, ROWS, SEQ = 128, 16, 16


def _rptrainer():
    from rpcompile.trainer import RPTrainer
    return RPTrainer


class Rows(torch.utils.data.Dataset):
    """Causal-LM rows whose labels are ignored (-100) over prefixes of uneven lengths, so that
    num_items_in_batch differs from batch to batch."""

    def __init__(self, n=ROWS, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: (5 * i) % 13] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def arguments(out, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                gradient_accumulation_steps=2, max_steps=4, learning_rate=0.1, optim="sgd",
                optim_args="momentum=0.9", max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1,
                logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def grad_recorder():
    from transformers import TrainerCallback

    class Grads(TrainerCallback):
        """Each optimizer step's gradients (after clipping)."""
        def __init__(self):
            self.steps = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.steps.append([p.grad.clone() for p in model.parameters()])
    return Grads()


def train(out, rp, config=None, **kw):
    """A Trainer (RPTrainer when rp, with `config` or two CPU devices) run of 4 optimizer steps on
    a fresh model; the trainer, its model and the gradients of each step. (benchmarks/gpu_check.py
    runs it on a GPU.)"""
    from transformers import Trainer
    model = qwen3()
    grads = grad_recorder()
    extra = dict(rp_config=config or rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)) if rp else {}
    trainer = (_rptrainer() if rp else Trainer)(
        model=model, args=arguments(out, **kw), train_dataset=Rows(), eval_dataset=Rows(8, seed=3),
        callbacks=[grads], **extra)
    trainer.train()
    return trainer, model, grads.steps


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def assert_same_training(rp, eager):
    (tr, model, grads), (tr_e, model_e, grads_e) = rp, eager
    losses, losses_e = logged(tr, "loss"), logged(tr_e, "loss")
    assert len(losses) == 4 and len(set(losses_e)) == 4
    assert losses == pytest.approx(losses_e, rel=1e-5)
    norms, norms_e = logged(tr, "grad_norm"), logged(tr_e, "grad_norm")
    assert norms == pytest.approx(norms_e, rel=1e-5)
    assert max(norms_e) > tr_e.args.max_grad_norm          # (clipping did something)
    assert len(grads) == len(grads_e) == 4
    for step, step_e in zip(grads, grads_e):
        largest = max(g.abs().max() for g in step_e)
        assert max(((g - e).abs().max() / largest).item() for g, e in zip(step, step_e)) < 1e-5
    moved = max((p - q).abs().max().item() for p, q in zip(model_e.parameters(), qwen3().parameters()))
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), model_e.parameters()))
    assert moved > 1e-2 and worst < 1e-5 * moved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """RPTrainer and eager Trainer, model loss (num_items_in_batch); RPTrainer's saves checkpoints."""
    out = tmp_path_factory.mktemp("trainer")
    rp = train(out / "rp", True, save_strategy="steps", save_steps=2)
    eager = train(out / "eager", False)
    return out, rp, eager


def test_trainer_recipe_matches_eager(runs):
    _, rp, eager = runs
    (tr, model, _), (tr_e, _, _) = rp, eager
    assert tr.model_accepts_loss_kwargs     # (num_items_in_batch reached the model's loss)
    assert_same_training(rp, eager)
    assert tr.evaluate()["eval_loss"] == pytest.approx(tr_e.evaluate()["eval_loss"], rel=1e-5)
    rows = Rows(4, seed=5)
    pred, pred_e = tr.predict(rows), tr_e.predict(rows)
    assert pred.metrics["test_loss"] == pytest.approx(pred_e.metrics["test_loss"], rel=1e-5)
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(pred_e.predictions),
                               rtol=1e-5, atol=1e-5)
    assert not model.training and tr.cm.plan.mode == "call"     # (the evaluation ran through rpcompile)


def test_trainer_recipe_resumes_and_saves(runs):
    from transformers import AutoModelForCausalLM
    out, (tr, model, _), _ = runs
    fresh = qwen3(seed=7)      # other weights: the checkpoint's replace them
    trainer = _rptrainer()(model=fresh, args=arguments(out / "rp"), train_dataset=Rows(),
                                 rp_config=rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    trainer.train(resume_from_checkpoint=str(out / "rp" / "checkpoint-2"))
    assert logged(trainer, "loss") == pytest.approx(logged(tr, "loss"), rel=1e-6)
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    trainer.save_model(str(out / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    for p, q in zip(loaded.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_trainer_recipe_label_smoothing_matches_eager(tmp_path):
    rp = train(tmp_path / "rp", True, label_smoothing_factor=0.1)
    eager = train(tmp_path / "eager", False, label_smoothing_factor=0.1)
    assert_same_training(rp, eager)
    assert rp[0].evaluate()["eval_loss"] == pytest.approx(eager[0].evaluate()["eval_loss"], rel=1e-5)


def test_accelerate_loop_matches_eager():
    """The README's accelerate loop: train_step in place of forward + accelerator.backward."""
    from accelerate import Accelerator

    def run(rp):
        model = qwen3()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.5, total_iters=4)
        loader = torch.utils.data.DataLoader(Rows(), batch_size=4)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)) if rp else None
        losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                if rp:
                    loss = cm.train_step(**batch, grad_scale=1 / accelerator.gradient_accumulation_steps)
                else:
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step(); sched.step(); opt.zero_grad()
            losses.append(loss.item())
        return model, losses

    (model, losses), (model_e, losses_e) = run(True), run(False)
    assert losses == pytest.approx(losses_e, rel=1e-5) and len(set(losses_e)) == 4
    moved = max((p - q).abs().max().item() for p, q in zip(model_e.parameters(), qwen3().parameters()))
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), model_e.parameters()))
    assert moved > 1e-3 and worst < 1e-5 * moved


def test_trainer_refuses_settings_that_undo_rpcompile(tmp_path):
    """bf16 / fp16 (Trainer's autocast over evaluation), an optimizer mode that steps an attached
    optimizer (Trainer steps its own) and a compute_loss_func the steps would not call:
    InputErrors before Trainer acts on them."""
    from rpcompile.trainer import RPTrainer
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    with pytest.raises(rpcompile.InputError, match=r"bf16=True / fp16=True.*leave them off"):
        RPTrainer(model=qwen3(vocab=VOCAB), args=arguments(tmp_path, bf16=True), train_dataset=Rows(), rp_config=cfg)
    with pytest.raises(rpcompile.InputError, match=r"optimizer_mode='delayed'.*use the default"):
        RPTrainer(model=qwen3(vocab=VOCAB), args=arguments(tmp_path), train_dataset=Rows(),
                  rp_config=rpcompile.Config(devices=["cpu", "cpu"], optimizer_mode="delayed"))
    with pytest.raises(rpcompile.InputError, match=r"compute_loss_func.*loss_fn"):
        RPTrainer(model=qwen3(vocab=VOCAB), args=arguments(tmp_path), train_dataset=Rows(), rp_config=cfg,
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
