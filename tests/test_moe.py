"""Mixture-of-experts layers: the cost model counts tokens x top-k experts (grouped matmuls and
loops over experts with data-dependent sizes), in-place updates stay in the stage of the value
they write, and no stage boundary hands over a value whose size depends on the data."""
import torch
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import rpcompile
from rpcompile.capture import capture_call
from rpcompile.passes.cost import annotate_costs, evaluate
from rpcompile.passes.cut_points import legal_cuts, liveness
from rpcompile.passes.graph_utils import is_impure
from rpcompile.passes.outputs import keep_loss_output

from parity import TIGHT, scalar_loss_step, train_both, xy_batches
from zoo import LoopMoELM, lm_batch

HIDDEN, MOE_INTER, ROWS, SEQ = 32, 16, 5, 8


def costed(model, batch):
    cap = capture_call(model, (), dict(batch, **({"use_cache": False} if hasattr(model, "config") else {})),
                       dtype=None)
    return cap, annotate_costs(keep_loss_output(cap.gm, 0))


def batch_symbol(cap):
    """The size symbol of dim 0 of the input ids."""
    ids = next(n for n in cap.placeholders() if n.meta.get("rp_kind") == "input")
    return ids.meta["example_value"].shape[0].node.expr


def qwen3_moe(experts):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
                                              moe_intermediate_size=MOE_INTER, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              num_experts=experts, num_experts_per_tok=2, max_position_embeddings=32))


def test_grouped_mm_counts_tokens_times_top_k_not_every_expert():
    """transformers' default experts run grouped matmuls over tokens x top-k sorted rows: 4 or 16
    experts cost the same, 2 x rows x in x out per projection."""
    tokens, top_k = ROWS * SEQ, 2
    want = 2 * tokens * top_k * (HIDDEN * 2 * MOE_INTER + MOE_INTER * HIDDEN)
    for experts in (4, 16):
        cap, gm = costed(qwen3_moe(experts), lm_batch(0))
        grouped = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
        assert len(grouped) == 2
        bindings = {batch_symbol(cap).name: ROWS}
        fwd = sum(evaluate(n.meta["rp_cost"].fwd_flops, bindings) for n in grouped)
        bwd = sum(evaluate(n.meta["rp_cost"].bwd_flops, bindings) for n in grouped)
        assert fwd == want and bwd == 2 * want, (experts, fwd, bwd)


def test_loop_moe_sizes_estimated_from_the_routing():
    """torch.where over each expert's slice of a one-hot routing mask: each expert is expected
    to get tokens x top-k / experts rows, so the experts together cost tokens x top-k."""
    experts, top_k, d = 4, 2, 16
    model = LoopMoELM(d=d, layers=1, experts=experts, top_k=top_k)
    cap, gm = costed(model, lm_batch(0))
    estimates = gm.meta["rp_size_estimates"]
    batch = batch_symbol(cap)
    assert len(estimates) == experts
    assert all(e == batch * SEQ * top_k / experts for e in estimates.values())
    for n in gm.graph.nodes:
        cost = n.meta.get("rp_cost")
        if cost is not None:
            for f in ("fwd_flops", "bwd_flops", "out_bytes", "saved_bytes"):
                assert not free_unbacked_symbols(getattr(cost, f)), (n, f)
    linears = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear and "experts" in n.args[1].name]
    fwd = sum(evaluate(n.meta["rp_cost"].fwd_flops, {batch.name: ROWS}) for n in linears)
    assert fwd == 2 * ROWS * SEQ * top_k * (3 * d * 2 * d)


def test_no_cut_hands_over_a_data_dependent_value():
    cap, gm = costed(LoopMoELM(layers=2), lm_batch(0))
    lv = liveness(gm)
    cuts = legal_cuts(gm, lv, {batch_symbol(cap).name: 2})
    assert len(cuts) > 3
    for p in cuts:
        assert not any(free_unbacked_symbols(n.meta.get("example_value")) for n in lv.live[p])
    inside = [p for p in range(len(lv.body)) if any(free_unbacked_symbols(n.meta.get("example_value"))
                                                     for n in lv.live[p])]
    assert inside and not set(inside) & set(cuts)


class InversePermutation(nn.Module):
    """Sorts rows and restores their order through an inverse permutation written in place
    (`inv[perm] = arange`, as transformers' grouped-mm experts do), in every layer."""

    def __init__(self, d=8, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            keys = x[:, 0]
            perm = torch.argsort(keys)
            h = torch.tanh(layer(x[perm]))
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.shape[0], device=x.device)
            x = x + h[inv]
        return ((x - y) ** 2).mean()


def test_in_place_update_stays_with_the_value_it_writes():
    batches = xy_batches(7, 8, seed=0)

    cfg = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1, memory_budget=TIGHT)
    cm = train_both(InversePermutation(), batches, cfg, eager_step=scalar_loss_step, min_stages=3)
    gm = cm.plan.gm
    setitems = [n for n in gm.graph.nodes if n.op == "call_function" and "setitem" in str(n.target)]
    assert len(setitems) == 4 and all(is_impure(n) for n in setitems)
    lv = liveness(gm)
    for n in setitems:
        made, written = lv.index[n.args[0]], lv.index[n]
        assert not any(made < c <= written for c in cm.plan.cuts)


def test_no_cut_hands_over_a_tuple_of_tensors():
    """topk's (values, indices) live between the topk and its getitems: a cut there handed the
    tuple over without a gradient for its values (the router's weights: Qwen2-MoE trained with
    wrong gradients below that layer)."""
    from zoo import qwen2_moe
    torch.manual_seed(0)
    cap, gm = costed(qwen2_moe(), lm_batch(0))
    lv = liveness(gm)

    def tuple_live(p):
        return any(isinstance(n.meta.get("example_value"), tuple) for n in lv.live[p])

    cuts = legal_cuts(gm, lv, {batch_symbol(cap).name: 2})
    assert any(tuple_live(p) for p in range(len(lv.body)))
    assert len(cuts) > 3 and not any(tuple_live(p) for p in cuts)


def test_experts_grouped_by_counts_read_off_the_router_train_split():
    """JetMoE groups a layer's tokens per expert by counts read off the router (`.tolist()`: a
    size the data decides, u0 + u1 + u2 + u3 rows), gates them and adds them back into each token's
    row (index_add). Those grouped rows were taken for a value reduced over the batch's rows, so
    any num_microbatches > 1 was refused as rows computed from other rows (Note [rows kept apart]);
    they are the batch's rows in another order, and the model trains as eager over 2 microbatches."""
    from transformers import JetMoeConfig, JetMoeForCausalLM
    torch.manual_seed(0)
    model = JetMoeForCausalLM(JetMoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=4, kv_channels=8,
                                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                           output_router_logits=False))
    for p in model.parameters():      # (its experts' biases start as torch.empty)
        nn.init.normal_(p, std=0.05)
    batches = [lm_batch(s, vocab=64) for s in range(2)]
    cm = train_both(model, batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT),
                    steps=2)
    assert cm.plan.num_microbatches == 2
