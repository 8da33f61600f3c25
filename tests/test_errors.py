"""Bad input gets a clear error in the caller's thread, and a failed step changes nothing."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.runtime.job import JobContext

from parity import inject_fault
from models import MLP, GraphBreak, lm_batch, qwen3


def test_graph_break_is_an_error_naming_the_place():
    cm = rpcompile.compile(GraphBreak())
    with pytest.raises(rpcompile.CaptureError) as e:
        cm.train_step(torch.randn(3, 4))
    msg = str(e.value)
    assert "one graph" in msg and "item" in msg


def test_wrong_input_type():
    cm = rpcompile.compile(MLP(), rpcompile.Config(loss_fn=F.mse_loss))
    import numpy as np
    with pytest.raises(rpcompile.InputError, match="torch.Tensor"):
        cm.train_step(np.zeros((3, 8), dtype=np.float32), target=torch.randn(3, 4))
    with pytest.raises(rpcompile.InputError, match="torch.Tensor"):
        cm.train_step(torch.randn(3, 8), target=object())
    with pytest.raises(rpcompile.InputError, match="target"):
        cm.train_step(torch.randn(3, 8))


def test_config_errors():
    with pytest.raises(ValueError, match="num_microbatches"):
        rpcompile.Config(num_microbatches=0)
    with pytest.raises(ValueError, match="mixes device types"):
        rpcompile.Config(devices=["cpu", "cuda:0"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            rpcompile.Config(devices=["cuda:0"])
    with pytest.raises(ValueError, match="24GiB"):
        rpcompile.Config(memory_budget="lots")


def test_default_workers(monkeypatch):
    """Worker processes on two or more GPUs, threads otherwise (Config.workers=None)."""
    assert rpcompile.Config(devices=["cpu", "cpu"]).workers == "threads"
    assert rpcompile.Config(devices=["cpu", "cpu"], workers="processes").workers == "processes"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rpcompile.Config(devices=["cuda:0", "cuda:1"]).workers == "processes"
    assert rpcompile.Config(devices=["cuda:0"]).workers == "threads"
    assert rpcompile.Config(devices=["cuda:0", "cuda:1"], peer_transfers=True).workers == "threads"
    assert rpcompile.Config(devices=["cuda:0", "cuda:1"], workers="threads").workers == "threads"
    # (a GPU named twice: processes, but threads for replicas: test_replicas.test_what_replicas_refuse)
    assert rpcompile.Config(devices=["cuda:0", "cuda:0"]).workers == "processes"
    with pytest.raises(ValueError, match="needs workers='threads'"):
        rpcompile.Config(devices=["cuda:0", "cuda:1"], workers="processes", peer_transfers=True)


def test_impossible_memory_budget_says_what_fits():
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, memory_budget=1000))
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**lm_batch())
    err = e.value
    assert err.min_budget and err.min_budget > 1000
    assert "memory_budget" in str(err) and "at least" in str(err)
    ok = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget=err.min_budget))
    ok.train_step(**lm_batch())


def test_failure_in_one_stage_leaves_parameters_and_grads_unchanged(monkeypatch):
    model = qwen3()
    cfg = rpcompile.Config(devices=["cpu", "cpu", "cpu"], num_microbatches=3, memory_budget="300KiB")
    cm = rpcompile.compile(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = lm_batch()
    cm.train_step(**batch)
    opt.step()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    target_stage = cm.plan.stages[-2].index
    inject_fault(monkeypatch, target_stage, microbatch=1)
    with pytest.raises(rpcompile.StageError) as e:
        cm.train_step(**batch)
    err = e.value
    assert err.stage == target_stage and err.microbatch == 1 and err.device == "cpu"
    assert f"stage {target_stage}" in str(err) and "microbatch 1" in str(err) and "injected fault" in str(err)
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    monkeypatch.undo()
    loss = cm.train_step(**batch)
    assert torch.isfinite(loss)
    assert opt.state_dict()["state"].keys() == state["state"].keys()


def test_failed_step_restores_running_statistics(monkeypatch):
    from models import WithBatchNorm
    model = WithBatchNorm()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   loss_fn=F.mse_loss, memory_budget=6000))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    cm.train_step(x, target=y)
    assert cm.plan.mutated_buffers, "BatchNorm's running statistics are updated in place"
    assert any(st.kind == "bwd" for st in cm.plan.stages) and cm.plan.buffers_at_start == [], \
        "only batch_norm reads them: no recompute needs their values at a microbatch's start"
    before = [b.clone() for b in model.buffers()]

    def faulty(job, grads):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(JobContext, "accumulate_grads", faulty)
    with pytest.raises(rpcompile.StageError):
        cm.train_step(x, target=y)
    for b, c in zip(model.buffers(), before):
        assert torch.equal(b, c)


def test_failure_while_building_programs_does_not_strand_workers(monkeypatch):
    model = qwen3()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB"))
    batch = lm_batch()
    cm.train_step(**batch)
    real = cm.runner.program_for
    calls = {"n": 0}

    def failing(plan, stage, role, device):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("compile failed")
        return real(plan, stage, role, device)

    monkeypatch.setattr(cm.runner, "program_for", failing)
    with pytest.raises(RuntimeError, match="compile failed"):
        cm.train_step(**batch)
    monkeypatch.setattr(cm.runner, "program_for", real)
    model.zero_grad()
    assert torch.isfinite(cm.train_step(**batch))      # would hang if workers were stranded


def test_process_exits_cleanly_with_live_workers(tmp_path):
    """A script that trains and exits with the compiled model still alive ends with status 0
    (worker and optimizer threads ending during interpreter shutdown used to abort it). The
    abort depended on timing, about one run in three before the fix: the script imports torch
    and rpcompile once and forks three processes, each of which builds, compiles and trains
    the model and then exits through the interpreter's own shutdown (sys.exit), the compiled
    model alive in its globals; the script reports each one's exit status."""
    import subprocess
    import sys
    script = tmp_path / "train_and_exit.py"
    script.write_text(
        "import os, sys, torch, torch.nn.functional as F, rpcompile\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from models import MLP\n"
        "for run in range(3):\n"
        "    sys.stdout.flush(); sys.stderr.flush()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        m = MLP(depth=2)\n"
        "        cm = rpcompile.compile(m, rpcompile.Config(devices=['cpu', 'cpu'], num_microbatches=2,\n"
        "                              loss_fn=F.mse_loss, optimizer_mode='overlapped'))\n"
        "        cm.attach_optimizer(torch.optim.AdamW(m.parameters()))\n"
        "        cm.train_step(torch.randn(4, 8), target=torch.randn(4, 4))\n"
        "        print('trained', flush=True)\n"
        "        sys.exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    print('exit status', os.waitstatus_to_exitcode(status), flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n") == ["trained", "exit status 0"] * 3 + [""], (res.stdout, res.stderr[-2000:])
    assert "terminate called" not in res.stderr


def test_parameters_replaced_after_the_first_call_are_an_error_until_compiled_again():
    """Note [parameters replaced after the first call] (call_checks.py): before, a replaced module or
    Parameter kept training the old tensors (a wrong loss, no gradient on the new ones) and
    model.to(bfloat16) failed in a stage job. Now each is an InputError naming what changed, the
    parameters and gradients as they were; a model compiled again trains as eager."""
    model = qwen3(layers=1)
    b = lm_batch(batch=4)
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2)
    cm = rpcompile.compile(model, cfg)
    cm.train_step(**b)
    torch.manual_seed(1)
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)   # (untied)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(rpcompile.InputError, match=r"lm_head.weight is new.*Compile the model again"):
        cm.train_step(**b)
    with pytest.raises(rpcompile.InputError, match="lm_head.weight is new"):
        cm(**b)                                           # a call too
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]) and (p.grad is None) == (name not in grads)
        assert p.grad is None or torch.equal(p.grad, grads[name])
    model.zero_grad()
    ref = copy.deepcopy(model)
    again = rpcompile.compile(model, cfg)
    loss = again.train_step(**b)
    loss_ref = ref(**b).loss
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    from parity import check_grads
    check_grads(model, ref)
    assert model.lm_head.weight.grad is not None
    model.to(torch.bfloat16)
    with pytest.raises(rpcompile.InputError, match=r"model.embed_tokens.weight and 13 more changed dtype torch.float32 -> "
                                                   r"torch.bfloat16\. Its plans"):
        again.train_step(**b)


def test_a_call_under_autocast_is_an_error_saying_rpcompile_casts_itself():
    """Note [no ambient autocast] (call_checks.py): before, the first call's autocast state served
    every later call (a plain call after an autocast one returned autocast's logits)."""
    model = qwen3(layers=1)
    b = lm_batch(batch=4)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    for first in (True, False):                        # before and after the first plan
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(rpcompile.InputError, match=r"torch.autocast \(cpu\).*Config\(dtype=torch.bfloat16\)"):
                cm.train_step(**b)
            with pytest.raises(rpcompile.InputError, match="torch.autocast"):
                cm(**b)
        assert all(p.grad is None for p in model.parameters())
        cm(**b)


def test_a_call_while_another_thread_runs_one_is_an_error():
    """Note [one call at a time] (call_checks.py): two threads' train_steps at once lost one batch's
    gradients, silently. The second is an InputError, the first completes as it would alone."""
    import threading
    model = qwen3(layers=1)
    ref = copy.deepcopy(model)
    b = lm_batch(batch=4)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    inside, go = threading.Event(), threading.Event()
    run = cm.runner.train_step

    def held(*a, **k):
        inside.set()
        assert go.wait(60)
        return run(*a, **k)

    cm.runner.train_step = held
    first = threading.Thread(target=lambda: cm.train_step(**b))
    first.start()
    assert inside.wait(120)
    with pytest.raises(rpcompile.InputError, match="already running"):
        cm.train_step(**lm_batch(batch=4, seed=1))
    with pytest.raises(rpcompile.InputError, match="already running"):
        cm(**b)
    go.set()
    first.join(120)
    ref(**b).loss.backward()
    from parity import check_grads
    check_grads(model, ref)
    cm.runner.train_step = run
    cm.train_step(**b)                                   # the next call, from this thread


def test_arguments_the_model_refuses_are_input_errors_naming_them():
    """Note [the model's own exceptions] (capture.py): a misspelt keyword made transformers raise
    while dynamo traced, which read as a graph break to report to transformers; an argument given
    positionally and by name (a TypeError eagerly) trained. Both are InputErrors now."""
    model = qwen3(layers=1)
    b = lm_batch(batch=4)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    # (torch 2.11 keeps the exception's class alone: the line raising it says the rest)
    with pytest.raises(rpcompile.InputError, match=r"the model raised ValueError.* at .*You must specify exactly one "
                                                   r"of input_ids or inputs_embeds.*called with input_id=, labels="):
        cm.train_step(input_id=b["input_ids"], labels=b["labels"])
    with pytest.raises(rpcompile.InputError, match="forward does not take these arguments: multiple values for "
                                                   "argument 'input_ids'"):
        cm.train_step(b["input_ids"], input_ids=b["input_ids"], labels=b["labels"])
    assert all(p.grad is None for p in model.parameters())
    cm.train_step(b["input_ids"], labels=b["labels"])    # positionally, as eager takes it


def test_a_size_returned_says_what_to_do():
    """A model returning a size computed in forward (a SymInt: what a sliding-window transformers
    cache holds when called with use_cache=True) is an error that names that case."""
    class Sized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).pow(2).mean(), x.shape[0] * 2

    cm = rpcompile.compile(Sized(), rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    with pytest.raises(rpcompile.CaptureError, match=r"non-tensor value .*call it with use_cache=False"):
        cm(torch.randn(4, 4))


class _Checked(torch.nn.Module):
    """Checks its input with torch._assert_async, in forward and in a custom Function's backward."""

    class _CheckedGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            torch._assert_async(torch.isfinite(g).all() & (g.abs().amax() < 1e6), "gradient check failed")
            return g

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, scale):
        torch._assert_async((x.abs() < 100).all(), "input check failed")
        h = self._CheckedGrad.apply(torch.tanh(self.a(x)) * scale)
        return self.b(h).pow(2).mean()


@pytest.mark.parametrize("x,scale,said", [(1e3, 1.0, "input check failed"), (1.0, 1e9, "gradient check failed")],
                         ids=["forward", "backward"])
def test_a_models_own_checks_run(x, scale, said):
    """torch._assert_async in forward or in a custom Function's backward raised eagerly and was
    dropped as dead code by rpcompile (no error, training went on)."""
    model = _Checked()
    b = {"x": torch.full((4, 8), x), "scale": torch.tensor(scale)}
    with pytest.raises(RuntimeError, match=said):
        model(**b).backward()
    model.zero_grad()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    with pytest.raises(rpcompile.StageError, match=said):
        cm.train_step(**b)
    assert all(p.grad is None for p in model.parameters())
    cm.train_step(x=torch.ones(4, 8), scale=torch.tensor(1.0))           # checks that pass


def test_what_the_optimizer_thread_cannot_drive_is_refused_when_attached():
    """LBFGS (a closure), ReduceLROnPlateau (a metric) failed a step later in a stage job's name;
    grad_scale with an attached optimizer had it step the scaled gradients (1024x eager's)."""
    model = qwen3(layers=1)
    b = lm_batch(batch=4)
    for mode in ("overlapped", "delayed"):
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, optimizer_mode=mode))
        with pytest.raises(rpcompile.InputError, match="LBFGS steps with a closure"):
            cm.attach_optimizer(torch.optim.LBFGS(model.parameters()))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with pytest.raises(rpcompile.InputError, match="ReduceLROnPlateau steps on a metric"):
            cm.attach_optimizer(opt, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
        cm.attach_optimizer(opt)
        before = [p.detach().clone() for p in model.parameters()]
        for scale in (torch.amp.GradScaler("cpu", init_scale=1024.0), 2.0):
            with pytest.raises(rpcompile.InputError, match="grad_scale with Config"):
                cm.train_step(**b, grad_scale=scale)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        cm.train_step(**b, grad_scale=1.0)
        cm.synchronize()


@pytest.mark.parametrize("wrong", ["float_ids", "short_labels"])
def test_arguments_an_operation_fails_on_are_an_input_error(wrong):
    """Float ids, labels of fewer columns than the ids: eager fails in the embedding or the loss;
    the capture said "could not capture the model as one graph", a graph break to report, with
    the operation's own error in the middle of 3 KB. Now an InputError that starts with it."""
    model = qwen3(layers=1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    ids = torch.randint(0, 128, (4, 8))
    batch = {"float_ids": dict(input_ids=ids.float(), labels=ids),
             "short_labels": dict(input_ids=ids, labels=ids[:, :6])}[wrong]
    said = {"float_ids": "Expected tensor for argument #1 'indices'",
            "short_labels": "Expected input batch_size"}[wrong]
    with pytest.raises(rpcompile.InputError, match="failed on this call's arguments") as err:
        cm.train_step(**batch)
    assert said in str(err.value) and len(str(err.value)) < 1000
    assert all(p.grad is None for p in model.parameters())


def test_an_operations_failure_torch_2_14_raises_in_the_models_frame_is_read_out_of_its_wrapper():
    """torch 2.14's dynamo raises float ids' embedding failure as an exception observed in the model's
    frame, its text the repr of a wrapper; the capture said "the model raised RuntimeError('Dynamo
    failed to run FX node with fake tensors: ...')" (600 characters) where 2.13 gives the operation's
    error. CI runs 2.13, so the text 2.14.1 gave is read here."""
    from rpcompile.capture import _fake_call_failure
    raised = ("RuntimeError('Dynamo failed to run FX node with fake tensors: call_function <function embedding at "
              "0x7f3e>(*(FakeTensor(..., size=(s33, s5)), Parameter(FakeTensor(..., size=(128, 32), requires_grad=True)"
              "), None, None, 2.0, False, False), **{}): got RuntimeError(\"Expected tensor for argument #1 \\'indices"
              "\\' to have one of the following scalar types: Long, Int; but got torch.float32 instead\")')")
    assert _fake_call_failure(ValueError(), "", raised) == (
        "RuntimeError: Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, "
        "Int; but got torch.float32 instead")
    assert _fake_call_failure(ValueError(), "", "ValueError('You must specify exactly one of input_ids')") is None


def test_a_loss_fn_closing_over_a_tensor_is_told_to_pass_it_in_the_target():
    """nn.CrossEntropyLoss(weight=w) in a loss_fn: the capture's hint said to register the tensor
    as a buffer of the module, which a loss_fn has not."""
    loss = torch.nn.CrossEntropyLoss(weight=torch.rand(128))
    cm = rpcompile.compile(qwen3(layers=1), rpcompile.Config(
        devices=["cpu", "cpu"], num_microbatches=2, loss_fn=lambda o, t: loss(o.logits.flatten(0, 1), t.flatten())))
    ids = torch.randint(0, 128, (4, 8))
    with pytest.raises(rpcompile.CaptureError, match=r"pass it in the target instead"):
        cm.train_step(input_ids=ids, target=ids)


def test_parameters_off_the_host_are_an_error_saying_how_to_load_them():
    """Note [parameters on the host] (call_checks.py): a model made on the meta device failed in
    its first stage job ("Cannot copy out of meta tensor"); parameters moved after the first call
    went unnoticed. Both are InputErrors now, raised before anything runs."""
    with torch.device("meta"):
        empty = qwen3(layers=1)
    cm = rpcompile.compile(empty, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    with pytest.raises(rpcompile.InputError, match=r"host memory \(CPU\): model.embed_tokens.weight and \d+ more on meta.*"
                                                   r"to_empty\(device='cpu'\)"):
        cm.train_step(**lm_batch(batch=4))
    model = qwen3(layers=1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    cm.train_step(**lm_batch(batch=4))
    model.model.norm.to("meta")
    with pytest.raises(rpcompile.InputError, match=r"model.norm.weight (moved cpu -> meta|is a new Parameter)"):
        cm.train_step(**lm_batch(batch=4))


@pytest.mark.parametrize("native", [True, False] if hasattr(BaseException, "add_note") else [False])
def test_a_note_reaches_the_error_on_every_python(monkeypatch, native):
    """Note [notes on Python 3.10] (rpcompile/errors.py): Python 3.10 has no add_note, and a delayed
    step's failure raised an AttributeError in place of its StageError there. Without notes the
    note is kept in __notes__ and ends the message of rpcompile's errors; with them, add_note's own."""
    from rpcompile import errors
    monkeypatch.setattr(errors, "_NOTES", native)
    err = rpcompile.StageError("stage 4 (bwd) on cpu, microbatch 0: RuntimeError: injected", stage=4,
                               schedule="0F@0 1FB@1 [2B@0 failed]")
    errors.add_note(err, "already stepped: model.norm.weight")
    errors.add_note(err, "reload a checkpoint")
    assert err.__notes__ == ["already stepped: model.norm.weight", "reload a checkpoint"]
    assert isinstance(err, rpcompile.StageError) and err.stage == 4
    text = str(err)
    assert text.startswith("stage 4 (bwd) on cpu") and "[2B@0 failed]" in text
    if native:
        assert "already stepped" not in text      # (the traceback prints notes after the message)
    else:
        assert text.endswith("[2B@0 failed]\nalready stepped: model.norm.weight\nreload a checkpoint")
    plain = KeyError("k")          # (another's args need not be a message: left as they are)
    errors.add_note(plain, "n")
    assert plain.args == ("k",) and plain.__notes__ == ["n"]
