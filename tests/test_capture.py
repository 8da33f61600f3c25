"""Capture: what stops plain fullgraph dynamo must not stop rpcompile where it need not (log calls,
warnings, print), the copies the model is traced on behave like the device that runs it, and a
capture error says where it stopped and what to change."""
import logging
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile.capture import capture_call

from models import GraphBreak
from parity import TIGHT, scalar_loss_step, train_both, xy_batches

log = logging.getLogger("test_capture")


class Chatty(nn.Module):
    """Logs, warns and prints in forward, as library code does (transformers' loss_function logs
    with logger.warning_once)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, y):
        log.warning("forward of %s", type(self).__name__)
        logging.info("module-level logging")
        for layer in self.layers:
            x = torch.tanh(layer(x))
        warnings.warn("a warning inside forward", UserWarning)
        print("print inside forward", x.shape)
        return F.mse_loss(x, y)


def test_log_calls_warnings_and_print_do_not_stop_capture():
    batches = xy_batches(5, 8, seed=0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_both(Chatty(), batches, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3),
                   eager_step=scalar_loss_step)


def test_plain_fullgraph_dynamo_stops_at_the_same_log_call():
    """The case above is one plain torch.compile(fullgraph=True) cannot capture (so the test
    above tests something): dynamo's default is a graph break at a Logger method. (GPT-2 in
    test_zoo.py: transformers' loss_function calls logger.warning_once.)"""
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="[Ll]ogg"):
        torch.compile(Chatty(), fullgraph=True, backend="eager")(torch.randn(2, 8), torch.randn(2, 8))


class DeviceBranch(nn.Module):
    """Takes a different path on CPU than elsewhere, as transformers' MoE layers do (histc has no
    CPU kernel for integers, so they count tokens per expert in float on CPU)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, ids):
        h = self.lin(x)
        dtype = torch.float32 if h.device.type == "cpu" else torch.int32
        counts = torch.histc(ids.to(dtype), bins=4, min=0, max=3)
        return (h.sum(-1) * counts.sum()).mean()


def test_copies_report_the_device_that_runs_the_stages():
    x, ids = torch.randn(3, 4), torch.randint(0, 4, (3,))
    cap = capture_call(DeviceBranch(), (x, ids), {}, dtype=None, device="cpu")
    casts = [n for n in cap.gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert casts and casts[0].args[1] == torch.float32
    assert cap.capture_device == torch.device("cpu") and cap.on_copies
    # (one microbatch: each row reads the count over the whole batch, Note [rows kept apart])
    cm = rpcompile.compile(DeviceBranch(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1))
    ids = torch.randint(0, 4, (5,))
    x = torch.randn(5, 4)
    cm.train_step(x, ids)      # the CPU has no histc for int32: this fails if traced on another device


def test_capture_keeps_no_parameter_memory():
    """The copies are fake: capturing does not allocate the model's parameters again."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    cap = capture_call(model, (torch.randn(2, 256),), {}, dtype=torch.bfloat16, device="cpu")
    evs = [n.meta["example_value"] for n in cap.placeholders() if n.meta.get("rp_kind") == "param"]
    from torch._subclasses.fake_tensor import is_fake
    assert len(evs) == 8 and all(is_fake(e) and e.dtype == torch.bfloat16 for e in evs)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


class ListIndex(nn.Module):
    """Falcon's rotary code indexes with a Python list (x[..., [-2], :])."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x).view(x.shape[0], 2, 4)
        h = h[..., [-2], :].expand(-1, 2, -1).reshape(x.shape[0], 8)
        return F.mse_loss(h, y)


def test_list_indexing_captures():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    cm = rpcompile.compile(ListIndex(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    model = cm.model
    assert torch.allclose(cm.train_step(x, y), model(x, y), rtol=1e-5)


# --- errors --------------------------------------------------------------------------------


def test_error_in_user_code_names_the_line():
    cm = rpcompile.compile(GraphBreak())
    with pytest.raises(rpcompile.CaptureError) as e:
        cm.train_step(torch.randn(3, 4))
    msg = str(e.value)
    line = GraphBreak.forward.__code__.co_firstlineno + 2
    where = GraphBreak.forward.__code__.co_filename
    assert f"It stopped in your code, at {where}:{line} in forward()" in msg
    assert "if h.sum().item() > 0" in msg.splitlines()[-1]
    assert "Change that line" in msg and "inside" not in msg.splitlines()[-1]


def test_error_in_a_library_says_so_and_names_the_callers_line(tmp_path, monkeypatch):
    lib = tmp_path / "site-packages" / "somelib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(textwrap.dedent("""
        def helper(h):
            if h.sum().item() > 0:
                return h * 2
            return h
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    import somelib

    class UsesLib(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return somelib.helper(self.lin(x)).sum()

    cm = rpcompile.compile(UsesLib())
    with pytest.raises(rpcompile.CaptureError) as e:
        cm.train_step(torch.randn(3, 4))
    hint = str(e.value).splitlines()[-1]
    sys.modules.pop("somelib", None)
    assert f"It stopped inside somelib, not in your code, at {lib / '__init__.py'}:3 in helper()" in hint
    assert f"reached from your code at {__file__}:" in hint and "somelib.helper(self.lin(x))" in hint
    assert "fullgraph=True" in hint and "report" in hint


def test_a_module_built_in_forward_is_named_where_it_is_built():
    """A module built in forward stopped dynamo at the nn.Parameter of nn.Linear's __init__: the
    error named torch's linear.py and called it torch's bug (Note [modules built in forward])."""
    class Builds(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            extra = nn.Linear(4, 4)
            return extra(self.lin(x)).sum()

    cm = rpcompile.compile(Builds())
    with pytest.raises(rpcompile.CaptureError) as e:
        cm.train_step(torch.randn(3, 4))
    msg = str(e.value)
    assert f"builds a module in its forward, at {__file__}:" in msg and "extra = nn.Linear(4, 4)" in msg
    assert "in your code" in msg and "Build modules in __init__" in msg and "linear.py" not in msg


def test_bigbirds_switch_of_attention_is_named_and_trains_once_made():
    """BigBird's block-sparse attention on rows too short for it builds full-attention modules in
    forward (the model sweep's refusal): the error names transformers' line and the ways out; the
    model trains as eager once the switch is made by an eager call, as the error says."""
    from transformers import BigBirdConfig, BigBirdForCausalLM
    from zoo import VOCAB, lm_batch
    torch.manual_seed(0)
    model = BigBirdForCausalLM(BigBirdConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, is_decoder=True, attention_type="block_sparse", block_size=2,
        num_random_blocks=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, sep_token_id=1))
    cfg = rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2)
    with pytest.raises(rpcompile.CaptureError) as e:
        rpcompile.compile(model, cfg)(**lm_batch(0))
    msg = str(e.value)
    assert "modeling_big_bird.py" in msg and "in set_attention_type()" in msg and "the code of transformers" in msg
    assert "attention_type='original_full'" in msg and "eager call" in msg
    with torch.no_grad():
        model(**lm_batch(0))
    assert model.bert.attention_type == "original_full"
    train_both(model, [lm_batch(s) for s in range(2)], cfg, steps=2)


class VmapScan(nn.Module):
    """torch.vmap inside forward (as Mamba's parallel scan): each layer combines pairs of rows
    with a vmapped function."""

    def __init__(self, d=8, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            h = layer(x)
            pairs = torch.stack([h, torch.roll(h, 1, dims=-1)])           # (2, rows, d)
            h = torch.vmap(lambda a, b: a * torch.sigmoid(b), in_dims=(1, 1))(pairs, pairs.flip(0))
            x = x + torch.tanh(h.sum(1))
        return F.mse_loss(x, y)


def test_vmap_inside_forward_trains_and_no_stage_splits_a_vmap():
    from rpcompile.passes.cut_points import liveness
    from rpcompile.passes.graph_utils import FUNCTORCH_ENTER, FUNCTORCH_LEAVE

    batches = xy_batches(5, 8, seed=0)

    from parity import TIGHT
    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=3, memory_budget=TIGHT)
    cm = train_both(VmapScan(), batches, cfg, eager_step=scalar_loss_step, min_stages=3)
    lv = liveness(cm.plan.gm)
    enters = [lv.index[n] for n in lv.body if n.target in FUNCTORCH_ENTER]
    leaves = [lv.index[n] for n in lv.body if n.target in FUNCTORCH_LEAVE]
    assert len(enters) == len(leaves) == 4
    for a, b in zip(enters, leaves):
        assert not any(a < c <= b for c in cm.plan.cuts)


def test_capture_silences_dynamos_metrics_log_only_while_capturing():
    """torch 2.11 logs an exception for every capture while it records its compile metrics (it
    sorts the set of ignored logging functions): the capture switches that logger off, then back."""
    import logging

    from rpcompile.capture import _capture_config

    log = logging.getLogger("torch._dynamo.metrics_context")
    assert not log.disabled
    with _capture_config():
        assert log.disabled
    assert not log.disabled


class Counting(nn.Module):
    """Counts its calls in an attribute: a side effect dynamo replays after the capture."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x).sum()


@pytest.mark.parametrize("policy, logged, seen", [("info", False, "silent"), ("warn", False, "warn"),
                                                  ("info", True, "info")])
def test_a_capture_keeps_no_side_effect_messages_no_one_reads(monkeypatch, policy, logged, seen):
    """Note [side effects unlogged]: under dynamo's default policy a capture records no user stacks
    for its side-effect log messages; a policy the user chose, or TORCH_LOGS="side_effects", is
    kept. The side effect itself is replayed as before, and the policy is back after the capture."""
    from torch._dynamo import side_effects
    policies = []
    real = side_effects.SideEffects._capture_user_stack

    def capture_user_stack(self, key):
        policies.append(torch._dynamo.config.side_effect_replay_policy)
        return real(self, key)
    monkeypatch.setattr(side_effects.SideEffects, "_capture_user_stack", capture_user_stack)
    if logged:
        torch._logging.set_logs(side_effects=True)
    # (config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes a module attribute it did not
    # find in the module's __dict__, and a deleted torch config entry stays hidden for the process)
    try:
        with torch._dynamo.config.patch(side_effect_replay_policy=policy):
            model = Counting()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # (the "warn" policy's own warning)
                capture_call(model, (torch.randn(4, 8),), {}, dtype=torch.float32)
            after = torch._dynamo.config.side_effect_replay_policy
    finally:
        if logged:
            torch._logging.set_logs()
    assert policies and set(policies) == {seen}
    assert model.calls == 1 and after == policy


def test_a_model_with_its_own_gradient_checkpointing_trains_as_eager():
    """Note [model's own checkpointing] (capture.py): with transformers' gradient checkpointing on,
    the capture was a CaptureError ("HOP: Unsafe side effect") that did not name it. The layers
    are traced without it (rpcompile recomputes on its own); eager runs with it; the flags stay on."""
    from models import checkpointing_on, lm_batch, qwen3
    model = qwen3(layers=2)
    checkpointing_on(model)
    train_both(model, [lm_batch(seed=s) for s in range(2)], rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2),
               steps=2)                                   # (and at least 2 stage jobs)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


class _FilledInPlace(nn.Module):
    """A block that fills a new_empty buffer by copy_ (as DeepSeek-V3's attention builds its keys)."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        out = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])
        out[..., :x.shape[-1]].copy_(self.a(x))
        out[..., x.shape[-1]:].copy_(self.b(x))
        return out[..., :x.shape[-1]] + out[..., x.shape[-1]:]


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_FilledInPlace() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.cross_entropy(self.head(x), y)


def test_in_place_writes_inside_a_checkpointed_block_are_kept():
    """Note [dead code in bodies] (passes/graph_utils.py): the dead-code pass dropped the copy_
    calls inside a torch.utils.checkpoint body (torch's recursion used its own purity test), so the
    block read uninitialised memory: loss 8.7e32 against eager's 1.33 (checked). The checkpointed
    blocks are costed (Note [bodies of higher-order ops] in passes/cost.py: 0 FLOPs before)."""
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))} for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = train_both(_Checkpointed(), batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2,
                                                                    memory_budget=TIGHT),
                        eager_step=scalar_loss_step, steps=2)
    assert not [w for w in caught if "could not measure" in str(w.message)]
    blocks = [n for n in cm.plan.gm.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    assert len(blocks) == 2 and all(n.meta["rp_cost"].fwd_flops != 0 for n in blocks)


def test_a_tensor_cached_in_a_plain_attribute_is_not_left_fake():
    """Note [plain tensor attributes kept]: longrope RoPE caches its long frequencies in a plain
    attribute at the first call; the capture left the meta tensor there, and the model's next
    eager call, and rpcompile's next capture (a new length), failed ("Cannot copy out of meta
    tensor"). Calls at two lengths, across original_max_position_embeddings, equal eager's."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from zoo import phi3_longrope
    torch.manual_seed(0)
    model = phi3_longrope()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    rotary = model.model.rotary_emb
    for seq in (8, 3, 12):
        ids = torch.randint(0, 64, (4, seq))
        with torch.no_grad():
            got = cm(input_ids=ids).logits
            assert not any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in vars(rotary).values())
            torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
