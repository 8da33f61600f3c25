"""Tests of the cost annotation pass (rpcompile/passes/cost.py)."""

import warnings

import pytest
import sympy
import torch
import torch.nn as nn

from rpcompile.passes.cost import (
    Hardware,
    NodeCost,
    annotate_costs,
    evaluate,
    flop_counter_mode,
    graph_symbols,
    node_seconds,
)
from torch.utils.flop_counter import FlopCounterMode, flop_registry


def capture(fn, *args, dynamic_batch=True, **kwargs):
    got = {}

    def backend(gm, example_inputs):
        got["gm"] = gm
        return gm.forward

    for t in args + tuple(kwargs.values()):
        if isinstance(t, torch.Tensor) and dynamic_batch:
            torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return got["gm"]


def calls(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def by_name(gm):
    return {n.name: n for n in gm.graph.nodes}


def nbytes(t):
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------- MLP

D_IN, D_HID, D_OUT = 16, 32, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp_gm():
    torch.manual_seed(0)
    return annotate_costs(capture(MLP(), torch.randn(4, D_IN)))


def _linears(gm):
    lins = [n for n in calls(gm) if n.target is torch._C._nn.linear]
    assert len(lins) == 2
    return lins


def test_mlp_linear_flops_symbolic(mlp_gm):
    syms = graph_symbols(mlp_gm)
    assert len(syms) == 1
    (B,) = syms.values()
    fc1, fc2 = _linears(mlp_gm)
    c2 = fc2.meta["rp_cost"]
    assert isinstance(c2, NodeCost)
    assert sympy.simplify(c2.fwd_flops - 2 * B * D_HID * D_OUT) == 0
    # the input of fc2 requires grad: backward = grad input + grad weight = 2x forward
    assert sympy.simplify(c2.bwd_flops - 2 * c2.fwd_flops) == 0
    assert evaluate(c2.fwd_flops, {B: 5}) == 2 * 5 * D_HID * D_OUT
    assert evaluate(c2.fwd_flops, {B.name: 5}) == 2 * 5 * D_HID * D_OUT
    assert evaluate(c2.bwd_flops, {B: 5}) == 4 * 5 * D_HID * D_OUT
    # fc1 reads the user input, which needs no gradient: only the weight gradient (1x)
    c1 = fc1.meta["rp_cost"]
    assert sympy.simplify(c1.fwd_flops - 2 * B * D_IN * D_HID) == 0
    assert sympy.simplify(c1.bwd_flops - c1.fwd_flops) == 0


def test_mlp_bytes(mlp_gm):
    (B,) = graph_symbols(mlp_gm).values()
    fc1, fc2 = _linears(mlp_gm)
    c1, c2 = fc1.meta["rp_cost"], fc2.meta["rp_cost"]
    assert c1.param_bytes == 4 * (D_IN * D_HID + D_HID)  # weight + bias
    assert c2.param_bytes == 4 * (D_HID * D_OUT + D_OUT)
    assert sympy.simplify(c2.out_bytes - 4 * B * D_OUT) == 0
    # a linear saves its input activation (the weight is a parameter, not counted)
    assert sympy.simplify(c1.saved_bytes - 4 * B * D_IN) == 0
    assert sympy.simplify(c2.saved_bytes - 4 * B * D_HID) == 0
    relu = next(n for n in calls(mlp_gm) if n.target is torch.relu)
    assert relu.meta["rp_cost"].fwd_flops == 0 and relu.meta["rp_cost"].bwd_flops == 0
    assert sympy.simplify(relu.meta["rp_cost"].saved_bytes - 4 * B * D_HID) == 0  # relu saves its output
    # ... which are values of the graph: fc2 saves relu's output, relu its own (Note [saved values once])
    (value, nbytes), = c2.saved_values
    assert value == (relu.name, 0) and sympy.simplify(nbytes - 4 * B * D_HID) == 0
    assert [v for v, _ in relu.meta["rp_cost"].saved_values] == [(relu.name, 0)]
    assert c1.saved_values[0][0][0] == fc1.args[0].name


def test_every_call_node_costed(mlp_gm):
    for n in calls(mlp_gm):
        c = n.meta["rp_cost"]
        for f in ("fwd_flops", "bwd_flops", "param_bytes", "out_bytes", "saved_bytes"):
            assert isinstance(getattr(c, f), sympy.Expr), (n.name, f)
    for n in mlp_gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            assert "rp_cost" not in n.meta


class _FrozenTop(nn.Module):
    """fc1 trains, fc2 is frozen: a gradient flows through fc2's input only (as through a LoRA
    base layer); fc0 is trainable and reads the user input, which needs no gradient."""
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(D_IN, D_IN, bias=False)
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT).requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.fc0(x))))


def test_linears_on_3d_inputs_of_symbolic_sizes_past_a_frozen_weight():
    """Note [linear on rows]: on torch 2.11 the frozen fc2 on a (batch, seq, d) input failed to
    measure and was costed 0 FLOPs (with a warning)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, D_IN)
    torch._dynamo.mark_dynamic(x, 1)
    gm = capture(_FrozenTop(), x)
    for n in gm.graph.find_nodes(op="placeholder"):   # as capture marks them: frozen is a param
        ev = n.meta["example_value"]
        n.meta["rp_kind"] = ("sym" if not isinstance(ev, torch.Tensor)
                             else "param" if "parameters" in n.name else "input")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        annotate_costs(gm)
    syms = graph_symbols(gm)
    assert len(syms) == 2
    rows = sympy.Mul(*syms.values())
    fc0, fc1, fc2 = [n for n in calls(gm) if n.target is torch._C._nn.linear]
    c0, c1, c2 = (n.meta["rp_cost"] for n in (fc0, fc1, fc2))
    assert sympy.simplify(c2.fwd_flops - 2 * rows * D_HID * D_OUT) == 0
    assert sympy.simplify(c2.bwd_flops - c2.fwd_flops) == 0      # the input's gradient alone
    assert c2.saved_bytes == 0 and c2.saved_values == ()         # a frozen weight needs no input
    assert sympy.simplify(c1.bwd_flops - 2 * c1.fwd_flops) == 0
    assert sympy.simplify(c0.fwd_flops - 2 * rows * D_IN * D_IN) == 0
    assert sympy.simplify(c0.bwd_flops - c0.fwd_flops) == 0      # the weight's gradient alone
    (value, saved), = c0.saved_values                            # its input, by the input's name
    assert value == (fc0.args[0].name, 0) and sympy.simplify(saved - 4 * rows * D_IN) == 0
    assert [tuple(fc0.meta["example_value"].shape)[-1], fc0.meta["example_value"].dim()] == [D_IN, 3]


def test_rp_kind_is_respected():
    torch.manual_seed(0)
    gm = capture(MLP(), torch.randn(4, D_IN))
    for n in gm.graph.find_nodes(op="placeholder"):
        ev = n.meta["example_value"]
        if not isinstance(ev, torch.Tensor):
            n.meta["rp_kind"] = "sym"
        elif "fc1" in n.name:
            n.meta["rp_kind"] = "buffer"  # frozen: no gradient, not a parameter read
        elif "parameters" in n.name:
            n.meta["rp_kind"] = "param"
        else:
            n.meta["rp_kind"] = "input"
    annotate_costs(gm)
    fc1, fc2 = _linears(gm)
    c1, c2 = fc1.meta["rp_cost"], fc2.meta["rp_cost"]
    assert c1.param_bytes == 0 and c1.bwd_flops == 0 and not c1.requires_grad
    assert c1.saved_bytes == 0
    assert c2.param_bytes == 4 * (D_HID * D_OUT + D_OUT)
    assert sympy.simplify(c2.bwd_flops - c2.fwd_flops) == 0  # weight gradient only


class Sliced(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_HID, D_IN))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w[:8])


def test_rp_requires_grad_and_param_slice():
    gm = capture(Sliced(), torch.randn(4, D_IN))
    (w,) = [n for n in gm.graph.find_nodes(op="placeholder") if "parameters" in n.name]
    (x,) = [n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("l_x")]
    x.meta["rp_requires_grad"] = True  # the capture says the user's input requires grad
    (sl,) = w.users
    sl.meta["rp_param_slice"] = (w.name, 0, 0, 8)  # as split_lm_head marks a weight shard
    annotate_costs(gm)
    lin = next(n for n in calls(gm) if n.target is torch._C._nn.linear)
    assert sl.meta["rp_cost"].param_bytes == 4 * 8 * D_IN and sl.meta["rp_cost"].is_view
    c = lin.meta["rp_cost"]
    assert c.param_bytes == 0  # it reads the slice, not the placeholder
    assert sympy.simplify(c.bwd_flops - 2 * c.fwd_flops) == 0  # grad of x and of the weight


def test_annotate_inside_backend():
    got = {}

    def backend(gm, example_inputs):
        got["gm"] = annotate_costs(gm)
        return gm.forward

    x = torch.randn(4, D_IN)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    f = torch.compile(MLP(), backend=backend, fullgraph=True)
    f(x)
    fc1, fc2 = _linears(got["gm"])
    (B,) = graph_symbols(got["gm"]).values()
    assert sympy.simplify(fc2.meta["rp_cost"].fwd_flops - 2 * B * D_HID * D_OUT) == 0
    # annotating added no guard that would specialise the batch size: no recompile
    got.clear()
    f(torch.randn(7, D_IN))
    assert not got


class Regions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x):
        with torch.no_grad():
            frozen = self.fc1(x)
        h = self.fc1(x) + frozen
        h.add_(1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.fc2(h)
        return out.float().sum()


def test_grad_mode_autocast_and_in_place():
    gm = annotate_costs(capture(Regions(), torch.randn(4, D_IN)))
    (B,) = graph_symbols(gm).values()
    lin = [n for n in calls(gm) if n.target is torch._C._nn.linear]
    no_grad, trained, amp = (n.meta["rp_cost"] for n in lin)
    assert no_grad.bwd_flops == 0 and no_grad.saved_bytes == 0 and not no_grad.requires_grad
    assert sympy.simplify(trained.bwd_flops - trained.fwd_flops) == 0
    # under autocast the linear saves bf16 casts of its input and of its weight
    assert sympy.simplify(amp.saved_bytes - (2 * B * D_HID + 2 * D_HID * D_OUT)) == 0
    add_ = next(n for n in calls(gm) if n.target == "add_")
    assert not add_.meta["rp_cost"].is_view and add_.meta["rp_cost"].requires_grad
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def test_grouped_query_attention_counts_every_query_head():
    """Note [grouped-query attention FLOPs]: SDPA with 2 key/value heads serving 4 query heads
    (enable_gqa) costs, forward and backward, what it costs with the key and value repeated to 4
    heads (torch 2.11's formulas asserted equal head counts: the op could not be measured)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    kv = [torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(2)]

    def count(*qkv, **kw):
        with flop_counter_mode() as fwd:
            out = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, **kw)
        with flop_counter_mode() as bwd:
            out.sum().backward()
        return fwd.get_total_flops(), bwd.get_total_flops()
    grouped = count(q, *kv, enable_gqa=True)
    assert grouped[0] > 0 and grouped == count(q, *(t.repeat_interleave(2, dim=1) for t in kv))


@torch.library.custom_op("rpcompile_tests::looped_mm", mutates_args=())
def _looped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x's rows by groups (ends in offs), group g times w[g]: transformers 5.17's grouped_mm_fallback."""
    out, start = x.new_empty(x.shape[0], w.shape[-1]), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


_looped_mm.register_fake(lambda x, w, offs: x.new_empty(x.shape[0], w.shape[-1]))


def _looped_mm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for g, end in enumerate(ctx.offs.tolist()):      # (data-dependent: fake tensors cannot run it)
        if start == end:
            continue
        gx[start:end], gw[g] = grad[start:end] @ w[g].T, x[start:end].T @ grad[start:end]
        start = end
    return gx, gw, None


def _looped_mm_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


_looped_mm.register_autograd(_looped_mm_backward, setup_context=_looped_mm_context)


def test_an_op_whose_backward_cannot_run_on_fakes_keeps_its_forward_flops(monkeypatch):
    """Note [a backward that cannot run on fakes]: a grouped matmul whose backward loops over its
    offsets (as transformers 5.17's grouped_mm_fallback) keeps its measured forward FLOPs, and its
    backward counts twice as many; it was costed 0 both ways, with a warning."""
    from rpcompile.passes import cost
    monkeypatch.setitem(cost.EXTRA_FLOP_FORMULAS, torch.ops.rpcompile_tests.looped_mm, cost._grouped_mm_flop)
    w = torch.randn(3, D_IN, D_OUT, requires_grad=True)

    def fn(x, offs):
        return _looped_mm(x, w, offs).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = annotate_costs(capture(fn, torch.randn(12, D_IN), torch.tensor([4, 8, 12]), dynamic_batch=False))
    (node,) = [n for n in calls(gm) if "looped_mm" in str(n.target)]
    c = node.meta["rp_cost"]
    assert c.fwd_flops == 2 * 12 * D_IN * D_OUT and c.bwd_flops == 2 * c.fwd_flops, c


# ---------------------------------------------------------------------------------------------- helpers


def test_evaluate_and_node_seconds():
    s = sympy.Symbol("s0", positive=True, integer=True)
    assert evaluate(3 * s + 1, {"s0": 2}) == 7.0
    assert evaluate(3 * s + 1, {s: 2}) == 7.0
    assert evaluate(sympy.Integer(5), {}) == 5.0
    with pytest.raises(ValueError, match="s0"):
        evaluate(s, {})
    hw = Hardware.cpu()
    assert (hw.peak_flops, hw.mem_bw, hw.upload_bw) == (50e9, 10e9, 10e9)
    h = Hardware.h100()
    assert (h.peak_flops, h.mem_bw, h.upload_bw) == (790e12, 3.0e12, 55e9)

    # compute bound: flops dominate
    c = NodeCost(fwd_flops=100 * s, bwd_flops=200 * s, param_bytes=sympy.Integer(8),
                 out_bytes=2 * s, requires_grad=True, itemsize=4)
    f, fb = node_seconds(c, {"s0": 10}, peak_flops=1.0, mem_bw=1.0)
    assert f == 1000.0 and fb == 1000.0 + 2000.0
    # memory bound: bytes dominate (backward moves about twice the bytes)
    f, fb = node_seconds(c, {"s0": 10}, peak_flops=1e9, mem_bw=1.0)
    assert f == 28.0 and fb == 28.0 + 56.0
    # rescaled to a 2-byte dtype
    f, _ = node_seconds(c, {"s0": 10}, peak_flops=1e9, mem_bw=1.0, dtype_bytes=2)
    assert f == 14.0
    # no gradient: recompute only; views move nothing
    f, fb = node_seconds(NodeCost(out_bytes=2 * s), {"s0": 10}, peak_flops=1.0, mem_bw=1.0)
    assert f == fb == 20.0
    assert node_seconds(NodeCost(out_bytes=2 * s, is_view=True, requires_grad=True), {"s0": 10},
                        peak_flops=1.0, mem_bw=1.0) == (0.0, 0.0)
    assert hw.seconds(c, {"s0": 10}) == node_seconds(c, {"s0": 10}, peak_flops=50e9, mem_bw=10e9)


def test_each_device_uploads_at_its_share_of_the_host(monkeypatch):
    """Note [host-wide uploads]: GPU plans price a device's uploads at its share of the host's
    bandwidth where that is below its own link's (4 H200s: about 32 GB/s each); CPU devices keep theirs."""
    import rpcompile
    cpu = {n: Hardware.of(rpcompile.Config(devices=["cpu"] * n)) for n in (1, 4)}
    assert cpu[1] == cpu[4] == Hardware.cpu()
    monkeypatch.setattr(rpcompile.Config, "on_gpu", property(lambda self: True))
    gpu = {n: Hardware.of(rpcompile.Config(devices=["cpu"] * n, workers="threads")) for n in (1, 2, 4)}
    assert gpu[1] == gpu[2] == Hardware.h100()
    assert gpu[4].upload_bw == Hardware.h100().host_upload_bw / 4 == 32e9
    assert gpu[4].peak_flops == Hardware.h100().peak_flops


# ---------------------------------------------------------------------------------------------- Qwen3

import transformers  # noqa: E402  (a test dependency)

BATCH, SEQ = 2, 16


def tiny_qwen3():
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        use_cache=False,  # training: no KV cache (with it the graph also builds cache tensors)
    )
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def qwen():
    model = tiny_qwen3()
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    gm = capture(model, input_ids=ids, labels=ids)
    annotate_costs(gm)
    return model, ids, gm


def _total(gm, field, nodes=None):
    return sum((getattr(n.meta["rp_cost"], field) for n in (nodes or calls(gm))), sympy.Integer(0))


def _sdpa_nodes(gm):
    return [n for n in calls(gm) if n.target is torch._C._nn.scaled_dot_product_attention]


def test_qwen3_forward_flops_match_eager(qwen):
    model, ids, gm = qwen
    (B,) = graph_symbols(gm).values()
    total = _total(gm, "fwd_flops")
    assert total.free_symbols == {B}
    got = evaluate(total, {B: BATCH})

    # Same counter (flop registry + the CPU flash-attention formulas) on the real eager forward.
    with flop_counter_mode() as counter:
        model(input_ids=ids, labels=ids)
    want = counter.get_total_flops()
    assert want > 0 and abs(got - want) <= 0.01 * want

    # Before torch 2.15 the stock FlopCounterMode has no formula for SDPA's CPU kernel
    # (aten._scaled_dot_product_flash_attention_for_cpu), so on CPU it counts attention as 0: the
    # matmul part (every node but attention) must still agree with it. From 2.15 it counts the
    # kernel, and the whole forward must.
    with FlopCounterMode(display=False) as plain:
        model(input_ids=ids, labels=ids)
    sdpa = _sdpa_nodes(gm)
    assert len(sdpa) == 2
    matmul_part = evaluate(_total(gm, "fwd_flops", [n for n in calls(gm) if n not in sdpa]), {B: BATCH})
    assert 0 < matmul_part < got
    stock_counts_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry
    expected = got if stock_counts_attention else matmul_part
    assert abs(expected - plain.get_total_flops()) <= 0.01 * plain.get_total_flops()
    # the loss (log_softmax + nll) has no FLOP formula in the registry: 0 on both sides
    loss = next(n for n in calls(gm) if n.target is torch.nn.functional.cross_entropy)
    assert loss.meta["rp_cost"].fwd_flops == 0


def test_qwen3_backward_and_no_grad_nodes(qwen):
    _, _, gm = qwen
    lins = [n for n in calls(gm) if n.target is torch._C._nn.linear]
    assert len(lins) == 2 * 7 + 1
    for n in lins:  # every linear's input is an activation: grad input + grad weight
        c = n.meta["rp_cost"]
        assert sympy.simplify(c.bwd_flops - 2 * c.fwd_flops) == 0, n.name
    # the rotary tables depend on no parameter: no gradient flows through them
    nodes = by_name(gm)
    for name in ("arange", "cos", "sin"):
        c = nodes[name].meta["rp_cost"]
        assert c.bwd_flops == 0 and not c.requires_grad and c.saved_bytes == 0
    for n in _sdpa_nodes(gm):
        assert n.meta["rp_cost"].bwd_flops != 0


def test_qwen3_param_and_saved_bytes(qwen):
    model, _, gm = qwen
    (B,) = graph_symbols(gm).values()
    model_bytes = sum(nbytes(p) for p in model.parameters())
    assert evaluate(_total(gm, "param_bytes"), {}) >= model_bytes
    for n in calls(gm):
        if n.target is torch._C._nn.linear:
            x = n.args[0].meta["example_value"]
            want = 4 * B * sympy.Mul(*x.shape[1:])
            assert sympy.simplify(n.meta["rp_cost"].saved_bytes - want) == 0, n.name
    # views and no-op conversions cost nothing
    views = [n for n in calls(gm) if n.meta["rp_cost"].is_view]
    assert any(n.target == "view" for n in views)
    for n in views:
        assert n.meta["rp_cost"].fwd_flops == 0 and n.meta["rp_cost"].saved_bytes == 0
    assert evaluate(_total(gm, "saved_bytes"), {B: BATCH}) > 0


def test_saved_values_count_once_in_a_segment():
    """Note [saved values once]: a value several ops save (a norm's output read by the q, k
    and v projections) counts once in the segment table's saved bytes, which then come within
    20% of the storages eager autograd saves for the whole model (per op: 49% over them)."""
    import rpcompile
    from models import lm_batch, qwen3
    from rpcompile.passes.cut_points import liveness, segment_table
    model = qwen3(layers=2)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1))
    batch = lm_batch(batch=2, seq=16)
    cm.train_step(**batch)
    plan = cm.plan
    lv = liveness(plan.gm)
    per_op = sum(int(evaluate(n.meta["rp_cost"].saved_bytes, plan.bindings)) for n in lv.body if "rp_cost" in n.meta)
    whole, _ = segment_table(plan.gm, lv, [0, len(lv.body)], plan.bindings, Hardware.cpu())
    # additive: cut anywhere, the segments' sum is the whole graph's
    half = len(lv.body) // 2
    parts, _ = segment_table(plan.gm, lv, [0, half, len(lv.body)], plan.bindings, Hardware.cpu())
    assert sum(s.saved_bytes for s in parts) == whole[0].saved_bytes
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    eager: dict = {}

    def pack(t):
        k = t.untyped_storage().data_ptr()
        if k not in params:
            eager.setdefault(k, t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    unique = sum(eager.values())
    assert unique <= whole[0].saved_bytes <= 1.2 * unique < per_op, (whole[0].saved_bytes, unique, per_op)


def test_backward_seconds_add_each_microbatchs_gradients():
    """Note [gradients added per microbatch]: a segment's backward seconds include adding its
    parameters' gradients into the fp32 accumulator (the gradient read, the accumulator read and
    written), at the device's memory bandwidth; its forward seconds do not."""
    import dataclasses

    import rpcompile
    from models import lm_batch, qwen3
    from rpcompile.passes.cut_points import liveness, node_seconds, segment_table
    model = qwen3(tied=False, layers=2)      # (a tied weight's rows and whole are added apart)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], num_microbatches=1))
    cm.train_step(**lm_batch(batch=2, seq=16))
    plan, hw = cm.plan, Hardware.cpu()
    lv = liveness(plan.gm)
    added = sum(p.numel() * (p.element_size() + 8) for p in model.parameters() if p.requires_grad)
    for mem_bw in (hw.mem_bw, hw.mem_bw / 2):
        (seg,), _ = segment_table(plan.gm, lv, [0, len(lv.body)], plan.bindings, dataclasses.replace(hw, mem_bw=mem_bw))
        fwd = bwd = 0.0
        for n in lv.body:
            if "rp_cost" in n.meta:
                f, b = node_seconds(n.meta["rp_cost"], plan.bindings, peak_flops=hw.peak_flops, mem_bw=mem_bw)
                fwd, bwd = fwd + f, bwd + b
        assert seg.fwd_s == pytest.approx(fwd) and seg.bwd_s == pytest.approx(bwd + added / mem_bw)


def test_qwen3_meta_capture_same_flops(qwen):
    _, _, gm_cpu = qwen
    model = tiny_qwen3().to(device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    gm = annotate_costs(capture(model, input_ids=ids, labels=ids))
    embed = next(n for n in calls(gm) if n.target is torch.nn.functional.embedding)
    assert embed.meta["example_value"].device.type == "meta"
    assert embed.meta["example_value"].dtype == torch.bfloat16

    (b_meta,) = graph_symbols(gm).values()
    (b_cpu,) = graph_symbols(gm_cpu).values()
    rename = {b_meta: b_cpu}
    meta_nodes, cpu_nodes = calls(gm), calls(gm_cpu)
    assert [n.name for n in meta_nodes] == [n.name for n in cpu_nodes]
    for m, c in zip(meta_nodes, cpu_nodes):
        cm, cc = m.meta["rp_cost"], c.meta["rp_cost"]
        assert cm.fwd_flops.xreplace(rename) == cc.fwd_flops, m.name
        assert cm.bwd_flops.xreplace(rename) == cc.bwd_flops, m.name
        if m.target is torch._C._nn.linear:  # bf16 activations: half the fp32 bytes
            assert sympy.simplify(2 * cm.saved_bytes.xreplace(rename) - cc.saved_bytes) == 0
            assert 2 * cm.param_bytes == cc.param_bytes


def test_gpu_plans_of_a_qwen3_1_7b_shape(monkeypatch):
    """Planned with GPU numbers (on meta tensors, no GPU needed):
    - the per-job host cost: 2 devices keep the 4 jobs measured best there; 4 devices no longer
      cut the step into 32 jobs (measured 16% slower than 8: each job costs host time that grows
      with the devices sharing the interpreter);
    - Note [cuts between blocks]: for Inductor-compiled stages the 4-device plan cuts only
      between decoder layers (no partial layer, a piece of its own to compile per device), at
      most BLOCK_CUT_SLACK slower by the cost model than the best plan, which eager stages keep."""
    import importlib

    import rpcompile
    from rpcompile import passes
    from rpcompile.capture import capture_call
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cut_points = importlib.import_module("rpcompile.passes.cut_points")
    assert Hardware.h100().job_overhead_s(4) == pytest.approx(0.04) and Hardware.cpu().job_overhead_s(4) == 0
    monkeypatch.setattr(Hardware, "cpu", Hardware.h100)      # plan for GPUs on CPU "devices"
    config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         use_cache=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    ids = torch.zeros(32, 2048, dtype=torch.long, device="meta")
    cap = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device=torch.device("cpu"),
                       dynamic_lengths=True)       # as Config() captures
    plans = {}
    for n, compiled in ((2, False), (4, False), (4, True)):   # one capture, planned three ways
        config = rpcompile.Config(devices=["cpu"] * n, num_microbatches=4, dtype=torch.bfloat16,
                                  memory_budget="70GiB", compile_stages=compiled)
        plans[n, compiled] = passes.compile_graph(cap, config, "train")
    assert plans[2, False].stage_plan.num_jobs == 4 and 6 <= plans[4, False].stage_plan.num_jobs <= 12
    inside = cut_points._inside_blocks(cut_points.liveness(plans[4, True].gm))
    assert inside, "the layers' interior positions"
    for compiled in (False, True):
        ends = {p for st in plans[4, compiled].stages for p in st.span}
        assert bool(ends & inside) is not compiled, (compiled, sorted(ends & inside))
    assert "model.layers.15 (" in str(plans[4, False]) and "(self_attn" not in str(plans[4, True])
    assert (plans[4, True].stage_plan.est_time
            <= (1 + passes.BLOCK_CUT_SLACK) * plans[4, False].stage_plan.est_time)


def test_a_capture_keeps_its_node_measurements_for_graphs_its_key_misses(monkeypatch):
    """Note [costs per capture]: a plan of the same capture whose graph differs (another LM-head
    shard count) measures only the nodes not measured before, and gets the costs a fresh
    annotation gives."""
    import rpcompile
    from rpcompile import passes
    from rpcompile.capture import capture_call
    from rpcompile.passes import cost

    from models import qwen3

    model = qwen3(vocab=512)
    ids = torch.zeros(4, 16, dtype=torch.long)
    cap = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=None, device=torch.device("cpu"),
                       dynamic_lengths=True)
    monkeypatch.setattr(cost, "_MEASURED", {})    # none kept from other captures of this process
    measured = _count_measurements(monkeypatch)

    def plan(shards):
        config = rpcompile.Config(devices=["cpu"], num_microbatches=2, lm_head_shards=shards)
        return passes.compile_graph(cap, config, "train")

    plan(2)
    first = len(measured)
    p3 = plan(3)
    again = len(measured) - first
    assert 0 < again < first / 2, (first, again)        # the layers were measured once
    kept = cost.graph_costs(p3.gm)[0]
    monkeypatch.setattr(cost, "_MEASURED", {})
    fresh = cost.graph_costs(cost.annotate_costs(p3.gm))[0]   # the same graph, measured afresh
    assert kept and kept == fresh


def _count_measurements(monkeypatch) -> list:
    """The names of the nodes annotate_costs measures from here on."""
    from rpcompile.passes import cost
    measured = []
    measure = cost._Annotator._measure
    monkeypatch.setattr(cost._Annotator, "_measure", lambda self, node, *a: measured.append(node.name) or
                        measure(self, node, *a))
    return measured


def test_another_capture_of_the_same_layers_measures_nothing_again(monkeypatch):
    """Note [measurements across captures]: a second model of the same layers, captured on its
    own, takes every measurement kept from the first capture and gets the costs a fresh
    annotation gives; at another batch size (other size hints) it measures again."""
    from rpcompile.capture import capture_call
    from rpcompile.passes import cost

    from models import qwen3

    monkeypatch.setattr(cost, "_MEASURED", {})
    measured = _count_measurements(monkeypatch)

    def annotated(seed, batch):
        ids = torch.zeros(batch, 16, dtype=torch.long)
        cap = capture_call(qwen3(layers=1, seed=seed), (), {"input_ids": ids, "labels": ids}, dtype=None,
                           device=torch.device("cpu"))
        return cost.annotate_costs(cap.gm)

    first = cost.graph_costs(annotated(0, 4))[0]
    n = len(measured)
    second = annotated(1, 4)
    assert n > 0 and len(measured) == n and cost.graph_costs(second)[0] == first
    other = annotated(2, 6)
    assert len(measured) > n
    kept = cost.graph_costs(other)[0]
    monkeypatch.setattr(cost, "_MEASURED", {})
    assert kept == cost.graph_costs(cost.annotate_costs(other))[0] == first
