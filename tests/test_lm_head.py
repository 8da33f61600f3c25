"""Tests of the split_lm_head pass: loss/gradient parity, structure, refusals."""

import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rpcompile.passes.lm_head import (
    _hint,
    estimate_num_shards,
    find_lm_head,
    shard_bounds,
    split_lm_head,
)

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
V_ODD, H = 127, 32


def capture(fn, *args, **kwargs):
    got = {}

    def backend(gm, example_inputs):
        got["gm"] = gm
        # dynamic dims arrive as (backed) SymInts: call the graph with their values
        got["inputs"] = [x.node.hint if isinstance(x, torch.SymInt) else x for x in example_inputs]
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return got["gm"], got["inputs"], out


def clone(gm):
    """A fresh GraphModule over a copy of gm's graph (node meta shallow-copied)."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def tiny(family, vocab=V_ODD, tied=True, layers=2, dtype=torch.float32):
    torch.manual_seed(0)
    kw = dict(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    model = (Qwen3ForCausalLM(Qwen3Config(**kw)) if family == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**kw)))
    return model.to(dtype)


def batch(vocab, b=3, t=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, ::2] = -100                 # many ignored tokens
    labels[1, :] = -100
    labels[1, 4] = ids[1, 4]              # a row ignored except one token
    labels[2, 0] = vocab - 1              # the last vocab row is a target (after the shift too)
    labels[2, 1] = vocab - 1
    return ids, labels


def hf_loss(model):
    return lambda **kw: model(**kw).loss


def user_loss(model, vocab):
    def fn(input_ids, labels):
        logits = model(input_ids=input_ids).logits
        return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))
    return fn


def sum_over_count_loss(model, vocab):
    """What normalize_loss leaves: sum-reduced CE divided by the number of counted tokens."""
    def fn(input_ids, labels):
        logits = model(input_ids=input_ids).logits
        lg = logits[:, :-1, :].contiguous().view(-1, vocab).float()
        y = labels[:, 1:].contiguous().view(-1)
        return F.cross_entropy(lg, y, ignore_index=-100, reduction="sum") / (y != -100).sum()
    return fn


_CAPTURES = {}


def captured(key, make):
    """Capture once per configuration; every test gets its own copy of the graph."""
    if key not in _CAPTURES:
        _CAPTURES[key] = make()
    gm, inputs = _CAPTURES[key]
    return clone(gm), inputs


def loss_and_grads(gm, inputs):
    params = [x for x in inputs if isinstance(x, nn.Parameter)]
    out = gm(*inputs)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_parity(gm, inputs, num_shards):
    ref_loss, ref_grads = loss_and_grads(gm, inputs)
    new = split_lm_head(clone(gm), num_shards)
    loss, grads = loss_and_grads(new, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)
    return new


def shard_nodes(gm):
    return [n for n in gm.graph.nodes if isinstance(n.meta.get("rp_lm_head"), dict)]


# --------------------------------------------------------------------------- parity


def _hf(family, tied, vocab=V_ODD):
    def make():
        model = tiny(family, vocab, tied)
        ids, labels = batch(vocab)
        gm, inputs, _ = capture(hf_loss(model), input_ids=ids, labels=labels)
        return gm, inputs
    return captured(("hf", family, tied, vocab), make)


def _user(family, tied, form="user", vocab=V_ODD):
    def make():
        model = tiny(family, vocab, tied)
        ids, labels = batch(vocab)
        fn = user_loss(model, vocab) if form == "user" else sum_over_count_loss(model, vocab)
        gm, inputs, _ = capture(fn, ids, labels)
        return gm, inputs
    return captured((form, family, tied, vocab), make)


@pytest.mark.parametrize("K", [1, 2, 3, 8])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_parity_transformers_loss_tied(family, K):
    gm, inputs = _hf(family, tied=True)
    assert_parity(gm, inputs, K)


@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("family,vocab", [("qwen3", 128), ("llama", V_ODD)])
def test_parity_transformers_loss_untied(family, vocab, K):
    gm, inputs = _hf(family, tied=False, vocab=vocab)
    assert_parity(gm, inputs, K)


@pytest.mark.parametrize("K", [1, 2, 3, 8])
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True)])
def test_parity_user_cross_entropy(family, tied, K):
    gm, inputs = _user(family, tied)
    assert_parity(gm, inputs, K)


def test_after_normalize_loss():
    """normalize_loss (runs first) turns the mean into a token sum marked rp_loss; it survives."""
    from rpcompile.passes.normalize_loss import normalize_loss

    gm, inputs = _hf("llama", tied=True)
    gm = normalize_loss(clone(gm), 0)
    assert gm.meta["rp_loss"].kind == "tokens"
    head = find_lm_head(gm)
    assert head.splittable and head.reduction == "sum"
    new = assert_parity(gm, inputs, 3)
    (loss,) = new.graph.output_node().args[0]
    assert loss.meta.get("rp_loss") == "token_sum" and loss.meta["rp_lm_head_part"] == "epilogue"
    assert new.meta["rp_lm_head"]["bounds"] == shard_bounds(V_ODD, 3)


@pytest.mark.parametrize("K", [1, 3, 8])
def test_parity_sum_over_count(K):
    gm, inputs = _user("llama", True, form="sum_count")
    head = find_lm_head(gm)
    assert head is not None and head.splittable and head.reduction == "sum"
    new = assert_parity(gm, inputs, K)
    # the division by the count that the graph already had is kept
    assert any(n.op == "call_function" and n.target.__name__ in ("truediv", "div")
               and "rp_lm_head_part" not in n.meta for n in new.graph.nodes)


class TinyLM(nn.Module):
    """A hand-written LM: numbered layers, a head with bias, a cross-entropy of choice."""

    def __init__(self, vocab=61, **ce_kwargs):
        super().__init__()
        self.vocab, self.ce_kwargs = vocab, ce_kwargs
        self.emb = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(3))
        self.head = nn.Linear(H, vocab, bias=True)

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1), **self.ce_kwargs)


def test_parity_reduction_none_and_bias():
    torch.manual_seed(0)
    model = TinyLM(reduction="none")
    ids, labels = batch(model.vocab)
    gm, inputs, _ = capture(lambda i, y: (model(i, y) * torch.linspace(0.5, 1.5, i.numel())).sum(),
                            ids, labels)
    for K in (1, 4):
        new = assert_parity(gm, inputs, K)
    slices = [n.meta["rp_param_slice"] for n in new.graph.nodes if "rp_param_slice" in n.meta]
    assert len(slices) == 8  # weight and bias, 4 shards each
    assert {s[1:] for s in slices} == {(0, *b) for b in shard_bounds(model.vocab, 4)}


def test_parity_float64_model():
    """Double logits stay double (no downcast to fp32 in the shards)."""
    torch.manual_seed(0)
    model = TinyLM().double()
    gm, inputs, _ = capture(model, *batch(model.vocab))
    ref_loss, ref_grads = loss_and_grads(gm, inputs)
    loss, grads = loss_and_grads(split_lm_head(clone(gm), 3), inputs)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _dynamic_batch():
    """The 2-layer Qwen3 captured with a dynamic batch dim (symbolic rows)."""
    def make():
        model = tiny("qwen3", V_ODD, True)
        ids, labels = batch(V_ODD)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        gm, inputs, _ = capture(hf_loss(model), input_ids=ids, labels=labels)
        return gm, inputs
    return captured("dynamic", make)


def test_parity_dynamic_batch():
    gm, inputs = _dynamic_batch()
    assert any(isinstance(x, int) for x in inputs)  # a SymInt placeholder
    new = assert_parity(gm, inputs, 3)
    assert all("example_value" in n.meta for n in shard_nodes(new))


def test_parity_bf16_model():
    """bf16 weights: shard logits are upcast to fp32 as transformers does (bf16 tolerances)."""
    def make():
        model = tiny("qwen3", V_ODD, True, dtype=torch.bfloat16)
        ids, labels = batch(V_ODD)
        gm, inputs, _ = capture(hf_loss(model), input_ids=ids, labels=labels)
        return gm, inputs
    gm, inputs = captured("bf16", make)
    ref_loss, ref_grads = loss_and_grads(gm, inputs)
    new = split_lm_head(clone(gm), 3)
    loss, grads = loss_and_grads(new, inputs)
    assert loss.dtype == ref_loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=5e-2, atol=5e-2)


# --------------------------------------------------------------------------- structure


class _RecordShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_full_logits_never_exist():
    gm, inputs = _hf("qwen3", tied=True)
    head = find_lm_head(gm)
    assert head.vocab_size == V_ODD and head.hidden_size == H
    new = split_lm_head(clone(gm), 3)
    # example values
    for n in new.graph.nodes:
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor):
            assert ev.dim() == 0 or ev.shape[-1] != V_ODD, n.format_node()
    # actual values, forward and backward
    params = [x for x in inputs if isinstance(x, nn.Parameter)]
    with _RecordShapes() as rec:
        loss = new(*inputs)[0]
        torch.autograd.grad(loss, params)
    bad = [(f, s) for f, s in rec.shapes if s and s[-1] == V_ODD]
    assert not bad, bad[:5]
    # ... which the original graph did have
    with _RecordShapes() as rec:
        gm(*inputs)
    assert any(s and s[-1] == V_ODD for _, s in rec.shapes)


def test_saved_for_backward_is_one_slice_per_shard():
    gm, inputs = _hf("qwen3", tied=True)
    N, K = 3 * 8, 3
    new = split_lm_head(clone(gm), K)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        new(*inputs)
    widths = [b - a for a, b in shard_bounds(V_ODD, K)]
    assert not [s for s in saved if s and s[-1] == V_ODD]
    assert sorted(s[1] for s in saved if len(s) == 2 and s[0] == N and s[1] in widths) == sorted(widths)


def test_shard_meta_and_contiguity():
    gm, inputs = _hf("llama", tied=False)
    wname = find_lm_head(gm).weight.name
    K = 3
    new = split_lm_head(clone(gm), K)
    order = {n: i for i, n in enumerate(new.graph.nodes)}
    shards = shard_nodes(new)
    assert sorted({n.meta["rp_lm_head"]["k"] for n in shards}) == list(range(K))
    bounds = shard_bounds(V_ODD, K)
    assert bounds == [(0, 43), (43, 85), (85, 127)]
    for k in range(K):
        nodes = [n for n in shards if n.meta["rp_lm_head"]["k"] == k]
        idx = sorted(order[n] for n in nodes)
        assert idx == list(range(idx[0], idx[0] + len(idx))), f"shard {k} not contiguous"
        assert all(n.meta["rp_lm_head"] == {"k": k, "K": K, "start": bounds[k][0], "stop": bounds[k][1], "apart": False}
                   and n.meta["rp_lm_head_part"] == "shard" for n in nodes)
        sl = [n.meta["rp_param_slice"] for n in nodes if "rp_param_slice" in n.meta]
        assert sl == [(wname, 0, *bounds[k])]
        assert all(n.meta.get("nn_module_stack") for n in nodes)
    # shards follow one another; between two shards only small values are live
    first = [min(order[n] for n in shards if n.meta["rp_lm_head"]["k"] == k) for k in range(K)]
    assert first == sorted(first)
    for k in range(1, K):
        cut = first[k]
        live = {a for n in new.graph.nodes if order[n] >= cut for a in n.all_input_nodes
                if order[a] < cut and a.op != "placeholder"}
        for a in live:
            ev = a.meta["example_value"]
            assert ev.dim() <= 2 and (ev.dim() < 2 or ev.shape[-1] == H), a.format_node()
    # the pass does not run twice on its own output
    assert find_lm_head(new) is None
    assert "cross_entropy" not in new.code


def test_default_num_shards_from_cost():
    # a head much heavier than a layer: K ~ head FLOPs / layer FLOPs
    vocab = 2048

    def make():
        model = tiny("qwen3", vocab, True)
        ids, labels = batch(vocab)
        gm, inputs, _ = capture(hf_loss(model), input_ids=ids, labels=labels)
        return gm, inputs
    gm, inputs = captured(("hf", "qwen3", True, vocab), make)
    head = find_lm_head(gm)
    T = 3 * 8
    # per layer: q,k,v,o (32x32, 16x32, 16x32, 32x32) + mlp 3 x (64x32) + attention (2 matmuls)
    layer = 2 * T * (32 * 32 + 16 * 32 * 2 + 32 * 32 + 3 * 64 * 32) + 2 * 3 * 4 * 8 * 8 * (8 + 8)
    expect = round(2 * T * H * vocab / layer)
    K = estimate_num_shards(gm, head)
    assert K == expect and K > 1
    new = split_lm_head(clone(gm))
    assert {n.meta["rp_lm_head"]["K"] for n in shard_nodes(new)} == {K}
    assert new.meta["rp_lm_head"]["split"] and new.meta["rp_lm_head"]["K"] == K
    loss, _ = loss_and_grads(new, inputs)
    torch.testing.assert_close(loss, loss_and_grads(gm, inputs)[0], rtol=RTOL, atol=ATOL)


def test_default_num_shards_bounds():
    gm, _ = _hf("qwen3", tied=True)  # a head lighter than a layer
    assert estimate_num_shards(gm) == 1
    # TinyLM: a layer is an H x H linear, the head H x V: K = round(V / H), at most 64
    for vocab, K in [(200, 6), (8192, 64)]:
        gm, _, _ = capture(TinyLM(vocab), *batch(vocab))
        assert estimate_num_shards(gm) == K


def test_shards_by_memory_keep_each_shards_logits_under_the_cap():
    """Note [shards by memory]: at least ceil(fp32 logits / cap) shards, never fewer than the
    FLOPs rule's, at most 64."""
    gm, _, _ = capture(TinyLM(200), *batch(200))
    head = find_lm_head(gm)
    logits = _hint(head.num_tokens) * 200 * 4
    by_flops = estimate_num_shards(gm, head)
    assert estimate_num_shards(gm, head, max_logit_bytes=10 * logits) == by_flops
    for share in (8, 13, 40):
        assert estimate_num_shards(gm, head, max_logit_bytes=logits / share) == max(by_flops, share)
    assert estimate_num_shards(gm, head, max_logit_bytes=1) == 64


def test_a_long_sequence_fits_a_budget_the_flops_rule_cannot():
    """At long sequences the FLOPs rule gives few shards (attention outgrows the head): a
    budget of half what its plan needs fits with shards sized by memory, the plan's jobs stay
    within it, and the loss is eager's."""
    import copy

    import rpcompile
    from models import lm_batch, qwen3
    from parity import plan_kept_capture

    V = 8192
    model = qwen3(vocab=V)
    b = lm_batch(batch=2, seq=512, vocab=V)
    trained, kept = copy.deepcopy(model), {}

    def compiled(**kw):
        # every compiled model below plans the one capture of `trained` (the passes read the
        # Config when they plan it, as a re-plan does; a capture was 3/4 of this test's time)
        return plan_kept_capture(rpcompile.compile(trained, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=1,
                                                                          **kw)), kept)
    probe = compiled()                     # no budget on CPU devices: the FLOPs rule alone
    probe.train_step(**b)
    flops_only = probe.plan.lm_head["K"]
    with pytest.raises(rpcompile.PlanningError) as e:
        compiled(memory_budget=1, lm_head_shards=flops_only).train_step(**b)
    budget = e.value.min_budget // 2
    with pytest.raises(rpcompile.PlanningError):
        compiled(memory_budget=budget, lm_head_shards=flops_only).train_step(**b)
    cm = compiled(memory_budget=budget)
    loss = cm.train_step(**b)
    K = cm.plan.lm_head["K"]
    assert K == min(64, math.ceil(2 * 512 * V * 4 / (budget / 16))) > flops_only
    assert max(cm.plan.stage_plan.job_memory) <= budget
    torch.testing.assert_close(loss, model(**b).loss, rtol=1e-5, atol=1e-6)


def test_shard_bounds_cover_vocab():
    for vocab, K in [(127, 1), (127, 2), (127, 8), (128, 8), (5, 5)]:
        b = shard_bounds(vocab, K)
        assert b[0][0] == 0 and b[-1][1] == vocab and len(b) == K
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert max(s - a for a, s in b) - min(s - a for a, s in b) <= 1


# --------------------------------------------------------------------------- refusals


def _unchanged_with_warning(gm, match):
    before = gm.code
    with pytest.warns(UserWarning, match=match) as rec:
        out = split_lm_head(gm, 2)
    ours = [str(w.message) for w in rec if "split_lm_head" in str(w.message)]
    assert len(ours) == 1 and "\n" not in ours[0]
    assert out.code == before


@pytest.mark.parametrize("option,match", [
    (dict(label_smoothing=0.1), "label_smoothing"),
    (dict(weight=torch.rand(61)), "class weights"),
])
def test_unsupported_cross_entropy_options_leave_head(option, match):
    torch.manual_seed(0)
    model = TinyLM(61, **option)
    gm, _, _ = capture(model, *batch(61))
    head = find_lm_head(gm)
    assert head is not None and not head.splittable
    _unchanged_with_warning(gm, match)


def test_logits_output_leaves_head():
    model = tiny("qwen3")
    ids, labels = batch(V_ODD)
    gm, _, _ = capture(lambda **kw: model(**kw)[:2], input_ids=ids, labels=labels)
    assert "other users" in find_lm_head(gm).reason
    _unchanged_with_warning(gm, "other users")


def test_logits_only_model_is_left_whole_silently():
    gm, _, _ = capture(TinyLM(), batch(61)[0])
    assert find_lm_head(gm) is None
    before = gm.code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_lm_head(gm).code == before


def test_bad_num_shards():
    gm, _ = _hf("qwen3", tied=True)
    with pytest.raises(ValueError):
        split_lm_head(clone(gm), 0)
    with pytest.raises(ValueError):
        split_lm_head(clone(gm), V_ODD + 1)


def test_shards_of_every_count_are_one_piece():
    """Where the memory rule set the shard count, every shard after the first is the same piece
    whatever its bounds, rows and the count: the bounds are its int inputs (Note [shard bounds
    as inputs] in passes/regions.py), so a plan with another count compiles no shard again. The
    split graph still computes the loss and gradients of the unsplit one."""
    from rpcompile.passes.regions import piece_key, split_regions
    gm, inputs = _hf("qwen3", tied=False)
    ref_loss, ref_grads = loss_and_grads(gm, inputs)
    tokens = 3 * 8
    keys, counts = set(), []
    for K in (5, 9):
        g = split_lm_head(clone(gm), max_logit_bytes=tokens * V_ODD * 4 / K)
        assert g.meta["rp_lm_head"]["K"] == K
        assert all(n.meta["rp_lm_head"]["apart"] for n in shard_nodes(g))
        split = split_regions(g)
        pieces = [getattr(split, name) for name in split.meta["rp_regions"]]
        ops = [[n for n in p.graph.nodes if n.op == "call_function"] for p in pieces]
        later = [p for p, ns in zip(pieces, ops) if any(n.target is F.linear for n in ns)
                 and max(n.meta.get("rp_lm_head", {}).get("k", -1) for n in ns) > 0]
        counts.append(len(later))
        keys |= {piece_key(p) for p in later}
        loss, grads = loss_and_grads(split, inputs)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert counts == [4, 8] and len(keys) == 1, f"{len(keys)} distinct pieces for shards 1.. of {counts}"


@pytest.mark.parametrize("tied", [True, False])
def test_every_gradient_a_job_sends_to_the_host_is_read(tied):
    """A job hands the host the gradients of the activations it read, for the job that made them;
    a shard's weight rows (rp_param_slice) are no activation: their gradient stays on the device,
    in the job's parameter gradients. Each shard job used to send its rows' gradient to the host
    too, per microbatch, for no job to read (Qwen3-1.7B at 4 GPUs: 2.5 GB a step)."""
    import rpcompile
    from models import lm_batch, qwen3

    cm = rpcompile.compile(qwen3(vocab=1024, tied=tied), rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2,
                                                                          lm_head_shards=4, memory_budget="4MiB"))
    cm.train_step(**lm_batch(batch=4, seq=32, vocab=1024))
    stages = cm.plan.stages
    read = {name for st in stages if st.kind == "bwd" for name in st.grad_outputs}
    sent = {name: st.index for st in stages if st.kind != "fwd" for name in st.grad_inputs}
    slices = {name for st in stages for name in st.param_slices}
    assert len(slices) == 4 and any(st.param_slices and st.kind != "fwd" for st in stages)
    assert {name: i for name, i in sent.items() if name not in read} == {}
    for st in stages:   # the rows' gradients are the job's parameter gradients
        assert sorted(st.param_slices.values()) == sorted(p for p in st.grad_params if isinstance(p, tuple)) \
            or st.kind == "fwd"


def test_shards_that_take_an_earlier_shards_example_values_cost_as_if_fake_executed(monkeypatch):
    """Note [shard values]: a shard after the first takes the example values of an earlier shard
    of its width and parity; every node's shape, dtype and cost (FLOPs, bytes saved, view or not)
    equal those of the same rewrite with every node fake-executed. 127 rows in 8 shards: widths
    16 (shards 0-6) and 15 (shard 7), both parities, symbolic rows."""
    from rpcompile.passes import lm_head
    from rpcompile.passes.cost import annotate_costs

    gm, _ = _dynamic_batch()
    shared = annotate_costs(split_lm_head(clone(gm), 8))
    begin = lm_head._Builder.begin_shard
    monkeypatch.setattr(lm_head._Builder, "begin_shard", lambda self, shard, key: begin(self, shard, None))
    fresh = annotate_costs(split_lm_head(clone(gm), 8))

    by_shard = {}
    for n in shard_nodes(shared):
        by_shard.setdefault(n.meta["rp_lm_head"]["k"], []).append(n.meta.get("example_value"))
    assert [id(v) for v in by_shard[5]] == [id(v) for v in by_shard[3]] == [id(v) for v in by_shard[1]]
    assert not {id(v) for v in by_shard[2]} & {id(v) for v in by_shard[1]}   # the other parity
    assert not {id(v) for v in by_shard[7]} & {id(v) for v in by_shard[1]}   # the other width

    others = {n.name: n for n in fresh.graph.nodes}
    compared = 0
    for n in shared.graph.nodes:
        m = others[n.name]
        a, b = n.meta.get("example_value"), m.meta.get("example_value")
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.stride(), a.dtype, a.requires_grad) == (b.shape, b.stride(), b.dtype, b.requires_grad), n.name
        c, d = n.meta.get("rp_cost"), m.meta.get("rp_cost")
        if d is not None:
            assert (c.fwd_flops, c.bwd_flops, c.out_bytes, c.saved_bytes, c.is_view, c.requires_grad) == (
                d.fwd_flops, d.bwd_flops, d.out_bytes, d.saved_bytes, d.is_view, d.requires_grad), n.name
            assert [v for v, _ in c.saved_values] == [v for v, _ in d.saved_values], n.name
            compared += 1
    assert compared > 8 * 20
