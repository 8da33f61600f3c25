"""transformers' Trainer whose training and evaluation steps run through rpcompile (README,
"With transformers' Trainer"). Importing this module imports transformers (an extra).

Note [Trainer given the model]: Trainer reads the model's class, config and forward signature,
and `Trainer(model=cm)` gets them wrong: it drops every dataset column ("The batch received was
empty"); with `remove_unused_columns=False` it counts `num_items_in_batch` over unshifted labels
(silently a loss 15/16 of eager's at 16 tokens a row), computes no `eval_loss`, and saves weights
named `model.*` that `from_pretrained` does not load. So RPTrainer is given the model itself, and
compiles it at first use; Trainer's own machinery (columns, accumulation, clipping, schedules,
checkpoints, saving) sees the plain model.
"""
from transformers import Trainer

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
        if kwargs.get("compute_loss_func") is not None:
            raise InputError("RPTrainer: its training steps run rpcompile's train_step, which would not call "
                             "compute_loss_func; pass that loss to train_step as loss_fn (override training_step: "
                             "RPTrainer's passes _smoothed so for label smoothing)")
        super().__init__(*args, **kwargs)
        self.rp_config, self._cm = rp_config, None

    @property
    def cm(self):    # compiled at first use, and again for a new model (Trainer's model_init)
        if self._cm is None or self._cm.model is not self.model:
            self._cm = rpcompile.compile(self.model, self.rp_config)
        return self._cm

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        # as Trainer scales: given num_items_in_batch the loss is a token sum over the count of all
        # accumulated batches; without it, a batch mean divided by the accumulation steps
        scale = 1.0 if num_items_in_batch is not None else 1 / self.current_gradient_accumulation_steps
        if self.label_smoother is None:
            if num_items_in_batch is not None:
                inputs["num_items_in_batch"] = num_items_in_batch
            loss = self.cm.train_step(**inputs, grad_scale=scale)
        else:
            labels = inputs.pop("labels")
            n = num_items_in_batch if num_items_in_batch is not None else (labels[..., 1:] != -100).sum()
            loss = self.cm.train_step(**inputs, target=(labels, n), loss_fn=self._smoothed, grad_scale=scale)
        return loss * scale

    def _smoothed(self, outputs, target):       # Trainer's label smoothing: token sums over n
        labels, n = target
        return self.label_smoother(outputs, labels, shift_labels=True, num_items_in_batch=n)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return super().prediction_step(self.cm, inputs, prediction_loss_only, ignore_keys)   # under no_grad

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model is self.cm and self.label_smoother is not None:   # (Trainer shifts by the class: cm's)
            labels = inputs.pop("labels")
            outputs = self.cm(**inputs)
            loss = self.label_smoother(outputs, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
