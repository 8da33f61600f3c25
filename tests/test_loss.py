"""Cross-entropy in every spelling (F.cross_entropy with positional or keyword arguments, the
nn.CrossEntropyLoss module with weight / ignore_index / label_smoothing / reduction, legacy
size_average) trains with the whole batch's loss over uneven microbatches."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile

from parity import scalar_loss_step, train_both

CLASSES = 6


class Classifier(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, CLASSES)
        self.loss = loss

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.out(x)                      # (rows, seq, classes)
        return self.loss(logits.view(-1, CLASSES), y.view(-1))


class Positional(nn.Module):
    """F.cross_entropy with every argument positional, as dynamo traces the module form."""

    def forward(self, logits, y):
        return F.cross_entropy(logits, y, None, None, -1, None, "mean", 0.0)


class Legacy(nn.Module):
    def forward(self, logits, y):
        return F.cross_entropy(logits, y, size_average=False, ignore_index=-1)


class SoftTargets(nn.Module):
    """Class-probability targets (no ignore_index): a mean over rows."""

    def forward(self, logits, y):
        return F.cross_entropy(logits, F.one_hot(y.clamp(min=0), CLASSES).float() * 0.9 + 0.1 / CLASSES)


LOSSES = {
    "module": (lambda: nn.CrossEntropyLoss(), "tokens"),
    "module_all_arguments": (lambda: nn.CrossEntropyLoss(weight=torch.linspace(0.2, 2.0, CLASSES), ignore_index=-1,
                                                         label_smoothing=0.1), "tokens"),
    "module_weight": (lambda: nn.CrossEntropyLoss(weight=torch.linspace(0.2, 2.0, CLASSES), ignore_index=-1),
                      "tokens"),
    "module_sum": (lambda: nn.CrossEntropyLoss(reduction="sum", ignore_index=-1), "sum"),
    "positional": (Positional, "tokens"),
    "legacy_size_average": (Legacy, "sum"),
    "probability_targets": (SoftTargets, "rows"),
}


def batches(ignore):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        y = torch.randint(0, CLASSES, (7, 3), generator=g)
        y[0, :] = ignore
        y[5, 1:] = ignore
        out.append({"x": torch.randn(7, 3, 8, generator=g), "y": y})
    return out


@pytest.mark.parametrize("name", LOSSES)
def test_cross_entropy_forms_train_like_eager(name):
    make, kind = LOSSES[name]
    ignore = -100 if name == "module" else -1

    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3)
    torch.manual_seed(0)
    cm = train_both(Classifier(make()), batches(ignore), cfg, eager_step=scalar_loss_step)
    assert cm.plan.loss_scale.kind == kind


def test_rows_would_be_wrong_here():
    """The batches above need the token count: weighting microbatches by rows gives another loss
    (so the parity test can tell a rewritten loss from an unrewritten one)."""
    model = Classifier(nn.CrossEntropyLoss(weight=torch.linspace(0.2, 2.0, CLASSES), ignore_index=-1))
    b = batches(-1)[0]
    whole = model(**b)
    parts = [model(x, y) * (x.shape[0] / 7) for x, y in zip(torch.tensor_split(b["x"], 3),
                                                             torch.tensor_split(b["y"], 3))]
    assert not torch.allclose(whole, sum(parts), rtol=1e-3)


def test_a_target_out_of_bounds_is_an_error_before_the_step():
    """F.cross_entropy refuses a label outside [0, V); so does rpcompile (a vocabulary-split head
    would otherwise count it as a logit of 0): an InputError, raised before any job runs."""
    import pytest

    from models import lm_batch, qwen3

    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, lm_head_shards=3))
    b = lm_batch()
    cm.train_step(**b)
    model.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    b["labels"][2, 5] = 128                      # vocabulary of 128: one past the end
    with pytest.raises(rpcompile.InputError, match=r"out of bounds.*\[0, 128\)"):
        cm.train_step(**b)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
