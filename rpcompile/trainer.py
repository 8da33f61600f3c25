"""transformers' Trainer whose training and evaluation steps run through rpcompile (README,
"With transformers' Trainer"). Importing this module imports transformers (an extra).

Note [Trainer given the model]: Trainer reads the model's class, config and forward signature,
and `Trainer(model=cm)` gets them wrong: it drops every dataset column ("The batch received was
empty"); with `remove_unused_columns=False` it counts `num_items_in_batch` over unshifted labels
(silently a loss 15/16 of eager's at 16 tokens a row), computes no `eval_loss`, and saves weights
named `model.*` that `from_pretrained` does not load. So RPTrainer is given the model itself, and
compiles it at first use; Trainer's own machinery (columns, accumulation, clipping, schedules,
checkpoints, saving) sees the plain model.

Note [compute_loss of your own]: RPTrainer's training step ran rpcompile's train_step, which
computes the model's own loss, so a subclass's compute_loss (a weighted loss, an auxiliary term,
distillation) was never called in training: it silently trained with the model's loss (a loss
0.53 off eager's, gradients 0.50 of the largest). Where the loss is not Trainer's own (that or a
compute_loss_func), the step is Trainer's training_step itself, given a view of the model whose
call is the compiled model's differentiable call (`cm(...)`; backward adds into the model's .grad),
so compute_loss, the scaling for gradient accumulation (`loss_is_scaled_for_ga`) and the backward
are eager Trainer's. prediction_step is given the same view: compute_loss reads `model.config` as
the model's (given cm, it read rpcompile's Config: `model.config.vocab_size` failed in evaluation).

Note [steps of your own]: a subclass's training_step (or prediction_step) that does not call
super()'s, calling `model(**inputs)` and `self.accelerator.backward(loss)` itself, was given the
plain model by Trainer's loop: the step ran eagerly on the host's CPU, the whole model at once
(as slow as that is, and beyond the host's memory for the activations of a model rpcompile is for),
with rpcompile never called. A subclass's own step is given the view too (`__init_subclass__`),
so its forward is the compiled model's call; one that calls super()'s reaches RPTrainer's.
"""
import functools

from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import rpcompile
from rpcompile.errors import InputError


def _check_arguments(targs) -> None:
    """Settings under which Trainer would undo what rpcompile does, refused before Trainer acts
    on them: it would move the whole model onto a GPU, or run evaluation under its autocast
    (rpcompile casts itself: Config.dtype)."""
    if targs.device.type != "cpu":
        raise InputError(f"RPTrainer: TrainingArguments put the model on {targs.device}; rpcompile keeps it on the "
                         "host and runs the stages on Config.devices. Pass TrainingArguments(use_cpu=True, ...)")
    if targs.bf16 or targs.fp16:
        raise InputError("RPTrainer: TrainingArguments(bf16=True / fp16=True) would run evaluation under "
                         "Trainer's autocast; rpcompile casts itself (Config(dtype=...), bf16 on GPUs): leave them off")


class RPTrainer(Trainer):
    """transformers' Trainer whose training and evaluation steps run through rpcompile."""

    def __init__(self, *args, rp_config: "rpcompile.Config", **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:
            _check_arguments(targs)
        if rp_config.optimizer_mode != "exact":
            raise InputError(f"RPTrainer: Config(optimizer_mode={rp_config.optimizer_mode!r}) steps an attached optimizer "
                             "itself, but Trainer steps its own (after clipping, with its schedule): use the default "
                             "optimizer_mode='exact'")
        super().__init__(*args, **kwargs)
        self.rp_config, self._cm = rp_config, None
        self._view = _CompiledView(self)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("training_step", "prediction_step"):     # Note [steps of your own]
            step = getattr(cls, name)
            if step is not getattr(RPTrainer, name) and not hasattr(step, "_rp_given_the_view"):
                setattr(cls, name, _given_the_view(step))

    @property
    def cm(self):    # compiled at first use, and again for a new model (Trainer's model_init)
        if self._cm is None or self._cm.model is not self.model:
            self._cm = rpcompile.compile(self.model, self.rp_config)
        return self._cm

    def _loss_of_your_own(self) -> bool:
        """A compute_loss other than RPTrainer's (a subclass's, or one set on the instance) or a
        compute_loss_func: Note [compute_loss of your own]."""
        return (getattr(self.compute_loss, "__func__", None) is not RPTrainer.compute_loss
                or self.compute_loss_func is not None)

    def _shifts_labels(self) -> bool:
        """Whether Trainer's label smoothing shifts the labels: by the model's class, as
        Trainer.compute_loss decides (a causal LM's; peft's base model's)."""
        model = self.accelerator.unwrap_model(self.model)
        name = model.base_model.model._get_name() if _is_peft_model(model) else model._get_name()
        return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._loss_of_your_own():
            return super().training_step(self._view, inputs, num_items_in_batch)
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        # as Trainer scales (unless loss_is_scaled_for_ga says): given num_items_in_batch the loss is
        # a token sum over the count of all accumulated batches; without it, a batch mean divided by
        # the accumulation steps
        # (a Trainer without this setting, transformers 5.17's, ignores it)
        scaled = getattr(self, "loss_is_scaled_for_ga", None) if hasattr(Trainer, "loss_is_scaled_for_ga") else None
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        scale = 1.0 if scaled else 1 / self.current_gradient_accumulation_steps
        if self.label_smoother is None:
            if num_items_in_batch is not None and self.model_accepts_loss_kwargs:
                inputs["num_items_in_batch"] = num_items_in_batch
            loss = self.cm.train_step(**inputs, grad_scale=scale)
        else:
            labels = inputs.pop("labels")
            shift = self._shifts_labels()
            n = num_items_in_batch
            if n is None:     # (the batch's own count: each microbatch's mean would weight them unevenly)
                n = ((labels[..., 1:] if shift else labels) != -100).sum()
            loss = self.cm.train_step(**inputs, target=(labels, n, shift), loss_fn=self._smoothed, grad_scale=scale)
        return loss * scale

    def _smoothed(self, outputs, target):       # Trainer's label smoothing: token sums over n
        labels, n, shift = target
        return self.label_smoother(outputs, labels, shift_labels=shift, num_items_in_batch=n)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return super().prediction_step(self._view, inputs, prediction_loss_only, ignore_keys)   # under no_grad

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if (model is self._view and self.label_smoother is not None and self.compute_loss_func is None
                and "labels" in inputs):   # (Trainer shifts by `model`'s class: the view's is not peft's base's)
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = self.label_smoother(outputs, labels, shift_labels=self._shifts_labels(),
                                       num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _given_the_view(step):
    """A subclass's step, given the compiled model's view as `model` (Note [steps of your own])."""
    @functools.wraps(step)
    def given(self, model, inputs, *args, **kwargs):
        return step(self, self._view, inputs, *args, **kwargs)
    given._rp_given_the_view = True
    return given


def _is_peft_model(model) -> bool:
    """As transformers.trainer's private helper: a peft model (whose base class decides the shift)."""
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


class _CompiledView:
    """What RPTrainer gives compute_loss and prediction_step as `model` (Note [compute_loss of
    your own]): calling it (or its forward) calls the compiled model, differentiably; every other
    attribute is the model's own (`model.config`, `model.training`, `model.train()`)."""

    def __init__(self, trainer):
        self._trainer = trainer

    def __call__(self, *args, **kwargs):
        return self._trainer.cm(*args, **kwargs)    # (cm: a new model from model_init compiles again)

    forward = __call__

    def __getattr__(self, name):
        if name == "_trainer":      # (not yet set: copy, pickle)
            raise AttributeError(name)
        return getattr(self._trainer.model, name)
