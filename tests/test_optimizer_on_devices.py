"""Optimizer state on the devices (Note [optimizer state on the devices], runtime/flat.py): a
share of the flat masters' parameters is stepped by twins on the devices, whose fp32 masters and
state live there; results, state and state_dict stay the user's optimizer's own. CPU devices
run the same code (the "device" buffers are then separate host tensors)."""
import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rpcompile.runtime.flat import FlatMasters, FlatStepper
from test_flat_optimizer import OPTIMIZERS, _model, _step_both, _step_skipping

DEVICES = ["cpu", "cpu"]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks that split the small models of these tests (the default is 64Mi elements)."""
    monkeypatch.setattr(FlatMasters, "BLOCK", 100)


def test_a_share_of_whole_parameters_in_blocks_dealt_to_the_devices_in_turn(monkeypatch):
    monkeypatch.setattr(FlatMasters, "BLOCK", 20)
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(10)]
    masters = FlatMasters(DEVICES, 0.5)
    masters.flatten(params)
    # blocks of 20 elements; one goes to a device while half of it keeps the devices' part within
    # half of what came so far: devices and host take turns, the devices theirs in turn
    assert [(a, b, str(d)) for a, b, d in masters.on_devices[0]] == [(0, 20, "cpu"), (40, 60, "cpu"), (80, 100, "cpu")]
    assert masters.device_range(0, 45)[:2] == (40, 60) and masters.device_range(0, 30) is None
    assert masters.host_offset(0, 20) == 0 and masters.host_offset(0, 65) == 25 and masters.host_numel(0) == 40
    # the devices in turn (two of them: the ranges' devices by their index in state_devices)
    two = FlatMasters(["cpu:0", "cpu:1"], 1.0)
    two.flatten([torch.nn.Parameter(torch.randn(10)) for _ in range(6)])
    assert [(a, b, d.index) for a, b, d in two.on_devices[0]] == [(0, 20, 0), (20, 40, 1), (40, 60, 0)]
    # a parameter larger than a block is one block
    big = FlatMasters(DEVICES, 1.0)
    big.flatten([torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(5))])
    assert [(a, b) for a, b, _ in big.on_devices[0]] == [(0, 50), (50, 55)]
    none = FlatMasters(DEVICES, 0.0)
    none.flatten([torch.nn.Parameter(torch.randn(4))])
    assert not none.on_devices and none.state_devices == []


def _stepper(params, opt, share):
    masters = FlatMasters(DEVICES, share)
    masters.flatten(params)
    return FlatStepper(opt, masters)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_device_parts_step_as_the_users_optimizer(name, share):
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = OPTIMIZERS[name](params), OPTIMIZERS[name](ref_params)
    stepper = _stepper(params, opt, share)
    stepper.PIECE = 100          # the 128-element weight's first step in slices, its state made on the host
    _step_both(stepper, params, ref_opt, ref_params, range(4))
    on_dev = [p for p in params if stepper.masters.device_range(0, stepper.masters.where[id(p)][1])]
    assert on_dev and (share < 1 or len(on_dev) == len(params))
    host_buf = stepper.masters.buffers[0].untyped_storage().data_ptr()
    for p in on_dev:         # their state is in the device buffers, not the host's
        for key, v in opt.state[p].items():
            if v.dim():
                assert v.untyped_storage().data_ptr() != host_buf
                assert any(v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                           for (_, k, where), b in stepper._state_bufs.items() if k == key and where is not None)
    assert stepper._device_masters
    got, want = opt.state_dict(), ref_opt.state_dict()
    for i in want["state"]:
        for key, v in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][key], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS) + ["sgd-plain"])
def test_a_device_parts_first_step_is_made_on_its_device(name):
    """Note [first step on the device]: the user's optimizer steps only the host's parameters;
    a device part's first step is a twin's over its masters there, whose state lands in the
    device buffers, and the stepped masters there are the host's (copy_down can read them)."""
    make = OPTIMIZERS.get(name) or (lambda ps: torch.optim.SGD(ps, lr=1e-1))
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = make(params), make(ref_params)
    stepper = _stepper(params, opt, 0.5)
    stepper.PIECE = 100          # the host's 128-element weight in two slices
    stepper.WIDEN = 120          # a device's in slices of 30: within the plan's room for a widened slice
    by_user, twins = [], []
    opt.register_step_pre_hook(lambda o, args, kwargs: by_user.extend(
        id(p) for g in o.param_groups for p in g["params"] if p.grad is not None))
    def twin_sizes(o, args, kwargs):
        if o is not opt and o is not ref_opt:
            twins.extend(p.numel() for g in o.param_groups for p in g["params"])
    hook = register_optimizer_step_pre_hook(twin_sizes)
    try:
        _step_both(stepper, params, ref_opt, ref_params, range(1))
    finally:
        hook.remove()
    on_dev = [p for p in params if stepper.masters.device_range(*stepper.masters.where[id(p)])]
    assert on_dev and len(on_dev) < len(params) and max(p.numel() for p in on_dev) > 30
    assert by_user and not set(by_user) & {id(p) for p in on_dev}
    assert twins and max(twins) <= 30
    for p in on_dev:
        torch.testing.assert_close(stepper._device_view(p), p, rtol=0, atol=0)
    _step_both(stepper, params, ref_opt, ref_params, range(1, 3))
    got, want = opt.state_dict(), ref_opt.state_dict()
    for i in want["state"]:
        assert got["state"][i].keys() == want["state"][i].keys()
        for key, v in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][key].cpu(), v, rtol=1e-6, atol=1e-7)


def test_bf16_gradients_in_slices_across_the_device_ranges():
    """A narrower gradient is stepped WIDEN elements at a time; slices are cut where a device
    range begins or ends."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    stepper = _stepper(params, opt, 0.7)
    stepper.WIDEN = 50
    _step_both(stepper, params, ref_opt, ref_params, range(3), dtype=torch.bfloat16)
    slices = stepper._slices(0, 0, stepper.masters.buffers[0].numel(), True)
    ranges = stepper.masters.on_devices[0]
    assert all(b - a <= 50 for a, b, _ in slices)
    assert {a for a, _, _ in slices} >= {a for a, _, _ in ranges} | {ranges[-1][1]}


def test_a_missing_gradient_and_load_state_dict():
    """A run whose scalar state disagrees is stepped a parameter at a time, never by the user's
    optimizer (whose state is on the devices); load_state_dict's host tensors move back there."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    stepper = _stepper(params, opt, 1.0)
    calls = []
    user_step = opt.step
    opt.step = lambda *a, **k: calls.append(1) or user_step(*a, **k)

    def both(step, skip=()):
        _step_skipping(stepper, params, ref_opt, ref_params, step, skip)

    both(0)
    first = len(calls)          # the first step is the user's optimizer's, per parameter
    both(1)
    both(2, skip={1})
    both(3)
    assert len(calls) == first
    assert opt.state[params[1]]["step"] != opt.state[params[0]]["step"]
    saved = copy.deepcopy(ref_opt.state_dict())
    opt.load_state_dict(saved)
    both(4)
    both(5)
    assert len(calls) == first
    dev_bufs = {b.untyped_storage().data_ptr() for (_, key, where), b in stepper._state_bufs.items()
                if key == "exp_avg" and where is not None}
    assert opt.state[params[2]]["exp_avg"].untyped_storage().data_ptr() in dev_bufs


def test_masters_go_up_only_where_the_host_changed_them(monkeypatch):
    """The stepped masters come down every step; they go up the first time, where a parameter was
    written in place since (its _version moved: load_state_dict, a no_grad write), and all of
    them after a failed step; otherwise the devices' masters are the host's already."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    stepper = _stepper(params, opt, 0.5)
    on_dev = sum(b - a for rs in stepper.masters.on_devices.values() for a, b, _ in rs)
    _step_both(stepper, params, ref_opt, ref_params, range(2))
    first = stepper.master_uploads
    _step_both(stepper, params, ref_opt, ref_params, range(2, 4))
    assert first == on_dev and stepper.master_uploads == on_dev     # nothing went up again
    dev_p = [i for i, p in enumerate(params) if stepper.masters.device_range(0, stepper.masters.where[id(p)][1])]
    i = dev_p[0]
    with torch.no_grad():          # the user's write, on both
        params[i].mul_(0.5)
        ref_params[i].mul_(0.5)
    _step_both(stepper, params, ref_opt, ref_params, range(4, 5))
    assert on_dev < stepper.master_uploads <= 2 * on_dev
    model.load_state_dict(ref.state_dict())        # every parameter written
    before = stepper.master_uploads
    _step_both(stepper, params, ref_opt, ref_params, range(5, 6))
    assert stepper.master_uploads - before == on_dev
    upload = stepper._upload
    calls = []
    monkeypatch.setattr(stepper, "_upload", lambda *a: calls.append(1) or (_ for _ in ()).throw(RuntimeError("boom")))
    grads = [torch.randn_like(p) for p in params]
    with pytest.raises(RuntimeError, match="boom"):
        stepper.step(params, grads)
    assert calls == [1]            # it failed before stepping anything on a device
    monkeypatch.setattr(stepper, "_upload", upload)
    before = stepper.master_uploads
    _step_both(stepper, params, ref_opt, ref_params, range(6, 8))
    assert stepper.master_uploads - before == on_dev     # after the failure every master went up, once


def test_prepared_masters_go_up_again_only_where_written_before_the_first_step():
    """Note [ready before the first step]: prepare puts the device ranges' masters there once; the
    first step then uploads only a parameter written in place since, and every step equals the
    user's optimizer's."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    stepper = _stepper(params, opt, 0.5)
    on_dev = sum(b - a for rs in stepper.masters.on_devices.values() for a, b, _ in rs)
    stepper.prepare(params)
    assert stepper.master_uploads == on_dev
    for (k, start), dm in stepper._device_masters.items():
        assert torch.equal(dm, stepper.masters.buffers[k][start:start + dm.numel()])
    dev_p = [i for i, p in enumerate(params) if stepper.masters.device_range(0, stepper.masters.where[id(p)][1])]
    i = dev_p[0]
    with torch.no_grad():          # the user's write after prepare, on both
        params[i].mul_(0.5)
        ref_params[i].mul_(0.5)
    _step_both(stepper, params, ref_opt, ref_params, range(3))
    assert stepper.master_uploads == on_dev + params[i].numel()
    stepper.prepare(params)        # there already: nothing goes up
    _step_both(stepper, params, ref_opt, ref_params, range(3, 4))
    assert stepper.master_uploads == on_dev + params[i].numel()


def test_a_failed_prepare_is_raised_once_by_the_next_call_and_changes_nothing(monkeypatch):
    from rpcompile.runtime.optimizer import OverlappedOptimizer
    params = list(_model().parameters())
    before = [p.detach().clone() for p in params]
    ov = OverlappedOptimizer(torch.optim.AdamW(params, lr=1e-2), state_devices=DEVICES)
    ov.flatten(params, 0.5)
    monkeypatch.setattr(ov.stepper, "prepare", lambda *a: (_ for _ in ()).throw(MemoryError("boom")))
    ov.prepare(params)
    with pytest.raises(RuntimeError, match="preparing its first step .* before any parameter was stepped: boom"):
        ov.synchronize()
    ov.synchronize()                 # raised once
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_working_copies_come_down_from_the_devices_where_their_masters_are_current(monkeypatch):
    """Note [working copies from the devices]: copy_down copies (cast) the parameters stepped on
    a device from there and leaves the host's, and one written in place since, to the host."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    monkeypatch.setattr(FlatMasters, "BLOCK", 10)     # a block a parameter: two of the four on the devices
    stepper = _stepper(params, opt, 0.8)
    dev = [i for i, p in enumerate(params) if stepper.masters.device_range(0, stepper.masters.where[id(p)][1])]
    assert len(dev) == 2 and len(params) == 4
    dsts = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    rest, wait = stepper.copy_down(dsts, params)
    assert rest == list(range(len(params)))           # never stepped there: the host copies all
    _step_both(stepper, params, ref_opt, ref_params, range(2))
    with torch.no_grad():
        params[dev[0]].mul_(0.5)                      # the user's write: the device's copy is stale
    # the casts go a slice of at most WIDEN elements at a time (a temporary of that size on the
    # device, which the plan counts): one flat working copy, so that the runs join
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16)
    dsts, off = [], 0
    for p in params:
        dsts.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    casts, real = [], torch.Tensor.copy_
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_", lambda d, s, **kw: (casts.append(s.numel()) if s.dtype != d.dtype
                                                             else None) or real(d, s, **kw))
        m.setattr(type(stepper), "WIDEN", 50)
        rest, wait = stepper.copy_down(dsts, params)
        wait()
    assert rest == [i for i in range(len(params)) if i not in dev[1:]]
    for i in dev[1:]:
        assert torch.equal(dsts[i], params[i].detach().to(torch.bfloat16))
    assert all(not dsts[i].any() for i in rest)
    assert max(casts) == 50 and sum(casts) == sum(params[i].numel() for i in dev[1:])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_brought_home_steps_on_as_the_users_optimizer(name):
    """FlatStepper.bring_home (Note [optimizer share by room]): the devices' state comes back into
    host buffers as long as the masters, the user's entries view them, and the steps go on as the
    user's optimizer's."""
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = OPTIMIZERS[name](params), OPTIMIZERS[name](ref_params)
    stepper = _stepper(params, opt, 0.5)
    _step_both(stepper, params, ref_opt, ref_params, range(3))
    assert stepper.masters.on_devices and stepper._device_masters
    stepper.bring_home()
    assert not stepper.masters.on_devices and not stepper._device_masters and stepper.masters.share == 0.0
    host = {where for (_, _, where) in stepper._state_bufs}
    assert host == {None}
    for p, r in zip(params, ref_params):
        for key, v in stepper._views[id(p)].items():
            assert opt.state[p][key] is v
            torch.testing.assert_close(v, ref_opt.state[r][key])
    _step_both(stepper, params, ref_opt, ref_params, range(3, 6))


def _qwen(layers=1):
    """A tied Qwen3 of vocab 256 (an 8,192-element embedding); one layer where it is compiled
    (what these tests check does not depend on the depth)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _masters_away(cm) -> bool:
    """Whether, once the last step's submission is done, the host masters are stale (Note [masters
    kept on the devices] in runtime/flat.py)."""
    cm.runner.settle()
    cm.runner.overlapped.drain()      # (nothing brought down by this)
    return cm.runner.overlapped.masters_away


@pytest.mark.parametrize("mode, workers", [("delayed", "threads"), ("overlapped", "threads"), ("delayed", "processes")])
def test_a_compiled_model_trains_as_with_every_update_on_the_host(mode, workers, monkeypatch):
    """The same losses and parameters with half the optimizer on the (CPU) devices as with none
    there; the plan says what the devices keep and the host no longer holds. (With half there,
    the first steps of the parameters larger than FlatStepper.PIECE go in slices.) The run with
    none there uses worker threads: worker processes equal them (test_processes.py), and a
    second pair of processes would only start again."""
    import rpcompile
    from models import lm_batch
    from rpcompile.runtime.flat import FlatStepper
    runs, prepared = {}, []
    prepare = FlatStepper.prepare
    monkeypatch.setattr(FlatStepper, "prepare", lambda self, ps, bufs=(): prepared.append(len(bufs)) or prepare(self, ps, bufs))
    for share in (0.0, 0.5):
        if share:
            monkeypatch.setattr(FlatStepper, "PIECE", 1000)      # the 8,192-element embedding in 9 slices
        model = _qwen()
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode=mode,
                                                       optimizer_on_devices=share,
                                                       workers=workers if share else "threads"))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        cm.runner.overlapped.trace = True      # (Note [optimizer spans])
        losses, reads = [], []
        for t in range(4):
            losses.append(float(cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=t))))
            if t == 2 and mode == "delayed" and workers == "threads":
                # Note [masters kept on the devices]: a forward call reads the live parameters and
                # `model.state_dict()` the host's (its pre-hook synchronizes): both bring the
                # masters kept on the devices down first
                assert _masters_away(cm) == bool(share)
                with torch.no_grad():
                    reads.append(cm(**lm_batch(batch=4, seq=8, vocab=256, seed=9)).logits)
                assert not cm.runner.overlapped.masters_away
        if mode == "delayed" and workers == "threads":
            assert _masters_away(cm) == bool(share)
            reads.append({k: v.clone() for k, v in model.state_dict().items()})
            assert not cm.runner.overlapped.masters_away
        cm.synchronize()
        runs[share] = (losses, [p.detach().clone() for p in model.parameters()], cm, reads)
    (l0, p0, cm0, reads0), (l1, p1, cm1, reads1) = runs[0.0], runs[0.5]
    for a, b in zip(reads0[:1], reads1[:1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(reads0[1:], reads1[1:]):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    assert l0 == pytest.approx(l1, rel=1e-6)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert cm1.runner.overlapped.masters.on_devices and cm1.runner.overlapped.stepper._device_masters
    # (Note [ready before the first step]) with worker processes and a share on the devices, once,
    # with the gradients (and delayed mode's two working copies); the masters went up then only
    assert prepared == ([1 + 2 * (mode == "delayed")] if workers == "processes" else [])
    stepper = cm1.runner.overlapped.stepper
    assert stepper.master_uploads == sum(b - a for rs in stepper.masters.on_devices.values() for a, b, _ in rs)
    hm0, hm1 = cm0.plan.host_memory, cm1.plan.host_memory
    assert hm1.optimizer_state < hm0.optimizer_state and hm1.device_optimizer > 0 == hm0.device_optimizer
    assert "Config.optimizer_on_devices" in str(cm1.plan)
    # Note [optimizer spans]: each submission's work there as spans, with the steps' in recent_traces
    assert cm0.runner.overlapped.device_spans == []
    assert not [sp for sp in cm0.runner.recent_traces() if sp["stream"].startswith("optimizer")]
    t0, spans = cm1.runner.overlapped.device_spans[-1]
    device_elements = sum(b - a for rs in stepper.masters.on_devices.values() for a, b, _ in rs)
    # (the working copies come down from there in delayed mode, whose jobs read them)
    # and in delayed mode, whose jobs read no host masters, the masters stay there (Note [masters
    # kept on the devices], runtime/flat.py)
    names = ["step_on_device"] + (["copies_down"] if mode == "delayed" else ["masters_down"])
    assert {sp["name"] for sp in spans} == set(names)
    for name in names:   # every element there, once a submission
        assert sum(sp["elements"] for sp in spans if sp["name"] == name) == device_elements, name
    assert all(0 <= sp["start_s"] <= sp["end_s"] for sp in spans)
    if mode == "overlapped":
        # a slice's masters come down before its chunk is ready: the jobs on CPU devices read the
        # host masters (Note [masters down after the copies], runtime/flat.py)
        first_down = min(sp["start_s"] for sp in spans if sp["name"] == "masters_down")
        assert first_down < max(sp["start_s"] for sp in spans if sp["name"] == "step_on_device")
    recent = cm1.runner.recent_traces()
    steps = [sp for sp in recent if "step" in sp]
    ours = [sp for sp in recent if sp["stream"] in ("optimizer", "optimizer_down")]
    assert ours and all(sp["end_s"] >= 0 and "step" not in sp for sp in ours)
    assert {sp["worker"] for sp in ours} <= {sp.get("worker") for sp in steps}
    # on the steps' clock: the last submission's first span began after the first traced step did
    # (an earlier submission's spans may begin before it and end after: recent_traces keeps those)
    first_step = cm1.runner.recent_tracers[0].t0
    assert t0 + min(sp["start_s"] for sp in spans if sp["name"] == "step_on_device") - first_step > 0
    assert len([sp for sp in ours if sp["name"] == "step_on_device"]) >= len([sp for sp in spans if sp["name"] == "step_on_device"])


@pytest.mark.parametrize("masters", ["each", "last", "kept"])
def test_masters_come_down_when_the_submission_asks(masters):
    """Note [masters down after the copies] (runtime/flat.py): with masters="last" (overlapped
    mode's where the jobs read the working copies the refresh writes) each chunk is refreshed
    while the host masters of the parameters stepped on the devices still hold the last step's
    values, and they come down after the last chunk, before the submission is done; with "each"
    they come down before each chunk's refresh. Note [masters kept on the devices]: with "kept"
    (delayed mode) they stay on the devices, the host's stale, until synchronize() brings them
    down, and a submission that fails brings them down too. Every way, after synchronize() the
    parameters are the user's optimizer's."""
    from rpcompile.runtime.optimizer import OverlappedOptimizer
    from test_flat_optimizer import _grads
    model, ref = _model(), _model()
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
    overlapped = OverlappedOptimizer(opt, state_devices=DEVICES, on_devices=1.0)
    overlapped.flatten(params, 1.0)

    def step_ref(grads):
        for r, g in zip(ref_params, grads):
            r.grad = g.clone()
        ref_opt.step()

    def equal_ref():
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    seen = []      # per chunk: whether its host masters had moved when it was refreshed
    for step in range(3):     # (the first step of a device part is made apart: Note [first step on the device])
        before = {id(p): p.detach().clone() for p in params}
        grads = _grads(params, step)
        seen.clear()
        overlapped.submit(params, lambda g=grads: list(g), lambda chunk: seen.extend(
            not torch.equal(p, before[id(p)]) for p in chunk), chunks=len(params), masters=masters)
        overlapped.drain()        # (the submission done, nothing brought down for it)
        moved = [not torch.equal(p, before[id(p)]) for p in params]
        assert overlapped.masters_away == (masters == "kept" and step > 0)
        assert moved == [masters != "kept" or step == 0] * len(params)
        overlapped.synchronize()
        assert not overlapped.masters_away
        step_ref(grads)
        equal_ref()
    assert overlapped.stepper._device_masters and len(seen) == len(params)
    assert seen == [masters == "each"] * len(params)
    # a submission that fails after a kept step brings the kept masters down, and steps nothing
    overlapped.submit(params, lambda g=_grads(params, 3): list(g), chunks=len(params), masters=masters)
    overlapped.drain()
    assert overlapped.masters_away == (masters == "kept")

    def fails():
        raise RuntimeError("no gradients")
    overlapped.submit(params, fails, chunks=len(params), masters=masters)
    overlapped.drain()
    assert not overlapped.masters_away
    step_ref(_grads(params, 3))
    equal_ref()      # (read before synchronize, which raises the failure)
    with pytest.raises(RuntimeError, match="no gradients"):
        overlapped.synchronize()


def test_the_devices_share_comes_out_of_each_jobs_budget():
    import rpcompile
    from models import lm_batch
    from rpcompile.passes.host_memory import device_optimizer_bytes
    model = _qwen()
    budget = 2**30
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                   optimizer_on_devices=1.0, memory_budget=budget))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
    cm.synchronize()
    kept = device_optimizer_bytes(list(model.parameters()), 1.0, 2)
    n = sum(p.numel() for p in model.parameters())
    # (at most every element: 12 B of masters and AdamW state, 8 B of slices widened and cast)
    assert 12 * n / 2 < kept <= 20 * n
    assert cm.plan.memory_budget == budget - kept


def test_a_budget_the_devices_share_crowds_says_so_and_what_to_set():
    """A memory_budget the jobs fit alone but not beside the devices' share of the optimizer:
    the PlanningError counts that share, says the budget to set with it (min_budget, which then
    trains) and to lower optimizer_on_devices; before anything runs."""
    import rpcompile
    from models import lm_batch
    from rpcompile.passes.host_memory import device_optimizer_bytes
    batch = lm_batch(batch=4, seq=8, vocab=256, seed=0)

    def compiled(**kw):
        model = _qwen()
        # (a fixed shard count: one graph whatever the budget, so the jobs need the same in each)
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       lm_head_shards=4, **kw))
        cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, cm

    model, probe = compiled(memory_budget=1)
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**batch)
    jobs_need = e.value.min_budget
    kept = device_optimizer_bytes(list(model.parameters()), 1.0, 2)
    budget = jobs_need + kept // 2            # the jobs alone fit; beside the share they do not
    _, cm = compiled(memory_budget=budget, optimizer_on_devices=1.0)
    with pytest.raises(rpcompile.PlanningError) as e:
        cm.train_step(**batch)
    msg = str(e.value)
    assert e.value.min_budget == jobs_need + kept
    assert "Config.optimizer_on_devices keeps there" in msg and "lower Config.optimizer_on_devices" in msg
    assert f"memory_budget={budget / 2**30:.2f} GiB per device" in msg
    _, cm = compiled(memory_budget=e.value.min_budget, optimizer_on_devices=1.0)
    cm.train_step(**batch)
    cm.synchronize()
    assert max(cm.plan.stage_plan.job_memory) <= cm.plan.memory_budget == jobs_need


def test_lm_head_shards_are_sized_by_the_jobs_budget(monkeypatch):
    """Note [shards by memory]: a shard's logits at most 1/SHARD_SHARE of what the stage jobs
    have, the devices' share of the optimizer left out: more shards beside it than without it."""
    import rpcompile
    from models import lm_batch
    from rpcompile.passes import lm_head
    from rpcompile.passes.host_memory import device_optimizer_bytes
    monkeypatch.setattr(lm_head, "SHARD_SHARE", 2048)
    shards = {}
    for share in (0.0, 1.0):
        model = _qwen()
        kept = device_optimizer_bytes(list(model.parameters()), 1.0, 2)
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       memory_budget=2 * kept, optimizer_on_devices=share))
        cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
        cm.synchronize()
        shards[share] = cm.plan.lm_head["K"]
    assert shards[1.0] > shards[0.0], shards


def test_share_by_room_is_the_largest_64th_that_fits_half_the_room():
    from rpcompile.passes.host_memory import ROOM_SHARE, device_optimizer_bytes, share_by_room
    params = list(_qwen(layers=2).parameters())
    n, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    smallest = (FlatMasters.BLOCK + largest) / (n / 2)      # a device's part at least what it may hold beyond it

    def need(share):
        return device_optimizer_bytes(params, share, 2)
    assert 0.5 < smallest < 0.75
    assert share_by_room(params, 2, 0) == 0.0 == share_by_room(params, 2, -5)
    assert share_by_room(params, 2, int(need(1.0) / ROOM_SHARE)) == 1.0
    room = int(need(0.8) / ROOM_SHARE)
    share = share_by_room(params, 2, room)
    assert smallest <= share <= 0.8 and need(share) <= ROOM_SHARE * room < need(share + 1 / 64)
    # room for a small share only: none (it would reserve more than it moves)
    assert share_by_room(params, 2, int(need(smallest - 1 / 64) / ROOM_SHARE)) == 0.0


def test_the_plan_chooses_the_share_and_a_plan_without_room_brings_it_home(monkeypatch):
    """Config.optimizer_on_devices=None (the default; on CPU devices only where a test lets it
    apply): the first train plan puts what fits in half its room on the devices and plans the
    jobs beside it; a longer sequence whose jobs do not fit beside it brings the state back to the
    host and plans without it; the shorter length keeps its plan. Losses and parameters equal a
    run with every update on the host all along (Note [optimizer share by room])."""
    import rpcompile
    from models import lm_batch
    from rpcompile import passes
    from rpcompile.passes.host_memory import device_optimizer_bytes
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")

    def compiled(**kw):
        model = _qwen()
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       lm_head_shards=4, **kw))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cm.attach_optimizer(opt)
        return model, cm, opt

    model, probe, _ = compiled(memory_budget=1, optimizer_on_devices=0.0)
    with pytest.raises(rpcompile.PlanningError) as e:
        probe.train_step(**lm_batch(batch=4, seq=256, vocab=256, seed=0))
    budget = e.value.min_budget + 1000                      # 256 tokens fit with nothing beside the jobs
    kept = device_optimizer_bytes(list(model.parameters()), 1.0, 2)
    runs = {}
    for share in (None, 0.0):
        model, cm, opt = compiled(memory_budget=budget, optimizer_on_devices=share)
        losses = []
        for t, seq in enumerate((8, 8, 256, 8, 256)):
            losses.append(float(cm.train_step(**lm_batch(batch=4, seq=seq, vocab=256, seed=t))))
            if share is None and t == 1:
                cm.synchronize()
                plan, masters = cm.plan, cm.runner.overlapped.masters
                assert plan.optimizer_share == 1.0 == cm.runner.optimizer_share
                assert plan.memory_budget == budget - kept and max(plan.stage_plan.job_memory) <= plan.memory_budget
                assert masters.on_devices and cm.runner.overlapped.stepper._device_masters
                assert "a share of 1" in str(plan)
                short_plan = plan
        cm.synchronize()
        runs[share] = (losses, [p.detach().clone() for p in model.parameters()], model, cm, opt)
    (l_auto, p_auto, model, cm, opt), (l_host, p_host, _, _, _) = runs[None], runs[0.0]
    assert l_auto == pytest.approx(l_host, rel=1e-6)
    for a, b in zip(p_auto, p_host):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the long plan has the whole budget; the state is home, one host buffer under the user's entries
    assert cm.plan.optimizer_share == 0.0 == cm.runner.optimizer_share and cm.plan.memory_budget == budget
    assert not cm.runner.overlapped.masters.on_devices and not cm.runner.overlapped.stepper._device_masters
    bufs = {opt.state[p]["momentum_buffer"].untyped_storage().data_ptr() for p in model.parameters() if p.numel() > 1}
    assert len(bufs) == 1
    assert short_plan in cm._plans.plans() and len(cm._plans.plans()) == 2


def test_where_the_host_would_set_the_pace_the_plan_takes_a_share_and_re_cuts_the_jobs(monkeypatch):
    """Note [optimizer share by pace]: a budget the jobs fill, leaving no room for a share; where
    the host's update keeps up with the jobs the plan keeps it there; where it would set the pace
    (a host made slow here) the plan puts all of it on the devices (where that does not fit, the
    share that keeps up) and cuts the jobs again beside what it reserves, and says so. Losses and parameters equal those of every update on the host."""
    import importlib
    import rpcompile
    from models import lm_batch
    from rpcompile import passes
    from rpcompile.passes.host_memory import device_optimizer_bytes
    host_memory = importlib.import_module("rpcompile.passes.host_memory")
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")

    def run(budget, share=None, steps=3):
        model = _qwen(layers=2)
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       memory_budget=budget, optimizer_on_devices=share))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        losses = [float(cm.train_step(**lm_batch(batch=4, seq=64, vocab=256, seed=t))) for t in range(steps)]
        cm.synchronize()
        return cm, losses, [p.detach().clone() for p in model.parameters()]

    with pytest.raises(rpcompile.PlanningError) as e:
        run(1, share=0.0, steps=1)
    shape = list(_qwen(layers=2).parameters())      # (the parameters every run's model has)
    kept = device_optimizer_bytes(shape, 1.0, 2)
    budget = e.value.min_budget + kept        # (the jobs planned alone take more than half of the rest)
    fast, _, _ = run(budget)
    assert fast.plan.optimizer_share == 0.0 and fast.plan.memory_budget == budget
    assert 0 < fast.plan.optimizer_est_s < fast.plan.est_step_time
    # slower than the jobs, within the margin: the figures are too rough to re-cut by
    numel = sum(p.numel() for p in shape if p.numel() > 1)
    monkeypatch.setattr(host_memory, "HOST_UPDATE_S", 1.1 * fast.plan.est_step_time / numel)
    close, _, _ = run(budget, steps=1)
    assert close.plan.optimizer_share == 0.0 and close.plan.optimizer_est_s > close.plan.est_step_time
    # a host four times as slow as the jobs, which a share of about three quarters would keep up
    # with: the plan takes the whole (measured the faster: Note [optimizer share by pace]) where it
    # fits, and the share that keeps up where the whole does not fit beside the jobs
    monkeypatch.setattr(host_memory, "HOST_UPDATE_S", 4 * fast.plan.est_step_time / numel)
    shares = host_memory.pace_shares(shape, 2, fast.plan.est_step_time, 0.0)
    assert shares[0] == 1.0 and 0.75 < shares[1] < 0.85
    whole, _, _ = run(budget, steps=1)
    assert whole.plan.optimizer_share == 1.0 and whole.plan.memory_budget == budget - kept
    tight = e.value.min_budget + device_optimizer_bytes(shape, 0.9, 2)
    part, _, _ = run(tight, steps=1)
    assert part.plan.optimizer_share == shares[1] == part.runner.optimizer_share
    assert part.plan.memory_budget == tight - device_optimizer_bytes(shape, shares[1], 2)
    monkeypatch.setattr(host_memory, "HOST_UPDATE_S", 1.0)      # a second an element: the host sets the pace
    cm, losses, params = run(budget)
    plan = cm.plan
    assert plan.optimizer_share == 1.0 == cm.runner.optimizer_share and plan.memory_budget == budget - kept
    assert max(plan.stage_plan.job_memory) <= plan.memory_budget < max(fast.plan.stage_plan.job_memory)
    assert plan.optimizer_est_s == pytest.approx(sum(p.numel() for p in params if p.numel() > 1)
                                                 * host_memory.DEVICE_UPDATE_S)
    assert "the optimizer's update" in str(plan) and "a share of 1 on the devices" in str(plan)
    assert cm.runner.overlapped.masters.on_devices
    _, host_losses, host_params = run(budget, share=0.0)
    assert losses == pytest.approx(host_losses, rel=1e-6)
    for a, b in zip(params, host_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # a forward call's plan, first, costs no train step: the room's share, which later plans keep
    # (room for the whole share beside the call's jobs, which the pace would take)
    def call_first(budget, share=None):
        model = _qwen(layers=2)
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       memory_budget=budget, optimizer_on_devices=share))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        with torch.no_grad():
            cm(**lm_batch(batch=4, seq=64, vocab=256, seed=0))
        return cm
    with pytest.raises(rpcompile.PlanningError) as e:
        call_first(1, share=0.0)
    first_budget = e.value.min_budget + kept + 20_000
    first = call_first(first_budget)
    assert first.plan.mode == "call" and first.plan.optimizer_share == first.runner.optimizer_share < 1.0
    # Note [a call's share chosen again]: the first train plan chooses by the pace (the whole), and
    # the call's plan, made beside less, is planned again beside it at the next call
    losses = [float(first.train_step(**lm_batch(batch=4, seq=64, vocab=256, seed=t))) for t in range(3)]
    first.synchronize()
    assert first.plan.mode == "train" and first.plan.optimizer_share == 1.0 == first.runner.optimizer_share
    assert first.plan.memory_budget == first_budget - kept and first.runner.overlapped.masters.on_devices
    with torch.no_grad():
        first(**lm_batch(batch=4, seq=64, vocab=256, seed=0))
    assert first.plan.mode == "call" and first.plan.optimizer_share == 1.0
    assert first.plan.memory_budget == first_budget - kept
    _, set_losses, set_params = run(first_budget, share=1.0)
    assert losses == pytest.approx(set_losses, rel=1e-6)
    for a, b in zip(first.model.parameters(), set_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_forward_calls_plan_chooses_the_share_when_it_comes_first(monkeypatch):
    """The model's first plan chooses the share, a forward call's too; the train plan after it
    reserves the same, and the optimizer is placed so."""
    import rpcompile
    from models import lm_batch
    from rpcompile import passes
    from rpcompile.passes.host_memory import device_optimizer_bytes
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")
    model = _qwen()
    budget = 2**26
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                   memory_budget=budget))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    batch = lm_batch(batch=4, seq=8, vocab=256, seed=0)
    with torch.no_grad():
        cm(**batch)
    kept = device_optimizer_bytes(list(model.parameters()), 1.0, 2)
    assert cm.plan.mode == "call" and cm.plan.optimizer_share == 1.0 and cm.plan.memory_budget == budget - kept
    assert cm.runner.optimizer_share == 1.0          # chosen for the model: every later plan reserves it
    cm.train_step(**batch)
    cm.synchronize()
    assert cm.plan.mode == "train" and cm.plan.optimizer_share == 1.0 == cm.runner.optimizer_share
    assert cm.plan.memory_budget == budget - kept and cm.runner.overlapped.masters.on_devices


def test_an_optimizer_stepped_per_parameter_gets_no_share(monkeypatch):
    """An optimizer the flat stepper cannot step on a device (not Adam, AdamW or SGD) is stepped
    per parameter on the host: the plan reserves nothing for it."""
    import rpcompile
    from models import lm_batch
    from rpcompile import passes
    monkeypatch.setattr(passes, "_share_by_room_applies", lambda st: st.config.optimizer_mode != "exact")
    for make, share in ((lambda ps: torch.optim.Adagrad(ps, lr=0.1), 0.0),
                        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1.0)):
        model = _qwen()
        cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                       memory_budget=2**26))
        cm.attach_optimizer(make(model.parameters()))
        cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
        cm.synchronize()
        assert cm.plan.optimizer_share == share == cm.runner.optimizer_share
        assert bool(cm.runner.overlapped.masters.on_devices) == bool(share)


def test_the_default_share_is_chosen_on_gpus_only():
    """On CPU devices, in exact mode and for a call's plan, the default chooses nothing."""
    import rpcompile
    from models import lm_batch
    model = _qwen()
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, optimizer_mode="delayed",
                                                   memory_budget=2**30))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=0))
    cm.synchronize()
    assert rpcompile.Config().optimizer_on_devices is None
    assert cm.plan.optimizer_share == 0.0 == cm.runner.optimizer_share and cm.plan.memory_budget == 2**30
    assert not cm.runner.overlapped.masters.on_devices


@pytest.mark.parametrize("kw, says", [
    (dict(optimizer_on_devices=1.5), "a number from 0 to 1"),
    (dict(optimizer_on_devices="auto"), "a number from 0 to 1"),
    (dict(optimizer_on_devices=True), "a number from 0 to 1"),
    (dict(optimizer_on_devices=0.5), "needs optimizer_mode='overlapped' or 'delayed'"),
])
def test_config_says_what_is_wrong(kw, says):
    import rpcompile
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        rpcompile.Config(devices=DEVICES, **kw)


def test_host_bytes_are_what_the_plan_says():
    """bf16 gradients: the host widens no slice of the devices' share, stages none either (they
    go up from the gradient set: Note [gradients page-locked in the main process]), and holds
    the optimizer state of the rest only."""
    import rpcompile
    from models import lm_batch
    model = _qwen()
    cm = rpcompile.compile(model, rpcompile.Config(devices=DEVICES, num_microbatches=2, dtype=torch.bfloat16,
                                                   optimizer_mode="delayed", optimizer_on_devices=0.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cm.attach_optimizer(opt)
    for t in range(3):
        cm.train_step(**lm_batch(batch=4, seq=8, vocab=256, seed=t))
    cm.synchronize()
    planned, allocated = cm.plan.host_memory, cm.host_buffer_bytes()
    largest = max(p.numel() for p in model.parameters())
    assert set(allocated) == {"working copies", "gradients", "gradient rows carried to a later chunk",
                              "gradient slices widened for the optimizer"}
    assert [kind for kind, _ in planned.rows() if "staged" in kind] == []
    masters = cm.runner.overlapped.masters
    on_dev = sum(b - a for rs in masters.on_devices.values() for a, b, _ in rs)
    n = sum(p.numel() for p in model.parameters())
    assert abs(on_dev - n / 2) <= largest
    stepper = cm.runner.overlapped.stepper
    host_state = sum(b.numel() * b.element_size() for (_, _, where), b in stepper._state_bufs.items() if where is None)
    dev_state = sum(b.numel() * b.element_size() for (_, _, where), b in stepper._state_bufs.items() if where is not None)
    assert dev_state == 8 * on_dev and abs(host_state - planned.optimizer_state) <= 8 * largest


@pytest.mark.parametrize("failing", ["spans", "__init__"])
def test_a_trace_that_cannot_be_read_fails_no_step(monkeypatch, failing):
    """Note [optimizer spans]: the spans are an instrument; a failure to make or read them is
    kept in trace_error, and the submissions step as the user's optimizer does."""
    from rpcompile.runtime.optimizer import OverlappedOptimizer
    from rpcompile.runtime.trace import Tracer
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    overlapped = OverlappedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), state_devices=DEVICES)
    overlapped.flatten(params, 1.0)
    overlapped.trace = True
    monkeypatch.setattr(Tracer, failing, lambda self, *a, **k: 1 / 0)
    for t in range(2):    # (the first step made on the devices, the second a run stepped there)
        grads = [torch.randn(300) for _ in params]
        overlapped.submit(params, lambda grads=grads: [g.clone() for g in grads])
        overlapped.synchronize()
        for q, g in zip(ref, grads):
            q.grad = g.clone()
        ref_opt.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach())
    assert overlapped.device_spans == [] and overlapped.trace_error.startswith("ZeroDivisionError")
