"""Cross-entropy in every spelling (F.cross_entropy with positional or keyword arguments, the
nn.CrossEntropyLoss module with weight / ignore_index / label_smoothing / reduction, legacy
size_average), and nll_loss after a log_softmax in the same spellings, trains with the whole
batch's loss over uneven microbatches; so do sums over rows (a loss with reduction="sum", a
`.sum()` of a per-element loss) and losses that add such sums to a mean."""
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


class LogSoftmaxNLL(nn.Module):
    """A log_softmax, then an nll_loss: cross-entropy in two calls."""

    def __init__(self, nll):
        super().__init__()
        self.nll = nll

    def forward(self, logits, y):
        return self.nll(F.log_softmax(logits, -1), y)


def _nll(**kw):
    return lambda logits, y: F.nll_loss(F.log_softmax(logits, -1), y, **kw)


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
    "nll_module": (lambda: LogSoftmaxNLL(nn.NLLLoss()), "tokens"),
    "nll_module_weight": (lambda: LogSoftmaxNLL(nn.NLLLoss(weight=torch.linspace(0.2, 2.0, CLASSES), ignore_index=-1)),
                          "tokens"),
    "nll_module_sum": (lambda: LogSoftmaxNLL(nn.NLLLoss(reduction="sum", ignore_index=-1)), "sum"),
    "nll_positional": (lambda: LogSoftmaxNLL(lambda x, y: F.nll_loss(x, y, None, None, -1, None, "mean")), "tokens"),
    "nll_legacy_size_average": (lambda: _nll(size_average=False, ignore_index=-1), "sum"),
}
IGNORE_100 = ("module", "nll_module")


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
    ignore = -100 if name in IGNORE_100 else -1

    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3)
    torch.manual_seed(0)
    cm = train_both(Classifier(make()), batches(ignore), cfg, eager_step=scalar_loss_step)
    assert cm.plan.loss_scale.kind == kind


def test_nll_loss_would_be_wrong_as_a_mean_over_rows():
    """Before, an nll_loss was taken as a mean over rows: with these labels the first step's loss
    of nll_module_weight was 0.023 off eager's (checked); weighting by rows gives another loss."""
    model = Classifier(LogSoftmaxNLL(nn.NLLLoss(weight=torch.linspace(0.2, 2.0, CLASSES), ignore_index=-1)))
    b = batches(-1)[0]
    parts = [model(x, y) * (x.shape[0] / 7) for x, y in zip(torch.tensor_split(b["x"], 3),
                                                             torch.tensor_split(b["y"], 3))]
    assert not torch.allclose(model(**b), sum(parts), rtol=1e-3)


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


class Regressor(nn.Module):
    """Classifier's layers, a head of 4 outputs per position and a loss(out, y, model)."""

    def __init__(self, loss):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 4)
        self.loss = loss

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.loss(self.out(x), y, self)       # out, y: (rows, seq, 4)


def regression_batches():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(7, 3, 8, generator=g), "y": torch.rand(7, 3, 4, generator=g)} for _ in range(3)]


# loss(out, y, model) -> (kind, terms): how its microbatches' losses combine (Note [sums over rows])
SUMS = {
    "mse_sum": (lambda o, y, m: F.mse_loss(o, y, reduction="sum"), "sum", ()),
    "mse_module_sum": (lambda o, y, m: nn.MSELoss(reduction="sum")(o, y), "sum", ()),
    "mse_legacy_size_average": (lambda o, y, m: F.mse_loss(o, y, size_average=False), "sum", ()),
    "l1_sum": (lambda o, y, m: F.l1_loss(o, y, reduction="sum"), "sum", ()),
    "smooth_l1_sum": (lambda o, y, m: F.smooth_l1_loss(o, y, reduction="sum", beta=0.5), "sum", ()),
    "huber_sum": (lambda o, y, m: F.huber_loss(o, y, reduction="sum", delta=0.5), "sum", ()),
    "bce_with_logits_sum": (lambda o, y, m: F.binary_cross_entropy_with_logits(o, y, reduction="sum"), "sum", ()),
    "kl_div_sum": (lambda o, y, m: F.kl_div(F.log_softmax(o, -1), F.softmax(y, -1), reduction="sum"), "sum", ()),
    "plain_sum": (lambda o, y, m: (o - y).abs().sum(), "sum", ()),
    "torch_sum": (lambda o, y, m: torch.sum((o - y) ** 2), "sum", ()),
    "sum_of_row_sums": (lambda o, y, m: ((o - y) ** 2).sum(-1).sum(), "sum", ()),
    "sum_over_rows_first": (lambda o, y, m: ((o - y) ** 2).sum(0).sum(), "sum", ()),
    "sum_over_all_dims": (lambda o, y, m: ((o - y) ** 2).sum(dim=(0, 1, 2)), "sum", ()),
    "aten_sum": (lambda o, y, m: torch.ops.aten.mse_loss.default(o, y, 2), "sum", ()),
    # sums added to each other, scaled, or added to a mean: each sum is a term (scale 1 / w_m)
    "scaled_sums": (lambda o, y, m: 0.5 * F.mse_loss(o, y, reduction="sum") + (o - y).abs().sum(), "rows",
                    (None, None)),
    "sum_plus_mean": (lambda o, y, m: F.mse_loss(o, y, reduction="sum") - 0.3 * F.l1_loss(o, y), "rows", (None,)),
    # a sum over a parameter is the same in every microbatch: the rest of the loss, not a term
    "sum_plus_parameter_sum": (lambda o, y, m: F.mse_loss(o, y, reduction="sum") + 0.1 * m.out.weight.pow(2).sum(),
                               "rows", (None,)),
    # not sums over rows: means over rows, as before
    "mean": (lambda o, y, m: F.mse_loss(o, y), "rows", ()),
    "sum_of_a_row_mean": (lambda o, y, m: ((o - y) ** 2).mean(0).sum(), "rows", ()),
    "sum_over_rows_per_row": (lambda o, y, m: F.mse_loss(o, y, reduction="sum") / o.shape[0], "rows", ()),
    "mean_plus_sum_over_a_parameter": (lambda o, y, m: F.mse_loss(o, y) + F.mse_loss(
        m.out.weight, torch.zeros_like(m.out.weight), reduction="sum"), "rows", ()),
}


class _Loss(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, o, y, m):
        return self.fn(o, y, m)


@pytest.mark.parametrize("name", SUMS)
def test_sums_over_rows_add_up_over_microbatches(name):
    """A loss that sums over rows (reduction="sum", a .sum() of a batch-first value) adds up over
    microbatches, alone or as a term of the loss: before, taken as a mean over rows, the loss and
    gradients were about 1/3 of eager's (3 microbatches of 3, 2 and 2 rows)."""
    fn, kind, terms = SUMS[name]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3)
    torch.manual_seed(0)
    cm = train_both(Regressor(lambda o, y, m: fn(o, y, m)), regression_batches(), cfg, eager_step=scalar_loss_step)
    assert (cm.plan.loss_scale.kind, cm.plan.loss_scale.terms) == (kind, terms)


def test_a_sum_added_to_a_mean_cross_entropy_is_a_term():
    """A token-mean cross-entropy plus a sum over rows (of the logits' squares): both terms
    (Note [cross-entropy terms], Note [sums over rows]), the loss as eager's."""
    def loss(logits, y):
        return F.cross_entropy(logits, y, ignore_index=-1) + 1e-3 * logits.pow(2).sum()

    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3)
    torch.manual_seed(0)
    cm = train_both(Classifier(loss), batches(-1), cfg, eager_step=scalar_loss_step)
    assert cm.plan.loss_scale.kind == "rows" and len(cm.plan.loss_scale.terms) == 2
    assert cm.plan.loss_scale.terms[0] is not None and cm.plan.loss_scale.terms[1] is None


def test_a_loss_fn_summing_over_rows_adds_up_over_microbatches():
    """Config(loss_fn=F.mse_loss(..., reduction="sum")) on a plain nn.Sequential: before, the loss
    was 19.56 for eager's 58.68 (1/3: three microbatches)."""
    def fn(out, target):
        return F.mse_loss(out, target, reduction="sum")

    def eager(m, b):
        loss = fn(m(b["x"]), b["y"])
        loss.backward()
        return loss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(6, 20, generator=g), "y": torch.randn(6, 10, generator=g)} for _ in range(3)]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, loss_fn=fn)
    cm = train_both(net, data, cfg, eager_step=eager, call=lambda cm, b: cm.train_step(b["x"], target=b["y"]),
                    min_stages=0)
    assert cm.plan.loss_scale.kind == "sum"


def test_a_new_loss_fn_gets_its_own_plan():
    """Note [loss_fn in the key]: a closure made per step (freed after its call) took an earlier
    one's id and, with it, its plan: c=2 and c=3 trained with c=1's loss."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    cm = rpcompile.compile(net, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))

    def scaled(c):
        return lambda out, target: c * F.cross_entropy(out, target)
    for c in (1.0, 2.0, 3.0):
        loss = cm.train_step(x, target=y, loss_fn=scaled(c))
        assert loss.item() == pytest.approx(c * F.cross_entropy(net(x), y).item(), rel=1e-6)


def test_a_bound_method_loss_fn_is_captured_once():
    """A loss_fn given as a bound method (a new object at each access, as RPTrainer's `_smoothed`)
    serves from one plan."""
    torch.manual_seed(0)

    class Losses:
        def ce(self, out, target):
            return F.cross_entropy(out, target)
    losses = Losses()
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cm = rpcompile.compile(net, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    keep = []       # (the methods stay alive: each access has its own id)
    for _ in range(3):
        keep.append(losses.ce)
        cm.train_step(torch.randn(8, 8), target=torch.randint(0, 4, (8,)), loss_fn=keep[-1])
    assert len(cm._plans.plans()) == 1


def test_a_lambda_written_in_the_loop_is_captured_once():
    """A loss_fn lambda written in the training loop is a new object each step, the same function
    (its code, closure values and defaults): one capture serves every step; another closure value
    is another plan (Note [loss_fn in the key])."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cm = rpcompile.compile(net, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    for c in (1.0, 1.0, 1.0, 2.0):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss = cm.train_step(x, target=y, loss_fn=lambda out, target: c * F.cross_entropy(out, target))
        assert loss.item() == pytest.approx(c * F.cross_entropy(net(x), y).item(), rel=1e-6)
    assert cm._plans.captures() == 2
