"""Losses that add something to a mean cross-entropy (Note [cross-entropy terms] in
passes/normalize_loss.py): the cross-entropy is the whole batch's token mean, as eager's, and the
rest a mean over rows; an MoE that asks for its router logits is captured fresh (Note [recorded
outputs] in capture.py)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from models import TwoLayers, lm_batch, qwen3
from parity import TIGHT, check_grads, close, scalar_loss_step, train_both


def _uneven(seed):
    """4 rows, row 0 counting one token and the others all theirs: a microbatch's token mean
    weighed by its rows is not the batch's."""
    b = lm_batch(batch=4, seed=seed)
    b["labels"] = b["input_ids"].clone()
    b["labels"][0, :] = -100
    b["labels"][0, 5] = b["input_ids"][0, 5]
    return b


def _nll(out, labels):
    """A loss_fn: cross-entropy as a log_softmax and an nll_loss (its token mean, ignore_index -100)."""
    return F.nll_loss(F.log_softmax(out.logits, -1).flatten(0, 1), labels.flatten())


def _nll_regularized(out, labels):
    """Twice the nll_loss's token mean, plus a sum over rows of the logits' squares, less a mean
    over rows of them."""
    logits = out.logits
    return 2 * _nll(out, labels) + 1e-4 * logits.pow(2).sum() - 0.1 * logits.pow(2).mean()


@pytest.mark.parametrize("loss_fn,kind,scales", [(_nll, "tokens", []),
                                                 (_nll_regularized, "rows", ["loss_scale_0", "loss_scale_1"])])
def test_an_nll_loss_trains_on_the_whole_batchs_token_mean(loss_fn, kind, scales):
    """F.log_softmax + F.nll_loss is cross-entropy: its token mean over the whole batch, alone or
    as a term. Before, taken as a mean over rows, the loss was 4.822141 for eager's 4.823033 and
    gradients 0.18 (of the largest) off eager's (Qwen3, 2 microbatches, these uneven labels)."""
    def eager(m, b):
        loss = loss_fn(m(input_ids=b["input_ids"]), b["labels"])
        loss.backward()
        return loss

    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, loss_fn=loss_fn)
    cm = train_both(qwen3(layers=1), [_uneven(s) for s in range(3)], cfg, eager_step=eager,
                    call=lambda cm, b: cm.train_step(input_ids=b["input_ids"], target=b["labels"]))
    assert cm.plan.loss_scale.kind == kind
    assert [n.name for n in cm.plan.gm.graph.nodes if n.meta.get("rp_kind") == "loss_scale"] == scales


def _regularized(out, labels):
    """A loss_fn: twice the token mean of the cross-entropy, less a mean over rows (of the logits'
    squares), through a cast and a product with a number."""
    logits = out.logits
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return 2 * ce - (-0.1 * logits.float().pow(2).mean()).to(ce.dtype)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_loss_that_adds_to_a_cross_entropy_trains_as_eager(workers):
    """Before, the loss was taken as a mean over rows as a whole: gradients 4% (of the largest)
    off eager's with these labels."""
    def eager(m, b):
        loss = _regularized(m(input_ids=b["input_ids"]), b["labels"])
        loss.backward()
        return loss

    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, loss_fn=_regularized, workers=workers)
    cm = train_both(qwen3(layers=1), [_uneven(s) for s in range(3)], cfg, eager_step=eager,
                    call=lambda cm, b: cm.train_step(input_ids=b["input_ids"], target=b["labels"]))
    assert [n.name for n in cm.plan.gm.graph.nodes if n.meta.get("rp_kind") == "loss_scale"] == ["loss_scale_0"]


class _Head(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.lin, self.loss = nn.Linear(8, 5), loss
        self.log_var = nn.Parameter(torch.tensor(0.3))
        self.register_buffer("weight", torch.tensor(2.0))

    def forward(self, x, y):
        logits = self.lin(x)
        return self.loss(F.cross_entropy(logits, y), logits.pow(2).mean(), self)


@pytest.mark.parametrize("loss,terms", [
    (lambda ce, reg, m: ce, None),                     # the cross-entropy alone: its own kind ("tokens")
    (lambda ce, reg, m: ce + reg, 1),
    (lambda ce, reg, m: 2 * ce - reg / 3, 1),
    (lambda ce, reg, m: reg - ce.float() * 0.5, 1),
    (lambda ce, reg, m: torch.neg(ce).add(reg), 1),
    (lambda ce, reg, m: ce * ce + reg, 0),             # not affine in it: the loss stays a row mean
    (lambda ce, reg, m: torch.exp(ce) + reg, 0),
    (lambda ce, reg, m: ce * reg, 0),
    (lambda ce, reg, m: ce + reg * ce, 0),             # (the cross-entropy has two users)
    (lambda ce, reg, m: ce * m.weight + reg, 1),       # a product with a buffer: the same in every microbatch
    (lambda ce, reg, m: ce / m.log_var.exp() + m.log_var, 1),   # a learned uncertainty weight
    (lambda ce, reg, m: m.log_var * ce / m.weight - reg, 1),
    (lambda ce, reg, m: reg / ce, 0),                  # not affine in it
    (lambda ce, reg, m: ce * (m.weight + reg), 0),     # a product with a batch's value
])
def test_cross_entropy_terms_are_found_where_the_loss_is_affine_in_them(loss, terms):
    from rpcompile.capture import capture_call
    from rpcompile.passes.normalize_loss import normalize_loss
    g = torch.Generator().manual_seed(0)
    cap = capture_call(_Head(loss), (torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)), {},
                       dtype=None)
    gm = normalize_loss(cap.gm, 0)
    scale = gm.meta["rp_loss"]
    scales = [n for n in gm.graph.nodes if n.meta.get("rp_kind") == "loss_scale"]
    if terms is None:
        assert scale.kind == "tokens" and not scales and not scale.terms
    else:
        assert scale.kind == "rows" and len(scales) == len(scale.terms) == terms


class _SumHead(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.lin, self.loss = nn.Linear(8, 5), loss

    def forward(self, x, y, count):
        return self.loss(F.cross_entropy(self.lin(x), y, reduction="sum"), count)


@pytest.mark.parametrize("loss,terms", [
    (lambda ce, count: ce / 7, (None,)),                   # a token sum over a number ...
    (lambda ce, count: ce / count.sum(), (None,)),         # ... or over a 0-d input: the same in every microbatch
    (lambda ce, count: ce / count.sum() + 1.0, (None,)),
    (lambda ce, count: ce / count.float().mean(), ()),     # over a batched input's mean: a row mean as a whole
])
def test_cross_entropy_sums_over_a_count_are_terms(loss, terms):
    from rpcompile.capture import capture_call
    from rpcompile.passes.normalize_loss import normalize_loss
    g = torch.Generator().manual_seed(0)
    count = torch.tensor(40) if terms else torch.full((6,), 40)
    cap = capture_call(_SumHead(loss), (torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g), count),
                       {}, dtype=None)
    scale = normalize_loss(cap.gm, 0).meta["rp_loss"]
    assert scale.kind == "rows" and scale.terms == terms


class _Regression(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.lin, self.loss = nn.Linear(8, 5), loss

    def forward(self, x, t, count):
        return self.loss(self.lin(x), t, count, self)


@pytest.mark.parametrize("loss,kind,terms", [
    (lambda o, t, c, m: F.mse_loss(o, t, reduction="sum"), "sum", ()),
    (lambda o, t, c, m: torch.ops.aten.mse_loss.default(o, t, 2), "sum", ()),      # aten, Reduction::Sum
    (lambda o, t, c, m: torch.ops.aten.l1_loss(o, t, reduction=2), "sum", ()),
    (lambda o, t, c, m: torch.ops.aten.mse_loss.default(o, t, 1), "rows", ()),     # Reduction::Mean
    (lambda o, t, c, m: torch.binary_cross_entropy_with_logits(o, t, None, None, 2), "sum", ()),
    (lambda o, t, c, m: (o - t).pow(2).sum(dim=(-1, 0)), "sum", ()),
    (lambda o, t, c, m: F.mse_loss(o, t, reduction="sum") / c.sum(), "rows", (None,)),   # over a 0-d input
    (lambda o, t, c, m: (o - t).abs().sum() / c.sum() + F.l1_loss(o, t), "rows", (None,)),
    (lambda o, t, c, m: m.lin.weight.pow(2).sum(), "rows", ()),                   # not batch-first
    (lambda o, t, c, m: F.mse_loss(o.mean(0), t.mean(0), reduction="sum"), "rows", ()),
    (lambda o, t, c, m: (o - t).pow(2).sum(-1).mean(), "rows", ()),              # a mean over rows
    (lambda o, t, c, m: (o - t).pow(2).sum(0).pow(2).sum(), "rows", ()),         # not a sum of sums
    (lambda o, t, c, m: torch.sqrt((o - t).pow(2).sum()), "rows", ()),           # not affine in the sum
])
def test_sums_over_rows_are_recognised_where_the_graph_says_so(loss, kind, terms):
    """Note [sums over rows]: a loss call with reduction="sum" (torch.nn.functional or aten) of
    a batch-first value, or a sum of every element of one, adds up over microbatches, alone or as
    a term of the loss; anything else stays a mean over rows."""
    from rpcompile.capture import capture_call
    from rpcompile.passes.normalize_loss import normalize_loss
    g = torch.Generator().manual_seed(0)
    cap = capture_call(_Regression(loss), (torch.randn(6, 8, generator=g), torch.rand(6, 5, generator=g),
                                           torch.tensor(40.0)), {}, dtype=None)
    scale = normalize_loss(cap.gm, 0).meta["rp_loss"]
    assert (scale.kind, scale.terms) == (kind, terms)


@pytest.mark.parametrize("items", [torch.tensor, int])
def test_a_loss_over_num_items_in_batch_adds_up_over_microbatches(items):
    """transformers' loss given num_items_in_batch (its Trainer's count of the counted tokens of
    every accumulated batch) is a token sum over that count (Note [sums over a batch count]):
    before, taken as a mean over rows, the loss and gradients were 1/M of eager's (checked)."""
    batches = [dict(_uneven(s), num_items_in_batch=items(n)) for s, n in ((0, 50), (1, 61), (2, 45))]
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT)
    cm = train_both(qwen3(layers=1), batches, cfg)
    assert cm.plan.loss_scale.kind == "rows" and cm.plan.loss_scale.terms == (None,)


def _masked_token_mean(out, labels):
    """A loss_fn: the per-token cross-entropy's mean over the counted tokens, written out."""
    per_token = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none")
    counted = labels.flatten() != -100
    return (per_token * counted).sum() / counted.sum()


class _Ratios(TwoLayers):
    """A regression whose loss is a sum over rows divided by a sum over rows of the data: a mask's
    count, floored or not, a class count of a sum cross-entropy, float weights' total."""

    def forward(self, x, y):
        h = self.hidden(x)
        per_row, picked = (h - y).pow(2).mean(-1), x[:, 0] > 0
        if self.kind == "masked":
            return (per_row * picked).sum() / picked.sum()
        if self.kind == "floored":      # (a term, its numerator scaled, beside a mean over rows; a cast)
            return 0.5 * (per_row * picked).sum() / picked.sum().clamp(min=1).type_as(h) + F.mse_loss(h, y)
        if self.kind == "counted":
            labels = torch.where(x[:, 1] > 0, (x[:, 2] > 0).long(), -100)
            return F.cross_entropy(h[:, :2], labels, reduction="sum") / (labels != -100).sum()
        if self.kind == "learned":      # (weights the parameters compute)
            weights = torch.sigmoid(h[:, 0])
            return (per_row * weights).sum() / weights.sum()
        if self.kind == "item":         # (a count read off as a number: the data decides it)
            return (per_row * picked).sum() / max(picked.sum().item(), 1)
        if self.kind == "nonzero":
            return (per_row * picked).sum() / picked.nonzero().shape[0]
        weights = torch.sigmoid(x[:, 1])
        return (per_row * weights).sum() / (weights.sum() + 1e-6)


def _row_batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(n)]


def _trains_split_as_eager(make):
    """Three SGD steps of `make()` (x: 8 rows of 8 features, y: 8 of 4) split into 2 microbatches
    over 2 CPU devices, checked against eager; the compiled model."""
    batches = _row_batches(3)
    torch.manual_seed(0)
    return train_both(make(), batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT),
                      eager_step=scalar_loss_step, steps=3, min_stages=0)


def _refused_split(make, why: str, line: str) -> None:
    """`make()`'s first step split into 2 microbatches is an InputError matching `why` that names
    `line`, before any step (parameters unchanged, no gradient); in one microbatch it trains as eager."""
    batches = _row_batches(2)
    torch.manual_seed(0)
    model = make()
    before = copy.deepcopy(model.state_dict())
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    with pytest.raises(rpcompile.InputError, match=why) as err:
        cm.train_step(**batches[0])
    assert line in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    train_both(model, batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=1), eager_step=scalar_loss_step,
               steps=2, min_stages=0)


@pytest.mark.parametrize("kind", ["masked", "floored", "counted", "weighted"])
def test_a_sum_over_a_sum_of_the_data_trains_as_eager(kind):
    """Note [sums over a sum of the data]: `(loss * mask).sum() / mask.sum()` (a masked mean
    written out), floored, a sum cross-entropy over its counted labels, a sum weighed by the data's
    weights over their total: before, each microbatch's quotient was weighed by its rows (0.793 for
    eager's 0.908 over 2 microbatches); now the quotient's numerator adds up over the microbatches
    and the divisor is the whole batch's, counted before the step."""
    scale = _trains_split_as_eager(lambda: _Ratios(kind)).plan.loss_scale
    assert scale.kind == "rows" and len(scale.terms) == 1 and scale.terms[0] is not None
    assert (scale.finishes[0] is not None) == (kind in ("floored", "weighted"))


@pytest.mark.parametrize("kind,why,line", [
    ("learned", "divides by a sum over the batch's rows that the parameters",
     "(per_row * weights).sum() / weights.sum()"),
    ("item", "computes with a number the data decides", "/ max(picked.sum().item(), 1)"),
    ("nonzero", "computes with a number the data decides", "/ picked.nonzero().shape[0]")])
def test_a_sum_over_a_sum_that_cannot_be_counted_is_refused_with_microbatches(kind, why, line):
    """Note [sums over a sum of the data]: a divisor the parameters compute cannot be counted
    before the step, nor a number read off the data (`.item()` of a count, a data-decided size,
    `nonzero().shape[0]`: both 0.793 for eager's 0.908); taken as a mean over rows they trained
    silently to another loss than eager's. Now an InputError naming the line, before any step;
    with one microbatch they train as eager."""
    _refused_split(lambda: _Ratios(kind), why, line)


class _Picked(TwoLayers):
    """Losses over the rows a mask of the data picks (Note [rows a mask picks]): sums and means,
    by the mask, at its positions (nonzero, `torch.where(mask)`), of the entries it picks; or over rows a mask the model
    computes picks, a picked mean not affine in the loss, one with keepdim."""

    def forward(self, x, y):
        h, m = self.hidden(x), x[:, 0] > 0
        at, where = m.nonzero()[:, 0], torch.where(m)[0]
        if self.kind == "sum":
            return (0.1 * ((h[m] - y[m]) ** 2).sum() + F.mse_loss(h[at], y[at], reduction="sum")
                    + (h[where] - y[where]).abs().sum())
        if self.kind == "selected":
            return 0.1 * torch.masked_select(h - y, m[:, None]).pow(2).sum()
        if self.kind == "mse":
            return F.mse_loss(h[m], y[m])
        if self.kind == "mean":
            return (((h[at] - y[at]) ** 2).mean() + torch.masked_select(h - y, m[:, None]).abs().mean()
                    + F.l1_loss(h[where], y[where]))
        if self.kind == "entries":          # (a mask of (row, entry) pairs: 2 of each row's 4)
            mm = x[:, :2] > 0
            return F.l1_loss(h.view(-1, 2, 2)[mm], y.view(-1, 2, 2)[mm])
        if self.kind == "affine":
            return (F.mse_loss(h[at], y[at]) + 0.5 * F.smooth_l1_loss(h[at], y[at]) + 0.1 * F.mse_loss(h, y)
                    + 0.01 * (h[at] ** 2).sum() + (h[m] ** 2).sum() / m.sum().clamp(min=1))
        if self.kind == "batchmean":        # (distillation over picked rows: KL's mean over dim 0)
            lp, q = F.log_softmax(h, -1), F.softmax(y, -1)
            return (F.kl_div(lp[m], q[m], reduction="batchmean") + F.kl_div(lp[at], q[at], reduction="batchmean")
                    + F.kl_div(torch.masked_select(lp, m[:, None]), torch.masked_select(q, m[:, None]),
                               reduction="batchmean"))
        if self.kind == "rowmean":          # (a mean over the picks of each feature's error, summed)
            return ((h[m] - y[m]) ** 2).mean(0).sum() + 0.5 * torch.sum(torch.mean(h[at].abs(), dim=-2))
        if self.kind == "learned":
            at = (h[:, 0] > 0).nonzero()[:, 0]
            return F.mse_loss(h[at], y[at])
        if self.kind == "keepdim":
            return ((h[m] - y[m]) ** 2).mean((0, 1), keepdim=True).squeeze()
        return F.mse_loss(h[m], y[m]).sqrt()


@pytest.mark.parametrize("kind", ["sum", "selected", "mse", "mean", "entries", "affine", "batchmean", "rowmean"])
def test_a_loss_over_the_rows_a_mask_picks_trains_as_eager(kind):
    """Note [rows a mask picks]: a sum over the rows a mask picks (`((h[m] - y[m]) ** 2).sum()`,
    at its positions, `torch.masked_select`) was taken as a mean over rows, the loss and
    gradients half of eager's over 2 microbatches; a mean over them (`F.mse_loss(h[m], y[m])`,
    `.mean()`, l1, a mask of entries) each microbatch's own mean weighed by its rows (0.793 for
    eager's 0.908, gradients 0.47 of the largest off), silently. Now sums add up and means divide
    by the whole batch's picks, counted before the step; so do a KL divergence's batchmean over
    picked rows and `x.mean(0).sum()` (refused before)."""
    cm = _trains_split_as_eager(lambda: _Picked(kind))
    counted = [t for t in cm.plan.loss_scale.terms if t is not None]     # (a sum's term is not counted)
    assert bool(counted) == (kind not in ("sum", "selected"))


@pytest.mark.parametrize("kind,line", [("learned", "F.mse_loss(h[at], y[at])"),
                                       ("sqrt", "F.mse_loss(h[m], y[m]).sqrt()"),
                                       ("keepdim", ".mean((0, 1), keepdim=True)")])
def test_a_mean_over_picked_rows_that_cannot_be_counted_is_refused_with_microbatches(kind, line):
    """Note [rows a mask picks]: a mean over the rows a mask the model computes picks (which
    cannot be counted before the step), one the loss is not affine in, or one kept 2-d
    (keepdim), is an InputError naming the line before any step; with one microbatch it trains
    as eager."""
    _refused_split(lambda: _Picked(kind), "a mean over rows a mask picks", line)


def test_a_masked_token_mean_written_out_trains_on_the_whole_batchs_token_mean():
    """A loss_fn's cross-entropy per token, its mean over the counted tokens written out (Note
    [sums over a sum of the data]): the whole batch's, as eager's, with labels ignored unevenly."""
    def eager(m, b):
        loss = _masked_token_mean(m(input_ids=b["input_ids"]), b["labels"])
        loss.backward()
        return loss

    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, loss_fn=_masked_token_mean)
    train_both(qwen3(layers=1), [_uneven(s) for s in range(3)], cfg, eager_step=eager,
               call=lambda cm, b: cm.train_step(input_ids=b["input_ids"], target=b["labels"]))


class _UncertaintyWeighted(nn.Module):
    """A Qwen3 whose loss is its cross-entropy weighed by a buffer and a learned log-variance
    (Kendall et al.'s uncertainty weighting): affine in the cross-entropy, with a coefficient the
    same in every microbatch."""

    def __init__(self):
        super().__init__()
        self.lm = qwen3(layers=1)
        self.log_var = nn.Parameter(torch.tensor(0.3))
        self.register_buffer("weight", torch.tensor(1.5))

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids=input_ids).logits
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return ce * self.weight * torch.exp(-self.log_var) + self.log_var / 2


def test_a_loss_weighed_by_parameters_trains_on_the_whole_batchs_cross_entropy():
    """Before, a product with anything but a number made the loss a mean over rows as a whole:
    with these labels the first step's loss was 2.3e-4 off eager's (checked)."""
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT)
    cm = train_both(_UncertaintyWeighted(), [_uneven(s) for s in range(3)], cfg, eager_step=scalar_loss_step)
    assert [n.name for n in cm.plan.gm.graph.nodes if n.meta.get("rp_kind") == "loss_scale"] == ["loss_scale_0"]


def _qwen3_moe(coef):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=coef))


@pytest.mark.parametrize("items", [None, 40])
def test_an_moe_with_its_load_balancing_loss_trains_on_the_whole_batchs_cross_entropy(items):
    """Qwen3-MoE with output_router_logits (loss = cross-entropy + coef * load-balancing loss),
    never run eagerly: captured (it failed in transformers' hook lock before), its cross-entropy
    the batch's token mean, its load-balancing loss each microbatch's, weighed by rows (the
    expert fractions are a microbatch's, as under gradient accumulation). Loss, the call's
    aux_loss and gradients as eager computes exactly that. With num_items_in_batch the
    cross-entropy is a token sum over it (Note [sums over a batch count])."""
    coef = 0.1
    model = _qwen3_moe(coef)
    ref = copy.deepcopy(model)
    b = _uneven(0)
    if items is not None:
        b["num_items_in_batch"] = torch.tensor(items)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    loss = cm.train_step(**b)
    out = ref(**b)
    halves = [ref(input_ids=b["input_ids"][i:i + 2], labels=b["labels"][i:i + 2]).aux_loss for i in (0, 2)]
    aux = (halves[0] + halves[1]) / 2
    expected = out.loss - coef * out.aux_loss + coef * aux
    expected.backward()
    close(loss.detach(), expected.detach(), 1e-5, 1e-6, "loss")
    check_grads(model, ref, 1e-4)
    assert not torch.allclose(out.aux_loss, aux, rtol=1e-5)   # (the batch's own differs: the check below tells)
    with torch.no_grad():
        called = cm(**b)
    close(called.loss, expected.detach(), 1e-5, 1e-6, "the call's loss")
    close(called.aux_loss, aux.detach(), 1e-5, 1e-6, "the call's aux_loss")


def test_a_calls_router_logits_are_every_microbatchs():
    """The router logits (rows * seq, experts) per layer: every microbatch's rows, in order (the
    first microbatch's alone before), and a gradient through them reaches each microbatch."""
    model = _qwen3_moe(0.0)
    ref = copy.deepcopy(model)
    b = _uneven(1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    out, want = cm(**b), ref(**b)
    assert len(out.router_logits) == len(want.router_logits) == 2
    weights = torch.randn(want.router_logits[0].shape, generator=torch.Generator().manual_seed(0))
    for got, exp in zip(out.router_logits, want.router_logits):
        close(got.detach(), exp.detach(), 1e-5, 1e-6, "router logits")
    (out.router_logits[1] * weights).sum().backward()
    (want.router_logits[1] * weights).sum().backward()
    check_grads(model, ref, 1e-4)


def _regression_call(g, count):
    return (torch.randn(6, 8, generator=g), torch.rand(6, 5, generator=g), count), {}


def _qwen3_call(g, count):
    """transformers' loss given an int num_items_in_batch (its Trainer's count before 5.x)."""
    return (), dict(_uneven(int(torch.randint(0, 99, (), generator=g))), num_items_in_batch=count)


@pytest.mark.parametrize("model,call", [
    (lambda: _Regression(lambda o, t, c, m: F.mse_loss(o, t, reduction="sum") / c), _regression_call),
    (lambda: qwen3(layers=1), _qwen3_call)], ids=["mse_sum", "qwen3_num_items"])
def test_a_sum_over_an_int_argument_through_the_backend_adds_up_over_microbatches(model, call):
    """torch.compile(backend=rpcompile.backend(...), dynamic=True) makes an int argument a size
    placeholder, passed whole to every microbatch as a number is. Before, a sum over rows divided
    by it was taken as a mean over rows: loss and gradients 1/2 of eager's over 2 microbatches
    (checked, both models), with the count equal to the batch size or not."""
    torch._dynamo.reset()
    model = model()
    ref = copy.deepcopy(model)
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2)
    compiled = torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)
    g = torch.Generator().manual_seed(0)
    for count in (6, 40, 17):
        args, kwargs = call(g, count)
        loss = compiled(*args, **kwargs)
        loss = getattr(loss, "loss", loss)
        loss.backward()
        expected = ref(*args, **kwargs)
        expected = getattr(expected, "loss", expected)
        expected.backward()
        close(loss, expected, 1e-5, 0.0, f"loss, count {count}")
        check_grads(model, ref)
