"""A compiled model's first call made under torch.no_grad() or torch.inference_mode() (an
evaluation before training): its capture and plan are made with gradients enabled, so the
later differentiable calls and train steps (their plans share the capture) compute eager's
gradients. Before, a train step's plan made under no_grad had no loss output (KeyError, at
every later step too), and a call's plan made there left every .grad None after backward."""
import copy

import pytest
import torch

import rpcompile

from models import lm_batch, qwen3
from parity import check_grads, close

GRAD_OFF = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _compiled():
    model = qwen3(layers=1)
    return model, copy.deepcopy(model), rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"],
                                                                                  num_microbatches=2))


@pytest.mark.parametrize("off", list(GRAD_OFF))
def test_a_first_train_step_under_no_grad_computes_eagers_gradients(off):
    model, ref, cm = _compiled()
    batch = lm_batch()
    with GRAD_OFF[off]():
        loss = cm.train_step(**batch)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    close(loss, ref_loss.detach(), 1e-5, 1e-6, "loss")
    check_grads(model, ref)
    model.zero_grad()
    cm.train_step(**batch)      # (and with gradients on, from the same capture)
    check_grads(model, ref)


@pytest.mark.parametrize("off", list(GRAD_OFF))
def test_a_differentiable_call_after_a_first_call_under_no_grad_computes_eagers_gradients(off):
    model, ref, cm = _compiled()
    batch = lm_batch()
    with GRAD_OFF[off]():
        close(cm(**batch).loss, ref(**batch).loss, 1e-5, 1e-6, "loss under no_grad")
    out = cm(**batch)
    out.loss.backward()
    ref(**batch).loss.backward()
    check_grads(model, ref)
