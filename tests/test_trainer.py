"""transformers' Trainer and accelerate with rpcompile: rpcompile.trainer.RPTrainer against eager Trainer, accelerate's loop against its eager one,."""

import pytest
import torch
import torch.nn.functional as F
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


def train(out, rp, config=None, mixin=None, trainer_kw=(), make_model=qwen3, rows=Rows, **kw):
    """A Trainer (RPTrainer when rp, with `config` or two CPU devices; a subclass of it and `mixin`
    when given) run of 4 optimizer steps on a fresh model; the trainer, its model and the gradients
    of each step. (benchmarks/gpu_check.py runs it on a GPU.)"""
    from transformers import Trainer
    model = make_model()
    grads = grad_recorder()
    extra = dict(rp_config=config or rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)) if rp else {}
    cls = _rptrainer() if rp else Trainer
    if mixin is not None:
        cls = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    trainer = cls(model=model, args=arguments(out, **kw), train_dataset=rows(), eval_dataset=rows(8, seed=3),
                  callbacks=[grads], **extra, **dict(trainer_kw))
    trainer.train()
    return trainer, model, grads.steps


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def assert_same_training(rp, eager, make_model=qwen3):
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
    moved = max((p - q).abs().max().item() for p, q in zip(model_e.parameters(), make_model().parameters()))
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


def classifier():
    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    torch.manual_seed(0)
    return Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_labels=3, pad_token_id=VOCAB - 1))


class Classes(torch.utils.data.Dataset):
    """Rows (no padding token in them) with one class label each."""

    def __init__(self, n=ROWS, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB - 1, (n, SEQ), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.classes[i]}


def test_trainer_label_smoothing_classifier_matches_eager(tmp_path):
    """Label smoothing shifts the labels for a causal LM only (Trainer decides by the model's
    class); RPTrainer shifted a classifier's [rows] labels too (loss 0.26 for eager's 1.10)."""
    kw = dict(make_model=classifier, rows=Classes, label_smoothing_factor=0.1)
    rp, eager = train(tmp_path / "rp", True, **kw), train(tmp_path / "eager", False, **kw)
    assert_same_training(rp, eager, make_model=classifier)
    assert rp[0].evaluate()["eval_loss"] == pytest.approx(eager[0].evaluate()["eval_loss"], rel=1e-5)


def weighted_loss(outputs, labels, num_items_in_batch=None):
    """A loss of one's own: next-token cross entropy with tokens weighted by their label, summed over
    the accumulated batch's count, and an auxiliary term from the logits (a z-loss)."""
    logits, target = outputs.logits[:, :-1].float(), labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    n = num_items_in_batch if num_items_in_batch is not None else (target != -100).sum()
    return (ce * (1 + target.reshape(-1) % 3)).sum() / n + 1e-2 * logits.logsumexp(-1).pow(2).mean()


class WeightedLoss:
    """A Trainer subclass's compute_loss (as a mixin): weighted_loss, reading model.config as such
    losses do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        assert outputs.logits.shape[-1] == model.config.vocab_size
        loss = weighted_loss(outputs, labels, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


class AuxTerm:
    """A compute_loss adding an auxiliary term to Trainer's own loss (super().compute_loss)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss + 1e-2 * outputs.logits.float().logsumexp(-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def assert_same_evaluation(tr, tr_e):
    assert tr.evaluate()["eval_loss"] == pytest.approx(tr_e.evaluate()["eval_loss"], rel=1e-5)
    rows = Rows(4, seed=5)
    pred, pred_e = tr.predict(rows), tr_e.predict(rows)
    assert pred.metrics["test_loss"] == pytest.approx(pred_e.metrics["test_loss"], rel=1e-5)


def test_trainer_own_compute_loss_matches_eager(tmp_path):
    """A subclass's compute_loss trains (through the compiled model's call) and evaluates as eager
    Trainer's subclass does. RPTrainer's steps trained with the model's loss instead (losses 0.53
    off eager's, gradients 0.50 of the largest), and its evaluation's model.config was rpcompile's."""
    rp = train(tmp_path / "rp", True, mixin=WeightedLoss)
    eager = train(tmp_path / "eager", False, mixin=WeightedLoss)
    assert_same_training(rp, eager)
    assert rp[0].cm.plan.mode == "call"      # (trained through the compiled model's call)
    assert_same_evaluation(rp[0], eager[0])


def test_trainer_compute_loss_func_matches_eager(tmp_path):
    """compute_loss_func, which RPTrainer refused, trains and evaluates as with eager Trainer."""
    rp = train(tmp_path / "rp", True, trainer_kw=dict(compute_loss_func=weighted_loss))
    eager = train(tmp_path / "eager", False, trainer_kw=dict(compute_loss_func=weighted_loss))
    assert_same_training(rp, eager)
    assert_same_evaluation(rp[0], eager[0])


def test_trainer_aux_term_on_label_smoothing_matches_eager(tmp_path):
    """A compute_loss that adds to super().compute_loss's, with label smoothing (RPTrainer's own
    compute_loss given the model's view); the term was left out of training (losses 0.09 off)."""
    rp = train(tmp_path / "rp", True, mixin=AuxTerm, label_smoothing_factor=0.1)
    eager = train(tmp_path / "eager", False, mixin=AuxTerm, label_smoothing_factor=0.1)
    assert_same_training(rp, eager)
    assert_same_evaluation(rp[0], eager[0])


class OwnStep:
    """A training_step of one's own that does not call super()'s (its forward, loss and backward
    written out, as recipes do), and a prediction_step likewise."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        loss = weighted_loss(model(**inputs), labels, num_items_in_batch)
        self.accelerator.backward(loss)
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        with torch.no_grad():
            loss = weighted_loss(model(**inputs), labels, None)
        return loss.detach(), None, None


def test_trainer_own_training_step_runs_compiled_and_matches_eager(tmp_path, monkeypatch):
    """A subclass's training_step and prediction_step that do not call super()'s were given the
    plain model: every step ran eagerly on the host, rpcompile never called (Note [steps of your
    own]). They run through the compiled model now, and train and evaluate as eager Trainer's."""
    calls = []
    monkeypatch.setattr(rpcompile.CompiledModel, "__call__",
                        lambda cm, *a, _call=rpcompile.CompiledModel.__call__, **k: calls.append(1) or _call(cm, *a, **k))
    rp = train(tmp_path / "rp", True, mixin=OwnStep)
    assert len(calls) == 8           # (4 optimizer steps of 2 accumulated batches)
    eager = train(tmp_path / "eager", False, mixin=OwnStep)
    assert_same_training(rp, eager)
    assert rp[0].evaluate()["eval_loss"] == pytest.approx(eager[0].evaluate()["eval_loss"], rel=1e-5)
    assert len(calls) == 10          # (and the 2 evaluation batches)


class PerBatchLoss:
    loss_is_scaled_for_ga = False     # (Trainer divides the loss by the accumulation steps)


def test_trainer_loss_is_scaled_for_ga_matches_eager(tmp_path):
    """Trainer's loss_is_scaled_for_ga, set without a compute_loss of one's own (RPTrainer's
    train_step steps), scales as eager Trainer does; RPTrainer scaled by num_items_in_batch alone
    (twice eager's loss at 2 accumulation steps)."""
    assert_same_training(train(tmp_path / "rp", True, mixin=PerBatchLoss),
                         train(tmp_path / "eager", False, mixin=PerBatchLoss))


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
    """bf16 / fp16 (Trainer's autocast over evaluation) and an optimizer mode that steps an attached
    optimizer (Trainer steps its own): InputErrors before Trainer acts on them."""
    from rpcompile.trainer import RPTrainer
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2)
    with pytest.raises(rpcompile.InputError, match=r"bf16=True / fp16=True.*leave them off"):
        RPTrainer(model=qwen3(vocab=VOCAB), args=arguments(tmp_path, bf16=True), train_dataset=Rows(), rp_config=cfg)
    with pytest.raises(rpcompile.InputError, match=r"optimizer_mode='delayed'.*use the default"):
        RPTrainer(model=qwen3(vocab=VOCAB), args=arguments(tmp_path), train_dataset=Rows(),
                  rp_config=rpcompile.Config(devices=["cpu", "cpu"], optimizer_mode="delayed"))
