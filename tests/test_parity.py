"""Training parity with eager PyTorch (fp32, CPU): loss, gradients, parameters after SGD with momentum
(and one AdamW check whose tolerance allows for its amplification of gradient noise)."""
import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rpcompile
from rpcompile.runtime import timeline

from models import MLP, SharedWeights, WithBatchNorm, llama, lm_batch, qwen3
from parity import TIGHT, check_grads, scalar_loss_step, train_both, xy_batches


def mse_batches(n=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(n, 8, generator=g), "target": torch.randn(n, 4, generator=g)} for _ in range(3)]


def mse_eager(m, b):
    loss = F.mse_loss(m(b["x"]), b["target"])
    loss.backward()
    return loss


def mse_eager_microbatched(m, b, microbatches):
    """mse_eager over the batch's microbatches one at a time (gradient accumulation), as a model
    whose buffers each forward updates sees them."""
    total = 0.0
    for x, y in zip(torch.tensor_split(b["x"], microbatches), torch.tensor_split(b["target"], microbatches)):
        loss = F.mse_loss(m(x), y) * (x.shape[0] / b["x"].shape[0])
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_mlp_parity(devices, microbatches):
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, loss_fn=F.mse_loss,
                           memory_budget=TIGHT)
    train_both(MLP(), mse_batches(), cfg, eager_step=mse_eager,
               call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))


@pytest.mark.parametrize("make,tied,devices,microbatches", [
    (qwen3, True, 3, 4),
    (qwen3, True, 1, 1),
    (qwen3, False, 2, 3),
    (llama, True, 2, 4),
])
def test_decoder_parity(make, tied, devices, microbatches):
    """Tiny transformers decoders, labels with -100 spread unevenly, batch of 5. (Untied llama on
    3 devices and 3 microbatches is test_decoder_parity_adamw's: the same loss and gradient
    checks, its parameters after AdamW steps.)"""
    cfg = rpcompile.Config(devices=["cpu"] * devices, num_microbatches=microbatches, memory_budget=TIGHT)
    batches = [lm_batch(seed=s) for s in range(3)]
    train_both(make(tied=tied), batches, cfg)


def test_decoder_parity_adamw():
    """AdamW steps turn the summation-order noise of a near-zero gradient (~1e-9) into a step of
    up to lr in either direction; a wrong gradient moves whole rows by about lr per step. With
    lr=1e-3 and 3 steps, 1e-4 tells the two apart (measured noise: ~4e-6)."""
    cfg = rpcompile.Config(devices=["cpu"] * 3, num_microbatches=3, memory_budget=TIGHT)
    batches = [lm_batch(seed=s) for s in range(3)]
    train_both(llama(tied=False), batches, cfg, optimizer="adamw", lr=1e-3, param_atol=1e-4)


def test_whole_batch_loss_not_mean_of_microbatch_means():
    """Microbatches with very different counts of counted tokens: the loss is the batch's."""
    model = qwen3(layers=1)
    batch = lm_batch(batch=4)
    batch["labels"][:2] = -100
    batch["labels"][0, 3] = batch["input_ids"][0, 3]   # microbatch 0 counts one token
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    loss = cm.train_step(**batch)
    expected = model(**batch).loss
    assert torch.allclose(loss, expected, rtol=1e-5)
    halves = [model(input_ids=batch["input_ids"][i:i + 2], labels=batch["labels"][i:i + 2]).loss for i in (0, 2)]
    assert not torch.allclose(loss, sum(halves) / 2, rtol=1e-3)


def test_shared_parameter_in_distant_places():
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, memory_budget=TIGHT)
    batches = xy_batches(7, 16, seed=0)

    cm = train_both(SharedWeights(), batches, cfg, eager_step=scalar_loss_step, call=lambda cm, b: cm.train_step(**b))
    stages_using = [st.index for st in cm.plan.stages if st.kind == "bwd" and 0 in st.params]
    assert cm.plan.stages and stages_using, "the shared weight should appear in a backward stage"


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_batchnorm_buffers(workers):
    """Running statistics update once per microbatch (never again in recompute), as eager
    gradient accumulation over the same microbatches does; worker processes send back the
    buffers a job's stage updates (batch norm's kernels do not bump version counters)."""
    M = 3
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=M, loss_fn=F.mse_loss, memory_budget=TIGHT,
                           workers=workers)
    batches = mse_batches(n=9)
    train_both(WithBatchNorm(), batches, cfg, eager_step=lambda m, b: mse_eager_microbatched(m, b, M),
               call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))


def test_differentiable_call_matches_eager_and_a_no_grad_call_returns_outputs():
    """cm(...) trains like eager through out.loss.backward(); under torch.no_grad the same
    compiled model returns the eager outputs (and no gradient reaches a parameter)."""
    model = qwen3(tied=False)
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=TIGHT)

    def via_call(cm, b):
        out = cm(**b)
        out.loss.backward()
        return out.loss

    cm = train_both(model, [lm_batch(seed=s) for s in range(3)], cfg, call=via_call)
    out = cm(**lm_batch())
    assert out.logits.shape == (5, 12, 128)

    model.zero_grad(set_to_none=True)
    b = lm_batch(seed=4)
    with torch.no_grad():
        out = cm(**b)
        ref = model(**b)
    assert not out.loss.requires_grad and not out.logits.requires_grad
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("devices,data_parallel", [(["cpu"], None), (["cpu", "cpu"], True)],
                         ids=["one-device", "replicas"])
def test_differentiable_call_where_jobs_hand_over_on_the_device(devices, data_parallel):
    """cm(...).loss.backward() where each job hands its outputs to the next on its own device
    (one device; copies of the chain, Note [replicas]): the call's backward reads the
    forward's boundaries from the host (its backward failed with a KeyError: the forward's
    schedule had not counted the backward's reads)."""
    cfg = rpcompile.Config(devices=devices, num_microbatches=2, memory_budget=TIGHT, data_parallel=data_parallel)

    def via_call(cm, b):
        out = cm(**b)
        out.loss.backward()
        return out.loss

    cm = train_both(qwen3(tied=False), [lm_batch(seed=s) for s in range(2)], cfg, call=via_call, steps=2)
    assert cm.plan.replicas == (2 if data_parallel else 1)


def test_a_call_never_differentiated_frees_its_step():
    """A differentiable call's outputs dropped without a backward free its step (activations
    and all) at once: the step held its outputs, whose autograd node holds the step, a cycle
    through autograd's C++ that not even the collector frees (it kept every such step)."""
    import gc

    from rpcompile.runtime.job import StepState

    def steps_alive():
        return {id(o) for o in gc.get_objects() if type(o) is StepState}

    cm = rpcompile.compile(qwen3(tied=False, layers=1),
                           rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="300KiB"))
    cm(**lm_batch(seed=0)).loss.backward()      # (the first call compiles)
    before = steps_alive()
    gc.disable()
    try:
        out = cm(**lm_batch(seed=1))
        assert out.logits.requires_grad and len(steps_alive() - before) == 1
        del out
        left = len(steps_alive() - before)
    finally:
        gc.enable()
    timeline.collect()       # (Note [a collection of its own])
    assert left == 0 and len(steps_alive() - before) == 0


def test_torch_compile_backend_string_and_config():
    """backend="rpcompile" (entry point) and backend=rpcompile.backend(cfg): loss.backward, opt.step."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget="300KiB")
    configured = rpcompile.backend(cfg)
    for backend in ("rpcompile", configured):
        torch._dynamo.reset()
        model = qwen3(tied=False, layers=1)    # (1 layer: dynamo traces each backend's graph in 2/3 the time of 2)
        compiled = torch.compile(model, backend=backend, dynamic=True)

        def via_compile(cm, b, compiled=compiled):
            out = compiled(**b)
            out.loss.backward()
            return out.loss

        train_both(model, [lm_batch(seed=s) for s in range(3)], rpcompile.Config(), call=via_compile, min_stages=0)
    assert configured.plans and len(configured.plans[-1].stages) >= 2


def _train_through_backend(model, batches, microbatches, eager_step=None, steps=3, **config):
    """Train `model` through torch.compile(backend=rpcompile.backend(...), dynamic=True) on two
    CPU devices beside eager (train_both); the backend, whose plans are every graph it was given.
    config: more Config fields."""
    torch._dynamo.reset()
    backend = rpcompile.backend(rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=microbatches, **config))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    backend.compiled = compiled

    def via_compile(cm, b):
        out = compiled(**b)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        return loss

    train_both(model, batches, rpcompile.Config(), call=via_compile, eager_step=eager_step, min_stages=0, steps=steps)
    return backend


class BreakAfterSize(nn.Module):
    """A forward that reads a size, breaks its graph (a print or a call dynamo cannot trace), then
    uses the size; its loss a sum over rows."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        n = h.shape[0]
        torch._dynamo.graph_break()
        return ((self.b(h) - y).pow(2) * n).sum()


def test_a_size_returned_before_a_graph_break_and_a_sum_over_rows_through_the_backend():
    """torch.compile(backend=rpcompile.backend(cfg), dynamic=True) of a forward whose graph breaks
    after reading a size: dynamo hands the size out of the first graph, which the backend refused
    (Note [sizes a graph returns] in rpcompile/backend.py); and the second graph's loss, a sum
    over rows, was weighed as a mean over rows (half of eager's loss and gradients at 2
    microbatches). Uneven microbatches (5 rows over 2)."""
    backend = _train_through_backend(BreakAfterSize(), xy_batches(5, 8), 2, eager_step=scalar_loss_step)
    assert len(backend.plans) == 2 and all(p.num_microbatches == 2 for p in backend.plans)


class WithTotals(nn.Module):
    """Outputs beside the loss that are not batch-first: sums, means, maxima and minima over the
    rows (Note [outputs over rows]), scaled, negated or added, and two computed from no row: a
    parameter's, and one from a size of the batch (refused while the rule followed sizes too)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x)
        return {"loss": F.mse_loss(h, y), "total": h.abs().sum(), "mean": h.abs().mean(),
                "scaled": h.abs().sum() / 4, "half": 0.5 * h.sum(), "negated": -h.sum(),
                "both": h.abs().sum() - 2 * h.pow(2).sum(), "column_sums": h.sum(0),
                "column_means": 2 * h.mean(0), "both_means": h.mean(0) + h.pow(2).mean((0, 1)),
                "weights": self.lin.weight.sum(0), "positions": torch.arange(x.shape[1], dtype=x.dtype) * 2,
                "peak": h.max(), "column_peaks": h.amax(0), "column_lows": -2 * h.amin(0)}


def test_a_calls_outputs_that_sum_or_average_over_rows_are_the_whole_batchs():
    """A call's output other than the loss that sums over the rows (a total) adds up over the
    microbatches, one that averages over them is weighted by rows, a max or min over them is the
    largest or smallest, and so does each scaled, negated or added (Note [outputs over rows]);
    their gradients reach every microbatch's rows. Before, a 0-d total alone added up: `-h.sum()`,
    `h.sum() / 4` and `h.max()` were taken as means over rows, and `h.sum(0)`, `h.mean(0)`,
    `h.amax(0)` came back as the first microbatch's, their gradients that microbatch's alone
    (checked)."""
    model = WithTotals()
    ref = copy.deepcopy(model)
    batch = xy_batches(5, 8, steps=1)[0]
    out = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))(**batch)
    expected = ref(**batch)
    for k in expected:
        torch.testing.assert_close(out[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    g = torch.Generator().manual_seed(3)
    seeds = {k: torch.randn(v.shape, generator=g) for k, v in expected.items()}
    sum((out[k] * seeds[k]).sum() for k in out).backward()
    sum((expected[k] * seeds[k]).sum() for k in expected).backward()
    check_grads(model, ref)


def test_an_output_over_the_rows_that_is_neither_a_sum_nor_a_mean_is_an_error():
    """`h.T @ h` of a call split into microbatches came back as the first microbatch's value
    (silently), as `h.amax(0)` did; it is a CaptureError that says what to do, and with one
    microbatch it is eager's."""
    class Gram(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h.T @ h

    model, x = Gram(), torch.randn(5, 8)
    with pytest.raises(rpcompile.CaptureError, match=r"not row by row.*batch-first.*num_microbatches=1"):
        rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))(x)
    out = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1))(x)
    torch.testing.assert_close(out, model(x))


def test_a_0d_output_of_no_kind_over_the_rows_is_said_to_be_its_microbatches_mean():
    """A 0-d call output that reads the batch but is no sum, mean, max or min over its rows
    (`h.sum() + 1`, a router's auxiliary loss) cannot be put together from microbatches: it came
    back as their values' mean (weighted by rows), silently. The call says so (which outputs, what
    to do), the value is that mean, an output of a known kind beside it is eager's, and with one microbatch each
    is eager's without a word."""
    class Stats(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h.sum() + 1, h.sum(), h.pow(2).sum().sqrt()

    torch.manual_seed(0)
    model, x = Stats(), torch.randn(6, 4)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    with torch.no_grad(), pytest.warns(UserWarning, match=r"outputs 0, 2 .*microbatches' values averaged.*"
                                                          r"num_microbatches=1") as said:
        out = cm(x)
        halves = [model(part) for part in x.split(3)]
        whole = model(x)
    assert len([w for w in said if "microbatches' values" in str(w.message)]) == 1
    for i in (0, 2):
        torch.testing.assert_close(out[i], (halves[0][i] + halves[1][i]) / 2)
        assert not torch.allclose(out[i], whole[i])
    torch.testing.assert_close(out[1], whole[1])
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for got, expected in zip(cm(x), whole):
            torch.testing.assert_close(got, expected)


class WritesItsInput(nn.Module):
    """Doubles its batched input in place (`x.mul_(2)`, an input that needs no gradient), reads it
    through four layers and, with late_read, once more after the second."""

    def __init__(self, late_read):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.late_read = late_read

    def forward(self, x, y):
        x.mul_(2)
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if self.late_read and i == 1:
                h = h + x
        return F.mse_loss(h, y)


@pytest.mark.parametrize("late_read", [False, True])
def test_a_batched_input_written_in_place_trains_as_eager(late_read):
    """On CPU devices a job was given the caller's tensor itself: the forward job doubled it and
    the backward job's recompute doubled it again (the first layer's weight gradient twice
    eager's, silently). Each stage now writes a copy, and reads after the write stay in its
    stage (Note [inputs written in place] in rpcompile/passes/codegen.py). The caller's tensor
    is left as it was passed, where eager writes it, and the first call says so, naming the
    argument (it was silent)."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=TIGHT)
    batches = xy_batches(6, 32)
    given = [b["x"].clone() for b in batches]
    with pytest.warns(UserWarning, match=r"writes into its argument x in place: .*leaves your tensor as you passed "
                                         r"it, where eager PyTorch changes it"):
        train_both(WritesItsInput(late_read), batches, cfg, eager_step=scalar_loss_step)
    # (eager doubled each batch's x once, in train_both's eager step; rpcompile wrote none of them)
    assert all(torch.equal(b["x"], 2 * x) for b, x in zip(batches, given))


class DoublesItsInput(nn.Module):
    """Eight layers between a write into the input and its last read (`h + x`)."""

    def __init__(self, in_place):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.in_place = in_place

    def forward(self, x, y):
        if self.in_place:
            x.mul_(2)
        else:
            x = x * 2
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(h + x, y)


def test_an_input_written_in_place_and_read_far_after_says_why_the_plan_cannot_cut_there():
    """Note [inputs written in place]: every read of an input after a write into it is in the
    writing stage, here all eight layers: at a budget the same model without the write plans in
    stage jobs, the PlanningError says which argument holds which nodes in one stage and how to let
    the plan cut (it spoke only of memory)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=100_000)
    cm = rpcompile.compile(DoublesItsInput(in_place=False), cfg)
    cm.train_step(x.clone(), y)
    assert len(cm.plan.stages) > 2
    cm = rpcompile.compile(DoublesItsInput(in_place=True), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (the capture's word on the write: the test above)
        with pytest.raises(rpcompile.PlanningError, match=r"writes into its arguments in place and reads them far "
                                                          r"from the write: args\[0\] \(written at node 0, read up to "
                                                          r"node \d+ of \d+\)\..*x = x \* 2, not x\.mul_\(2\)"):
            cm.train_step(x.clone(), y)


class AddsToItsLoss(nn.Module):
    """A loss computed before a graph break, then added to in place (`loss += ...`, as
    transformers 5.17's MoE adds its load-balancing loss)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.a(x)
        loss = F.mse_loss(self.b(torch.tanh(h)), y)
        torch._dynamo.graph_break()
        loss += 0.1 * h.pow(2).mean()
        return loss


def test_a_value_written_in_place_after_a_graph_break_trains_as_eager():
    """The second graph writes into its input, the first graph's loss: a backward job recomputes
    from a leaf of it, and the in-place add on a leaf that requires grad failed (a StageError);
    Note [inputs written in place] in rpcompile/passes/codegen.py. That input is the model's own
    value, which the graph returns as written: nothing is said of it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_through_backend(AddsToItsLoss(), xy_batches(5, 8), 2, eager_step=scalar_loss_step)
    assert not [w for w in caught if "in place" in str(w.message)]


def _moe_with_aux_loss():
    from zoo import qwen3_moe
    model = qwen3_moe()
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    return model


@pytest.mark.parametrize("make", ["gpt2", "moe_aux_loss", "loop_moe", "ctrl", "phi3_longrope"])
def test_transformers_models_through_the_backend_train_as_eager(make):
    """torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True), each model's graphs
    broken where dynamo breaks them, uneven microbatches (5 rows over 3) with ignored labels:
    - GPT-2's loss graph takes ignore_index=-100 as an input: its cross-entropy was not found,
      its microbatches weighed by rows (a loss 0.005 off): Note [numbers dynamo passes];
    - an MoE's `ce + coef * aux` loss, 0.016 off, weighed by rows (flat_loss_output), and its
      second graph's hidden states, an attribute of the first's output, taken as module state and
      left whole (a StageError);
    - a loop over experts compiled frame by frame: one graph for every expert, which read the first
      expert's weights for all (0.04 off): Note [graphs shared by modules];
    - CTRL assigns a buffer an output of the call, whose grad_fn the next step's backward reached
      (AttributeError on a spent step): outputs that need no gradient are not differentiable;
    - Phi-3's longrope: a size of a config float failed in planning (Note [float sizes]), and the
      frequency update's graph, frequencies beside the buffer they go to, was split as a batch."""
    from zoo import BY_NAME, lm_batch
    build = _moe_with_aux_loss if make == "moe_aux_loss" else BY_NAME[make].build
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = _train_through_backend(build(), [lm_batch(seed=s) for s in range(2)], 3, steps=2,
                                         eager_step=scalar_loss_step if make == "loop_moe" else None)
    assert len(backend.plans) >= 2
    # (a graph with no batch, as longrope's frequency update, runs whole without a word)
    assert not [w for w in caught if "batch" in str(w.message) and "rpcompile" in str(w.message)]


def test_a_call_through_the_backend_runs_the_losss_backward_ahead():
    """Note [the loss's backward ahead through the backend]: a call under autograd runs the loss's
    stage job forward and backward (its forward run ends in FB), and `loss.backward()` runs the
    other backward jobs only; under torch.no_grad() that job runs forward only. Gradients and the
    parameters after SGD steps equal eager's (train_both), and so do the gradients of one more call."""
    model = qwen3()
    ref = copy.deepcopy(model)
    backend = _train_through_backend(model, [lm_batch(seed=s) for s in range(2)], 2, steps=2, memory_budget=250_000)
    (plan,) = backend.plans
    fused = next(st.index for st in plan.stages if st.kind == "fused")
    executor = backend.runner.executor
    with torch.no_grad():
        backend.compiled(**lm_batch(seed=5))
    assert str(executor.last_schedule).split()[-1].startswith(f"{fused}F@"), executor.last_schedule
    model.zero_grad(set_to_none=True)
    ref.load_state_dict(model.state_dict())
    out = backend.compiled(**lm_batch(seed=6))
    forward = str(executor.last_schedule).split()
    out.loss.backward()
    backward = str(executor.last_schedule).split()
    assert forward[-1].startswith(f"{fused}FB@") and not any(a.startswith(f"{fused}B@") for a in backward), \
        (forward, backward)
    ref(**lm_batch(seed=6)).loss.backward()
    check_grads(model, ref)


@pytest.mark.parametrize("dtype, model_dtype, says", [(torch.bfloat16, torch.float32, True),
                                                      (None, torch.float32, False),
                                                      (torch.bfloat16, torch.bfloat16, False)])
def test_the_backend_says_once_that_a_compute_dtype_does_not_apply(dtype, model_dtype, says):
    """Note [the backend's dtype]: a graph dynamo traced in float32 runs in float32 whatever
    Config.dtype asks (bf16 on GPUs by default); the backend says so once, naming both dtypes
    and rpcompile.compile, and runs the graph as eager does. Nothing where they agree."""
    model = MLP().to(model_dtype)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rpcompile.backend(rpcompile.Config(devices=["cpu"], dtype=dtype)))
    x, y = torch.randn(4, 8, dtype=model_dtype), torch.randn(4, 4, dtype=model_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [compiled(x * k) for k in (1, 2)]
    said = [str(w.message) for w in caught if "rpcompile.backend" in str(w.message)]
    assert len(said) == int(says), said
    if says:
        assert "runs in float32" in said[0] and "compute dtype bfloat16" in said[0] and "rpcompile.compile" in said[0]
    for k, out in zip((1, 2), outs):
        assert out.dtype == model_dtype
        torch.testing.assert_close(out, ref(x * k))
    F.mse_loss(outs[0], y).backward()
    F.mse_loss(ref(x), y).backward()
    check_grads(model, ref)


def test_module_floats_through_the_backend_are_constants_of_the_plan():
    """Note [module floats]: under dynamic=True dynamo passed Qwen3's attention dropout (0.0) to
    SDPA as an `.item()` of a 0-d tensor, so every stage job with attention was taken as random
    (eager, RNG replayed) and every epsilon and scale `.item()` broke the Inductor pieces. The plan
    now reads them as numbers: no stage random, no `.item()` left, trains as eager; an epsilon
    changed later (dynamo does not guard it) gets a plan of its own with eager's loss; a dropout
    set in train mode (dynamo guards it: a new graph) makes the attention's stage jobs random. (On
    CPU with compile_stages=True, 3 layers: 7 graph breaks and 5 of 10 stage jobs random before, none now.)"""
    from models import lm_batch
    model = qwen3()
    batches = [lm_batch()]
    backend = _train_through_backend(model, batches, 2, steps=1, memory_budget=250_000)
    (plan,) = backend.plans
    assert len(plan.stages) >= 2 and not any(st.random for st in plan.stages)
    assert "zf" not in str(plan), "no float symbol is a size the plan was costed at"
    graphs = [g for st in plan.stages for prog in st.programs.values() for g in prog.modules()
              if isinstance(g, torch.fx.GraphModule)]
    assert graphs and not [n for g in graphs for n in g.graph.nodes if n.target == "item"]

    ref = copy.deepcopy(model)
    before = backend.compiled(**batches[0]).loss
    for m in (model, ref):
        for norm in (mod for mod in m.modules() if hasattr(mod, "variance_epsilon")):
            norm.variance_epsilon = 0.5
    loss, expected = backend.compiled(**batches[0]).loss, ref(**batches[0]).loss
    assert len(backend.plans) == 2, "a plan for the new epsilon"
    assert not torch.allclose(loss, before, rtol=1e-4) and torch.allclose(loss, expected, rtol=1e-5)

    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    backend.compiled(**batches[0]).loss.backward()
    assert len(backend.plans) == 3 and any(st.random for st in backend.plans[-1].stages)


def test_eight_cpu_devices():
    """The runtime and the rotation work for any device count (8, as the 8-GPU machines have)."""
    cfg = rpcompile.Config(devices=["cpu"] * 8, num_microbatches=9, memory_budget=TIGHT)
    cm = train_both(qwen3(layers=3), [lm_batch(batch=9, seed=s) for s in range(3)], cfg, min_stages=4)
    used = {d for _, _, _, d in cm.last_placements}
    assert len(used) == min(8, len(cm.plan.stages))


def test_bf16_working_copies_on_cpu_devices():
    """Config(dtype=bf16): weights and float inputs are cast on the devices, masters stay fp32,
    and training tracks eager bf16 (the dtype the model code was traced in)."""
    model = qwen3(tied=False)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   dtype=torch.bfloat16, memory_budget="300KiB"))
    batch = lm_batch()
    loss = cm.train_step(**batch)
    loss_ref = ref(**batch).loss
    loss_ref.backward()
    assert len(cm.plan.stages) >= 3
    assert abs(loss.item() - loss_ref.item()) < 2e-2 * abs(loss_ref.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        rel = (p.grad - q.grad.float()).norm() / q.grad.float().norm()
        assert rel < 5e-2, f"{name}: relative gradient error {rel:.3g}"


def test_batch_smaller_than_microbatches():
    """A batch of 2 rows with num_microbatches=4 runs as 2 microbatches of one row."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4, loss_fn=F.mse_loss, memory_budget=TIGHT)
    train_both(MLP(), mse_batches(n=2), cfg, eager_step=mse_eager,
               call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))


def test_freezing_parameters_replans():
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    cm.train_step(**lm_batch())
    model.zero_grad()
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    cm.train_step(**lm_batch())
    assert all(p.grad is None for p in model.model.layers[0].parameters())
    assert all(p.grad is not None for p in model.model.layers[1].parameters())


class ViewTally(nn.Module):
    """A buffer updated in place through a view of it (`tally[1:].add_`), beside one only read."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("tally", torch.zeros(2))
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        self.tally[1:].add_(x.detach().sum())
        return self.out(torch.tanh(self.inp(x)) * self.scale)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_buffer_updated_through_a_view_is_written_back(workers):
    """Note [buffers written back]: the runtime copies back only the buffers the plan finds
    updated in place, so a buffer written through a view of it must be found (its storage is
    the view's): the tally after the steps is eager's, and the buffer only read is not in the plan."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, loss_fn=F.mse_loss, memory_budget=TIGHT,
                           workers=workers)
    model = ViewTally()
    cm = train_both(model, mse_batches(n=9), cfg, eager_step=lambda m, b: mse_eager_microbatched(m, b, 3), min_stages=0,
                    call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))
    assert model.tally[1] != 0
    names = [n for n, _ in model.named_buffers()]
    assert [names[i] for i in cm.plan.mutated_buffers] == ["tally"]


class EmaScale(nn.Module):
    """A buffer updated in place and then read by the same forward (an EMA normaliser, as
    spectral_norm's u): its value at a microbatch's start decides that microbatch's gradients;
    `far` puts the read two layers after the update."""

    def __init__(self, far=False):
        super().__init__()
        self.far = far
        self.inp, self.mid, self.mid2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("ema", torch.ones(16))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.ema.mul_(0.5).add_(h.detach().pow(2).mean(0))
        if not self.far:
            h = h / self.ema
        h = torch.tanh(self.mid2(torch.tanh(self.mid(h))))
        return self.out(h / self.ema if self.far else h)


def buffer_updated_then_read_run(workers, far, devices=("cpu", "cpu"), **config):
    """EmaScale trained by train_both (loss, gradients every step, parameters); the compiled model.
    (benchmarks/gpu_check.py runs it on a GPU.)"""
    cfg = rpcompile.Config(devices=list(devices), num_microbatches=3, loss_fn=F.mse_loss, memory_budget=TIGHT,
                           workers=workers, **config)
    return train_both(EmaScale(far), mse_batches(n=9), cfg, eager_step=lambda m, b: mse_eager_microbatched(m, b, 3),
                      min_stages=0, check_every_step=True, call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))


@pytest.mark.parametrize("workers, far", [("threads", False), ("processes", False), ("threads", True)])
def test_a_buffer_updated_then_read_gets_eager_gradients(workers, far):
    """Note [buffer values a recompute starts from] (runtime/job.py): a backward job's recompute
    started from the host buffer after every microbatch's forward (0.56 of the largest gradient
    off), and its microbatches each updated that copy again. And a read far from the update
    (`far`) may not be cut from it (Note [a buffer updated in place stays in one stage])."""
    cm = buffer_updated_then_read_run(workers, far)
    kinds = [st.kind for st in cm.plan.stages]
    assert "bwd" in kinds and "fwd" in kinds, kinds
    reading = [st.index for st in cm.plan.stages if st.kind == "fwd" and st.buffers]
    assert len(reading) == 1, "the update and every read in one forward stage"
    assert cm.plan.buffers_at_start == [0]


def test_a_buffer_updated_then_read_gets_eager_gradients_through_a_call():
    """The same through a differentiable call (its backward jobs run later, as a run of their
    own): against eager's microbatches, each forward followed by its backward."""
    for far in (False, True):
        model = EmaScale(far)
        ref = copy.deepcopy(model)
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, memory_budget=9000))
        b = mse_batches(n=9)[0]
        out = cm(b["x"])
        F.mse_loss(out, b["target"]).backward()
        assert [st.kind for st in cm.plan.stages].count("bwd") >= 1
        outs = []
        for x, y in zip(torch.tensor_split(b["x"], 3), torch.tensor_split(b["target"], 3)):
            o = ref(x)
            (F.mse_loss(o, y) * (x.shape[0] / 9)).backward()
            outs.append(o.detach())
        torch.testing.assert_close(out, torch.cat(outs), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.ema, ref.ema, rtol=1e-6, atol=1e-7)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class OperatorTally(nn.Module):
    """Buffers updated by Python's in-place operators (`self.count += 1`, `*=`), which dynamo
    records as operator.iadd / imul."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        self.count += 1
        self.scale *= 0.9
        return self.out(torch.tanh(self.inp(x)))


def test_buffers_updated_by_in_place_operators_are_updated():
    """`self.count += 1` was dead code to the pass that keeps the loss's inputs (its value unread):
    train_step never updated the buffer, silently; now once a microbatch, as eager gradient
    accumulation over the same microbatches."""
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, loss_fn=F.mse_loss, memory_budget=TIGHT)
    model = OperatorTally()
    cm = train_both(model, mse_batches(n=9), cfg, eager_step=lambda m, b: mse_eager_microbatched(m, b, 3), min_stages=0,
                    call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))
    assert model.count.item() == 9
    names = [n for n, _ in model.named_buffers()]
    assert sorted(names[i] for i in cm.plan.mutated_buffers) == ["count", "scale"]
    assert cm.plan.buffers_at_start == []      # (only updated: no recompute reads them)


@pytest.mark.parametrize("new", [lambda c: c + 1, lambda c: c.to(torch.float16),
                                 lambda c: c.to(torch.float16).to(torch.float32), lambda c: c.contiguous() * 1],
                         ids=["added", "other_dtype", "rounded", "multiplied"])
def test_a_buffer_assigned_anew_in_forward_is_refused(new):
    """`self.count = self.count + 1` assigns a new tensor while capturing; putting the host buffer
    back lost it, and no call ever updated the buffer, silently. A `.to` that changes the dtype
    (or rounds through another) is a new value too; the same tensor assigned is let be (CTRL in
    the zoo, Note [no-op reassignments])."""
    class Reassigned(OperatorTally):
        def forward(self, x):
            self.count = new(self.count)
            return self.out(torch.tanh(self.inp(x)))
    model = Reassigned()
    count = model.count
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    with pytest.raises(rpcompile.CaptureError, match=r"assigns a new tensor to count .*count.add_\(1\)|in place"):
        cm(torch.randn(4, 8))
    assert model.count is count and model.count.item() == 0


def test_a_module_registered_under_two_names_trains_as_eager():
    """A submodule reached by two names (`self.again = self.inp`, as peft's trainable tokens on a
    tied embedding share a ParameterDict): its parameters were copied twice while capturing and
    the first step failed on a fake tensor."""
    class Twice(MLP):
        def __init__(self):
            super().__init__(width=8, depth=1)
            self.again = self.hidden[0]

        def forward(self, x):
            x = torch.relu(self.inp(x))
            return self.out(torch.tanh(self.again(torch.tanh(self.hidden[0](x)))))
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, loss_fn=F.mse_loss)
    train_both(Twice(), mse_batches(), cfg, eager_step=mse_eager, min_stages=0,
               call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))


def test_buffers_only_read_are_not_written_back(monkeypatch):
    """A decoder's rotary inv_freq is read by its job, never written: the job copies nothing back
    at its end (that copy waited for the device: Note [buffers written back])."""
    from rpcompile.runtime.job import JobContext
    written, real = [], JobContext.finish

    def finish(job):
        written.append(len(job.write_back))
        return real(job)
    monkeypatch.setattr(JobContext, "finish", finish)
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, dtype=torch.bfloat16,
                                                   memory_budget="300KiB"))
    cm.train_step(**lm_batch(seed=0))
    assert "model.rotary_emb.inv_freq" in [n for n, _ in model.named_buffers()] and not cm.plan.mutated_buffers
    assert written and not any(written)


class Gated(nn.Module):
    """`gate` takes part in the graph but no gradient reaches it (a comparison)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.gate = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.b(self.a(x) * (self.gate > 0))


@pytest.mark.parametrize("data_parallel", [False, True])
def test_host_gradients_no_gradient_reached_are_never_read(monkeypatch, data_parallel):
    """Note [first gradients copied]: a job writes only the keys a gradient reached. With the
    host gradient set filled with NaN when it is made, overlapped steps with a clipped norm
    (SGD with momentum) equal eager ones and leave `gate` unchanged, as eager does."""
    from rpcompile.runtime import grads

    made = grads.GradSet.flat
    lock = threading.Lock()

    def nan_filled(self):
        # (one check and fill at a time: two copies' threads asking at once would both see it
        # fresh, and the later fill would wipe what the first copy had accumulated in it)
        with lock:
            fresh = self._flat is None
            flat = made(self)
            if fresh:
                flat.fill_(float("nan"))
        return flat

    monkeypatch.setattr(grads.GradSet, "flat", nan_filled)
    torch.manual_seed(0)
    model = Gated()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, loss_fn=F.mse_loss,
                                                   optimizer_mode="overlapped", data_parallel=data_parallel))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_grad_norm=0.5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for b in mse_batches():
        cm.train_step(b["x"], target=b["target"])
        mse_eager(ref, b)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step(), opt.zero_grad()
    cm.synchronize()
    gate = cm.plan.captured.param_names.index("gate")
    assert any(gate in st.grad_params for st in cm.plan.stages) and (cm.plan.replicas > 1) == data_parallel
    assert model.gate.grad is None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"{name}: max abs error {(p - q).abs().max():.3g}"


class StepScaled(nn.Module):
    """A counter buffer updated at the top of forward and read by every layer."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x):
        self.t.add_(1)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * (1 + 0.01 * self.t)
        return x


def test_a_buffer_read_by_every_layer_trains_as_eager_or_says_why_it_cannot_be_cut():
    """Note [a buffer updated in place stays in one stage]: a buffer updated at the top and read
    by every layer holds the layers in one stage: at a budget that fits they train as eager (the
    layers past a cut read the value before the step, silently, before); below it the
    PlanningError names the buffer and its span."""
    def step(model, b):
        return mse_eager_microbatched(model, b, 2)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(8, 64, generator=g), "target": torch.randn(8, 64, generator=g)} for _ in range(3)]
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, loss_fn=F.mse_loss, memory_budget=TIGHT)
    train_both(StepScaled(), batches, cfg, eager_step=step, min_stages=0,
               call=lambda cm, b: cm.train_step(b["x"], target=b["target"]))
    cm = rpcompile.compile(StepScaled(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                         loss_fn=F.mse_loss, memory_budget=60_000))
    with pytest.raises(rpcompile.PlanningError, match=r"reads them far from the update: t \(nodes 0 to \d+ of \d+\)"):
        cm.train_step(batches[0]["x"], target=batches[0]["target"])
