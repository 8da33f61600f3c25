"""Attention without a materialised S x S mask (issue #12, Note [causal masks] in
passes/causal_mask.py): a batch without padding trains with SDPA(is_causal=True) and no tensor
of two sequence-length dims in any graph, forward or backward; padded batches, sliding windows
and masks that merely agree with the causal one at the traced length keep their mask. Every
model trains like eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import rpcompile
from rpcompile.capture import capture_call
from rpcompile.passes.causal_mask import causal_attention

from models import llama, qwen3
from parity import train_both

SEQ = 24          # no model dim of the tiny configs is 24, so two dims of 24 are S x S
HF5 = int(transformers.__version__.split(".")[0]) >= 5   # masks built index-wise (4.5x builds them with vmap)


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)]


def _length_symbol(gm):
    first = min((n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("rp_kind") == "input"),
                key=lambda n: n.meta["rp_index"])
    return str(first.meta["example_value"].shape[1])


def _square(gm, length):
    """Nodes (of gm and its GraphModule children) with an output of two dims of size `length`."""
    found = []
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            for n in mod.graph.nodes:
                ev = n.meta.get("example_value", n.meta.get("val"))
                for t in ev if isinstance(ev, (tuple, list)) else [ev]:
                    if isinstance(t, torch.Tensor) and [str(s) for s in t.shape].count(length) >= 2:
                        found.append(n.name)
    return found


def _lm_batch(seed, rows=4, seq=SEQ, padded=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (rows, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:   # right padding of different lengths; padded labels ignored
        mask = torch.ones(rows, seq, dtype=torch.long)
        mask[1, -5:] = 0
        mask[3, -11:] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    return batch


def _steps(model, padded, steps=3):
    """SGD with momentum, rpcompile (2 devices, 2 microbatches) against eager."""
    return train_both(model, [_lm_batch(s, padded=padded) for s in range(steps)],
                      rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2), steps=steps, min_stages=2)


@pytest.mark.parametrize("make", [qwen3, llama], ids=["qwen3", "llama"])
def test_no_padding_attends_causally_without_a_square_mask(make):
    cm = _steps(make(), padded=False)
    gm = cm.plan.gm
    L = _length_symbol(gm)
    if HF5 or not _square(cm.plan.captured.gm, L):
        sdpa = _sdpa_nodes(gm)
        assert sdpa and all(n.kwargs.get("is_causal") is True and n.kwargs.get("attn_mask") is None for n in sdpa)
        assert _square(gm, L) == []
        for stage in cm.plan.stages:
            for g in (stage.forward, stage.backward):
                assert g is None or _square(g, L) == [], f"stage {stage.index}:\n{g.code}"


def test_the_backward_has_no_square_tensor_either():
    """The rewritten graph's forward and backward traced to ATen ops: flash attention (CPU's),
    causal, and no tensor of two sequence-length dims."""
    model = qwen3()
    batch = _lm_batch(0, rows=2)
    cap = capture_call(model, (), {**batch, "use_cache": False}, dtype=None)
    if not HF5 and _square(cap.gm, _length_symbol(cap.gm)):
        pytest.skip("this transformers builds its masks with vmap")
    gm = causal_attention(cap.gm)
    leaves = pytree.tree_leaves(((), {**batch, "use_cache": False}))
    args, params = [], []
    for n in cap.placeholders():
        kind, ev = n.meta["rp_kind"], n.meta["example_value"]
        if kind == "param":
            params.append(len(args))
        args.append(cap.params[n.meta["rp_index"]] if kind == "param" else
                    cap.buffers[n.meta["rp_index"]] if kind == "buffer" else
                    leaves[n.meta["rp_index"]] if kind == "input" else ev.node.hint)

    def loss_and_grads(*a):
        loss = gm(*a)[0]
        return loss, torch.autograd.grad(loss, [a[i] for i in params])

    traced = make_fx(loss_and_grads)(*args)
    assert not [n.name for n in traced.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and list(n.meta["val"].shape).count(SEQ) >= 2]
    attention = [n for n in traced.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 4 and all("flash" in str(n.target) for n in attention)   # 2 layers, fwd + bwd


def test_padded_batches_keep_their_mask():
    """(llama's padded batches: test_batching.py's test_padded_batch_parity checks the same, with
    left, right and one-token padding.)"""
    cm = _steps(qwen3(), padded=True, steps=2)
    sdpa = _sdpa_nodes(cm.plan.gm)
    assert sdpa and all(isinstance(n.kwargs.get("attn_mask"), torch.fx.Node) for n in sdpa)


def _qwen3_sliding(window):
    """Layer 0 full attention, layer 1 a sliding window."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, use_sliding_window=True, sliding_window=window,
                                        max_window_layers=1))


def test_sliding_window_layers_keep_their_mask():
    """A window shorter than the sequence: only the full-attention layer becomes causal."""
    model = _qwen3_sliding(window=5)
    if model.config.layer_types != ["full_attention", "sliding_attention"]:
        pytest.skip("this transformers has no per-layer sliding windows for Qwen3")
    cm = _steps(model, padded=False, steps=2)
    sdpa = _sdpa_nodes(cm.plan.gm)
    assert len(sdpa) == 2 and isinstance(sdpa[1].kwargs.get("attn_mask"), torch.fx.Node)
    if HF5:
        assert sdpa[0].kwargs.get("is_causal") is True and sdpa[0].kwargs.get("attn_mask") is None


def test_a_window_longer_than_the_sequence_is_not_taken_for_causal():
    """At the traced length a 4096-token window equals the causal mask, but not at every length."""
    model = _qwen3_sliding(window=4096)
    if model.config.layer_types != ["full_attention", "sliding_attention"]:
        pytest.skip("this transformers has no per-layer sliding windows for Qwen3")
    batch = _lm_batch(0)
    gm = causal_attention(capture_call(model, (), {**batch, "use_cache": False}, dtype=None).gm)
    sdpa = _sdpa_nodes(gm)
    assert len(sdpa) == 2 and isinstance(sdpa[1].kwargs.get("attn_mask"), torch.fx.Node)


class MaskedAttention(nn.Module):
    """One attention layer whose mask is `rule(q_index, kv_index)` over aranges (or reads `pad`)."""

    def __init__(self, rule, d=16):
        super().__init__()
        self.rule = rule
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pad=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        S = x.shape[1]
        i = torch.arange(S, device=x.device)
        mask = self.rule(i[:, None], i[None, :], pad)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(1, 2).flatten(2)).pow(2).mean()


def _shifted(q, kv, pad):
    kv = kv.clone()
    kv += 1                           # an in-place update of a fresh value: an ordinary op
    return kv <= q + 1


def _aliased(q, kv, pad):
    base = torch.arange(q.shape[0], device=q.device)
    view = base[None, :]
    base.add_(1)                      # writes through to `view`: kv + 1 <= q is not causal
    return view <= q


def _written(q, kv, pad):
    mask = kv <= q
    mask[0, 1] = True                 # after the mask was computed: the first query sees 2 keys
    return mask


RULES = {  # name: (rule, causal for every length)
    "kv<=q": (lambda q, kv, pad: kv <= q, True),
    "q>=kv": (lambda q, kv, pad: q >= kv, True),
    "kv<q+1": (lambda q, kv, pad: (kv < q + 1) & (kv >= 0), True),
    "shifted": (_shifted, True),
    "kv<q": (lambda q, kv, pad: (kv < q) | (q == 0), False),
    "kv<=q+1": (lambda q, kv, pad: kv <= q + 1, False),
    "window": (lambda q, kv, pad: (kv <= q) & (kv > q - 1000), False),
    "aliased": (_aliased, False),
    "written": (_written, False),
    "padding": (lambda q, kv, pad: (kv <= q) & pad[:, None, None, :].bool(), False),
}


@pytest.mark.parametrize("name", list(RULES))
def test_only_provably_causal_masks_become_is_causal(name):
    rule, causal = RULES[name]
    torch.manual_seed(0)
    model = MaskedAttention(rule)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(4, SEQ, 16, generator=g), "pad": torch.ones(4, SEQ, dtype=torch.long)}
               for _ in range(2)]
    if name != "padding":
        batches = [{"x": b["x"]} for b in batches]
    cm = train_both(model, batches, rpcompile.Config(devices=["cpu"], num_microbatches=2), steps=2,
                    eager_step=lambda m, b: _backward(m(**b)), min_stages=0)
    (sdpa,) = _sdpa_nodes(cm.plan.gm)
    assert (sdpa.kwargs.get("attn_mask") is None) == causal
    assert (sdpa.kwargs.get("is_causal") is True) == causal
    if causal:
        assert _square(cm.plan.gm, _length_symbol(cm.plan.gm)) == []


def _backward(loss):
    loss.backward()
    return loss
