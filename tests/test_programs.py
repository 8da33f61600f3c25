"""The stage programs read as what a job does; their printed form is pinned by golden files."""
import copy
import json
import operator
import os

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.passes.codegen import order_transfers
from rpcompile.runtime import ops as rp
from rpcompile.runtime.fake import live_peak, trace_job

from models import MLP, lm_batch

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "mlp_programs.txt")


def _compiled_mlp():
    torch.manual_seed(0)
    cm = rpcompile.compile(MLP(depth=2), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                          loss_fn=F.mse_loss, memory_budget=6000))
    cm.train_step(torch.randn(4, 8), target=torch.randn(4, 4))
    return cm


@pytest.fixture(scope="module")
def mlp_cm():
    """_compiled_mlp() once for the tests below that only read its plan and programs."""
    return _compiled_mlp()


def _programs_text(cm):
    parts = []
    for st in cm.plan.stages:
        parts.append(f"### stage {st.index} ({st.kind}) span {st.span}\n{st.program.code.strip()}\n")
    return "\n".join(parts)


def test_stage_programs_match_golden(mlp_cm):
    text = _programs_text(mlp_cm)
    if os.environ.get("RPCOMPILE_UPDATE_GOLDEN"):
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read(), "stage programs changed; rerun with RPCOMPILE_UPDATE_GOLDEN=1 if intended"


def _targets(program):
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def test_program_order_and_print_readable(mlp_cm):
    cm = mlp_cm
    kinds = [st.kind for st in cm.plan.stages]
    assert kinds[0] == "fwd" and "fused" in kinds and kinds[-1] == "bwd"
    for st in cm.plan.stages:
        t = _targets(st.program)
        assert t[0] is rp.wait and t[-1] is rp.done
        assert t.index(rp.prefetch_next) < t.index(rp.compute)
        acts = [i for i, x in enumerate(t) if x in (rp.fetch, rp.upload_input)]
        weights = [i for i, x in enumerate(t) if x is rp.upload_weight]
        assert weights and max(acts, default=-1) < min(weights) < t.index(rp.prefetch_next), \
            "activations are uploaded before weights, the next job's prefetch after both"
        # transfer and event ops are torch.library custom ops with schemas
        assert all(isinstance(x, torch._ops.OpOverload) and x.namespace == "rpcompile"
                   for x in t if x not in (rp.compute, operator.getitem))
    fused = next(st for st in cm.plan.stages if st.kind == "fused")
    assert "loss_seed.default(" in fused.program.code and "accumulate_grads.default(" in fused.program.code
    assert "vjp(" in fused.backward.code
    assert isinstance(cm.stages[1].program.print_readable(print_output=False), str)


def test_order_transfers_pass_moves_uploads_up(mlp_cm):
    """The pass puts activation uploads first, then weights, then the prefetch, after the wait."""
    cm = mlp_cm
    st = next(s for s in cm.plan.stages if s.kind == "bwd")
    g = copy.deepcopy(st.program.graph)
    nodes = list(g.nodes)
    done = next(n for n in nodes if n.target is rp.done)
    for n in nodes:        # shuffle: every upload moved just before `done` (still a valid graph)
        if n.target in (rp.fetch, rp.upload_weight, rp.prefetch_next):
            users = list(n.users)
            if all(u.target is not rp.compute for u in users):
                done.prepend(n)
    order_transfers(g)
    g.lint()
    assert _targets(torch.fx.GraphModule(st.program, g)) == _targets(st.program)


def test_trace_job_keeps_program_ops_in_order(mlp_cm):
    """A stage job traced with fake tensors: aten compute between the program's ops, in order."""
    cm = mlp_cm
    for st in cm.plan.stages:
        gm = trace_job(cm, st.index)
        traced = [n.target for n in gm.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "namespace", None) == "rpcompile"]
        assert traced == [x for x in _targets(st.program) if x not in (rp.compute, operator.getitem)]
        matmuls = sum(n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) for n in gm.graph.nodes)
        assert matmuls >= 1, "the compute graph traced into aten ops"
        if st.kind != "fwd":   # the backward's matmuls (input and weight gradients) are there too
            assert matmuls >= 2


def test_dump_writes_graphs_and_plan(mlp_cm, tmp_path):
    cm = mlp_cm
    cm.dump(str(tmp_path))
    plan = json.loads((tmp_path / "train" / "plan.json").read_text())
    assert len(plan["stages"]) == len(cm.plan.stages)
    files = os.listdir(tmp_path / "train")
    for st in cm.plan.stages:
        assert any(f.startswith(f"stage{st.index:02d}_{st.kind}_program") for f in files)
        assert any(f.startswith(f"stage{st.index:02d}_{st.kind}_forward") for f in files)
    assert "stage" in str(cm.plan) and "est time" in str(cm.plan)


def test_dump_env_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DUMP", str(tmp_path))
    _compiled_mlp()
    assert (tmp_path / "train" / "plan.json").exists()


@pytest.fixture(scope="module")
def qwen3_cm():
    """A 2-layer Qwen3 on 2 CPU devices, 2 microbatches, a 300KiB budget, after one train_step:
    its plan's jobs (fwd, fused and bwd) for the tests below, which only trace them."""
    from models import qwen3
    cm = rpcompile.compile(qwen3(layers=2), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                             memory_budget="300KiB"))
    cm.train_step(**lm_batch())
    return cm


def test_trace_job_on_a_transformers_model(qwen3_cm):
    """Size symbols, rotary tables, masks and the split LM head trace with fake tensors too."""
    cm = qwen3_cm
    assert len(cm.plan.stages) >= 3
    for st in cm.plan.stages:
        gm = trace_job(cm, st.index)
        traced = [n.target for n in gm.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "namespace", None) == "rpcompile"]
        assert traced == [x for x in _targets(st.program) if getattr(x, "namespace", None) == "rpcompile"]


def test_live_peak_counts_values_until_their_last_use_and_views_once():
    """live_peak on hand-checked graphs: x * 2 then exp: x is freed after the mul, so at most two
    of the three same-sized values live at once; a view adds nothing; an unused value dies at once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.empty(1024)                   # 4 KiB

    def chain(x):
        return (x * 2).exp().sum()

    def views(x):
        y = x.view(32, 32).t()               # shares x's storage
        return (y * 2).sum()

    def unused(x):
        torch.zeros(4096)                     # never read: freed as made
        return x + 1

    for fn, expect in ((chain, 2 * 4096), (views, 2 * 4096), (unused, 4096 + 16384)):
        gm = make_fx(fn, tracing_mode="fake")(x)
        peak, where = live_peak(gm)
        assert peak == expect, (fn.__name__, peak, where)


def test_live_peak_of_a_backward_job_holds_its_saved_values(qwen3_cm):
    """On a transformers model's jobs the traced peak is positive and a backward job (recompute
    and backward) holds more at once than the forward job of the same layers holds at its end."""
    # (2 layers: 5 jobs, fwd, fused and bwd, to trace; 4 layers made 9 of them, for the same check)
    cm = qwen3_cm
    peaks = {st.index: live_peak(trace_job(cm, st.index))[0] for st in cm.plan.stages}
    assert all(p > 0 for p in peaks.values())
    fwd = [st.index for st in cm.plan.stages if st.kind == "fwd"]
    bwd = [st.index for st in cm.plan.stages if st.kind == "bwd"]
    assert fwd and bwd and max(peaks[k] for k in bwd) > min(peaks[k] for k in fwd)


@pytest.mark.parametrize("vocab,seq,budget", [(128, 8, "300KiB"), (8192, 512, 9_000_000)])
def test_planned_job_memory_covers_the_traced_live_peak(vocab, seq, budget):
    """The plan's memory of every stage job is at least the live peak of its traced graph
    (Note [working bytes]): at 512 tokens with 60 LM-head shards the forward jobs hold a shard's
    logits, their difference with the running max and its exp at once, 12% over the plan's count
    when it counted the largest value once."""
    from models import lm_batch, qwen3
    cm = rpcompile.compile(qwen3(vocab=vocab), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1,
                                                                memory_budget=budget))
    cm.train_step(**lm_batch(batch=2, seq=seq, vocab=vocab))
    # no stage ends where a parameter's rows (a shard's weight) are live: they are no activation
    # a backward job could recompute from (it failed with a KeyError for the shard's weight)
    from rpcompile.passes.cut_points import _of_a_parameter, liveness
    lv = liveness(cm.plan.gm)
    rows_live = {p for p, nodes in enumerate(lv.live) if any(_of_a_parameter(n) for n in nodes)}
    assert rows_live <= lv.blocked() and not rows_live & {p for st in cm.plan.stages for p in st.span}
    for st in cm.plan.stages:
        traced, where = live_peak(trace_job(cm, st.index))
        planned = cm.plan.stage_plan.job_memory[st.index]
        assert planned >= traced, f"job {st.index} ({st.kind}): planned {planned} < traced {traced} at {where}"


def test_forward_parts_hand_checkpoints_down_as_they_are_made():
    """Note [forward parts]: a forward job's compute is cut at the checkpoints it hands to the
    backward jobs, each part's going down before the next part runs. Llama, 1,024 tokens, a
    budget that puts 6 layers in one forward job and one layer in each backward job: the job's
    traced live peak is within its plan and under two thirds of the same job's computed as one
    graph (all its checkpoints live at its end: what ran out of memory on the GPU); and it
    trains like eager."""
    import dataclasses

    from models import llama
    from parity import train_both
    from rpcompile.passes.codegen import build_program

    batch = lm_batch(batch=1, seq=1024)
    cfg = rpcompile.Config(devices=["cpu"], num_microbatches=1, memory_budget="3300KiB")
    cm = train_both(llama(layers=6), [batch], cfg, steps=2, min_stages=0)
    parted = [st for st in cm.plan.stages if st.forward_parts]
    assert parted and max(len(st.forward_parts) for st in parted) >= 4
    for st in parted:
        program = st.programs["fwd"]
        computes = [n for n in program.graph.nodes if n.target is rp.compute]
        assert len(computes) == len(st.forward_parts)
        order = list(program.graph.nodes)
        for c, nxt in zip(computes, computes[1:]):   # each part's checkpoints go down before the next part
            handed = [n for n in order[order.index(c):order.index(nxt)] if n.target is rp.offload]
            assert handed, f"job {st.index}: no offload between two parts"
        parts_peak = live_peak(trace_job(cm, st.index))[0]
        assert parts_peak <= cm.plan.stage_plan.job_memory[st.index]
        whole = dataclasses.replace(st, forward_parts=[])
        st.programs["fwd"] = build_program(whole, "fwd")
        try:
            whole_peak = live_peak(trace_job(cm, st.index))[0]
        finally:
            st.programs["fwd"] = program
        assert 3 * parts_peak < 2 * whole_peak, (parts_peak, whole_peak)
