"""The split LM head inside the pipeline: shards spread over stages, parity with eager."""
import pytest
import torch

import rpcompile

from models import llama, lm_batch, qwen3
from parity import TIGHT, train_both


@pytest.mark.parametrize("make,tied,shards,vocab", [(qwen3, True, 3, 127), (llama, False, 8, 1031),
                                                    (qwen3, False, 1, 128)])
def test_split_head_parity_across_stages(make, tied, shards, vocab):
    cfg = rpcompile.Config(devices=["cpu", "cpu", "cpu"], num_microbatches=3, memory_budget=TIGHT,
                           lm_head_shards=shards)
    batches = [lm_batch(vocab=vocab, seed=s) for s in range(3)]
    for b in batches:
        b["labels"][1, ::2] = -100
    # Gradients relative to the largest one, parameters after SGD with momentum (parity.py): the
    # rows of tokens that never occur carry gradients of ~1e-9, whose summation-order noise in the
    # online log-sum-exp an AdamW step would amplify to ~lr.
    cm = train_both(make(tied=tied, vocab=vocab), batches, cfg)
    rows = cm.plan.stage_rows()
    placed = {k for r in rows if r["kind"] != "bwd" for k in r["lm_head_shards"]}
    assert placed == set(range(shards)), "every shard is computed by a forward-side stage"
    assert ("lm_head shard" if shards > 1 else "lm_head") in str(cm.plan)   # the plan names the head's shards
    shard_stages = [st for st, r in zip(cm.plan.stages, rows) if r["lm_head_shards"]]
    if shards >= 3:
        # a stage that holds shards but not the embedding uploads just its rows of the head
        assert any("upload_weight_rows.default(" in st.program.code for st in shard_stages)
    if shards >= 8:
        assert len({st.index for st in shard_stages if st.kind != "bwd"}) >= 2, \
            "a tight budget spreads the shards over several stages"


def test_no_stage_value_has_the_full_vocabulary():
    vocab = 257
    model = qwen3(vocab=vocab)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, lm_head_shards=4))
    cm.train_step(**lm_batch(vocab=vocab))
    for st in cm.plan.stages:
        for graph in (st.forward, st.backward.compute if st.backward is not None else None):
            if graph is None:
                continue
            for n in graph.graph.nodes:
                ev = n.meta.get("example_value")
                for t in torch.utils._pytree.tree_leaves(ev):
                    if isinstance(t, torch.Tensor) and t.dim() >= 1 and n.meta.get("rp_kind") != "param":
                        assert t.shape[-1] != vocab, f"stage {st.index}: {n.name} has the full vocabulary"


def test_planned_memory_counts_the_unsplit_logits_and_their_gradient():
    """An unsplit head's job plans room for its full fp32 logits and their gradient (the
    largest value of the stage, twice); the split head's jobs need less."""
    from rpcompile import passes
    from rpcompile.capture import capture_call

    vocab, batch = 2003, lm_batch(vocab=2003, batch=4, seq=16)
    logits = 2 * 16 * vocab * 4          # one microbatch (2 sequences) of fp32 logits
    # one capture, as cm.train_step(**batch) makes it, planned as its first call is, both ways
    cap = capture_call(qwen3(vocab=vocab), (), {**batch, "use_cache": False}, dtype=None,
                       device=torch.device("cpu"), dynamic_lengths=True)
    rows = {}
    for shards in (0, 4):
        config = rpcompile.Config(devices=["cpu"], num_microbatches=2, lm_head_shards=shards)
        rows[shards] = passes.compile_graph(cap, config, "train").stage_rows()
    head = [r for r in rows[0] if r["kind"] != "fwd"][0]
    assert head["planned_memory"] >= 2 * logits + 2 * head["param_bytes"]
    assert max(r["planned_memory"] for r in rows[4]) < head["planned_memory"]


def test_a_small_classifier_head_leaves_the_body_its_cuts():
    """A split classification head (3 classes) adds many gaps carrying a few bytes; the limit
    on a cut's live bytes comes from the body's gaps, so the CNN's blocks stay cuttable."""
    from rpcompile.passes.cost import annotate_costs
    from rpcompile.passes.cut_points import legal_cuts, liveness
    from rpcompile.passes.lm_head import split_lm_head
    from rpcompile.passes.normalize_loss import normalize_loss
    from rpcompile.passes.outputs import keep_loss_output
    from rpcompile.capture import capture_call
    from zoo import image_batch, resnet

    torch.manual_seed(0)
    cap = capture_call(resnet(), (), image_batch(0, size=16), dtype=None)
    gm = split_lm_head(normalize_loss(keep_loss_output(cap.gm, 0), 0), num_shards=3)
    gm = annotate_costs(gm)
    lv = liveness(gm)
    pixels = next(n for n in cap.placeholders() if n.meta.get("rp_kind") == "input")
    cuts = legal_cuts(gm, lv, {pixels.meta["example_value"].shape[0].node.expr.name: 2})
    head = [p for p, n in enumerate(lv.body) if "rp_lm_head_part" in n.meta]
    assert len(head) > 10
    assert len([c for c in cuts if 0 < c < head[0]]) >= 4
