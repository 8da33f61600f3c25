"""Plan pieces sent to another process (runtime/portable.py): stage programs, compute graphs and
whole Stages round-trip through dumps/loads without re-tracing, keep the node meta the runtime
reads, run the same step, and name what does not pickle."""
import dataclasses
import importlib
import pickle
import threading

import pytest
import torch
import torch.fx as fx

import rpcompile
from rpcompile.passes.batch import RowCheck
from rpcompile.passes.regions import compile_regions, split_regions
from rpcompile.runtime import ops as rp
from rpcompile.runtime import portable, programs

from models import lm_batch, qwen3

VOCAB = 127


@pytest.fixture(scope="module")
def trained():
    """A 3-layer qwen3 plan after one step: fwd, fused (with fwd and bwd roles) and bwd stages,
    a tied embedding and an LM head split into 3 shards (a stage uploads rows of it)."""
    torch.manual_seed(0)
    model = qwen3(tied=True, layers=3, vocab=VOCAB)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", lm_head_shards=3))
    batch = lm_batch(vocab=VOCAB)
    cm.train_step(**batch)
    return model, cm, cm._last_plan, batch


def _graph_modules(gm, path="self"):
    """(path, GraphModule) for gm and every GraphModule below it."""
    return [(f"{path}.{name}" if name else path, m) for name, m in gm.named_modules()
            if isinstance(m, fx.GraphModule)]


def _kept(meta):
    """The meta a node keeps: rp_* facts, is_wrapped, and nn_module_stack with its classes named."""
    kept = {k: v for k, v in meta.items() if k in ("nn_module_stack", "is_wrapped") or k.startswith("rp_")}
    if "nn_module_stack" in kept:
        kept["nn_module_stack"] = {k: (path, f"{cls.__module__}.{cls.__qualname__}")
                                   for k, (path, cls) in kept["nn_module_stack"].items()}
    return kept


def test_programs_round_trip(trained):
    _, _, plan, _ = trained
    roles = {role for st in plan.stages for role in st.programs}
    assert {"fwd", "fused", "bwd"} <= roles and len(plan.stages) >= 4
    assert any("upload_weight_rows.default(" in p.code for st in plan.stages for p in st.programs.values())
    for st in plan.stages:
        for role, prog in st.programs.items():
            copy = portable.loads(portable.dumps(prog))
            pairs = list(zip(_graph_modules(prog), _graph_modules(copy)))
            assert len(pairs) == len(_graph_modules(prog)) >= 2
            for (path, a), (path_b, b) in pairs:
                where = f"stage {st.index} {role}: {path}"
                assert path == path_b and type(a).__name__ == type(b).__name__, where
                assert a.code == b.code and type(a.graph) is type(b.graph), where
                for n, m in zip(a.graph.nodes, b.graph.nodes):
                    assert (n.name, n.op, n.target) == (m.name, m.op, m.target), where
                    # nn_module_stack (regions cut by it) and rp_* facts survive; fake values do not
                    assert m.meta == _kept(n.meta), f"{where}: meta of {n.name}"
            compute = (copy.forward_graph if hasattr(copy, "forward_graph") else
                       copy.forward_part0 if hasattr(copy, "forward_part0") else copy.backward_graph.compute)
            body = [n for n in compute.graph.nodes if n.op == "call_function"]
            assert all(n.meta.get("nn_module_stack") for n in body)
            assert all("rp_cost" in n.meta for n in body) and not any("example_value" in n.meta for n in body)
            stack = next(iter(body)).meta["nn_module_stack"]
            # dynamo's (module path, module class), the class by name: a worker imports no transformers
            path, cls = list(stack.values())[-1]
            module, name = cls.rsplit(".", 1)
            assert path.startswith("L['model']") and isinstance(getattr(importlib.import_module(module), name), type)


def test_ops_by_name():
    """torch 2.13 cannot pickle op overloads at all; they travel by name."""
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.add, rp.fetch, torch.ops.rpcompile.fetch,
               torch.ops.higher_order.cond):
        assert portable.loads(portable.dumps(op)) is op
    with pytest.raises(Exception):
        pickle.dumps(torch.ops.aten.add.Tensor)


def test_stage_round_trips(trained):
    _, _, plan, _ = trained
    stages = portable.loads(portable.dumps(plan.stages))
    graphs = ("forward", "backward", "programs", "row_checks", "forward_parts")
    syms = {name: 9 for name in plan.sym_sources}
    checked = 0
    for a, b in zip(plan.stages, stages):
        for f in dataclasses.fields(a):
            if f.name not in graphs:
                assert getattr(a, f.name) == getattr(b, f.name), f"stage {a.index}: {f.name}"
        assert b.forward.code == a.forward.code
        assert (b.backward is None) == (a.backward is None)
        if a.backward is not None:
            assert b.backward.code == a.backward.code and b.backward.compute is b.forward
        assert [(ins, outs, r) for _, ins, outs, r in b.forward_parts] == \
            [(ins, outs, r) for _, ins, outs, r in a.forward_parts]
        for role, prog in b.programs.items():
            assert prog.code == a.programs[role].code
            if hasattr(prog, "forward_part0"):      # Note [forward parts]
                for p, (graph, *_) in enumerate(b.forward_parts):
                    assert getattr(prog, f"forward_part{p}") is graph, "shared, not copied"
                    assert graph.code == a.forward_parts[p][0].code
                continue
            child = getattr(prog, "forward_graph", None) or prog.backward_graph
            assert child is (b.forward if hasattr(prog, "forward_graph") else b.backward), "shared, not copied"
        assert b.row_checks.keys() == a.row_checks.keys()
        for name, fn in a.row_checks.items():
            assert isinstance(b.row_checks[name], RowCheck)
            for rows in (1, 2, 3):
                assert b.row_checks[name](rows, syms) == fn(rows, syms) == rows
                checked += 1
    assert checked
    # a row check that has run (lambdified) pickles without its compiled function
    fn = next(f for st in plan.stages for f in st.row_checks.values())
    assert fn._fn is not None and pickle.loads(pickle.dumps(fn))._fn is None


def _step(model, cm, plan, leaves, batch):
    """A train_step, then a differentiable call of the same plan (fwd and bwd roles of the fused
    stage): loss, parameter gradients, output and gradients."""
    def grads():
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = cm.train_step(**batch)
    train = grads()
    model.zero_grad(set_to_none=True)
    out = cm.runner.call(plan, leaves)[0]
    out.backward()
    return loss, train, out.detach(), grads()


def _same(a, b, what):
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{what} {i}")
    elif a is None or b is None:
        assert a is None and b is None, what
    else:
        assert torch.equal(a, b), f"{what}: max abs error {(a - b).abs().max().item():.3g}"


def test_round_tripped_stages_train_the_same(trained, monkeypatch):
    model, cm, plan, batch = trained
    plan_b, leaves = cm._plan("train", (), cm._call_kwargs(dict(batch)))
    assert plan_b is plan
    want = _step(model, cm, plan, leaves, batch)
    originals = list(plan.stages)
    copies = portable.loads(portable.dumps(originals))
    cm.runner._programs.clear()
    plan.stages[:] = copies
    built, build = [], programs.compiled     # what the runner cut into pieces: the programs it runs
    monkeypatch.setattr(programs, "compiled", lambda prog, *a: built.append(prog) or build(prog, *a))
    try:
        got = _step(model, cm, plan, leaves, batch)
        ran = {id(p) for p in built}
        assert ran and ran <= {id(p) for st in copies for p in st.programs.values()}, "the copies' programs ran"
        assert {(st.index, role) for st in copies for role in st.programs} == \
            {(k[1], k[2]) for k in cm.runner._programs}, "every role of every stage ran"
    finally:
        plan.stages[:] = originals
        cm.runner._programs.clear()
    for what, a, b in zip(("loss", "train grad", "call output", "call grad"), want, got):
        _same(a, b, what)


def test_regions_cut_round_tripped_graph_alike(trained):
    """compile_regions cuts a round-tripped graph into the same pieces: the same names, and
    piece keys equal to the original's, so they reuse its compiled pieces."""
    _, _, plan, _ = trained
    compiled = []

    def compile_fn(gm):
        compiled.append(gm)
        return gm

    shared = {}
    a = compile_regions(plan.gm, compile_fn, shared)   # the whole compute graph: three decoder layers
    b = compile_regions(portable.loads(portable.dumps(plan.gm)), compile_fn, shared)
    assert len(a.meta["rp_regions"]) >= 3 and a.meta["rp_regions"] == b.meta.get("rp_regions")
    assert len(compiled) < len(a.meta["rp_regions"]), "identical layers shared one compiled piece"
    for name in a.meta["rp_regions"]:
        assert getattr(a, name).code == getattr(b, name).code
    assert len(compiled) == len(shared), "the copy's pieces compiled nothing new"
    for st in plan.stages:   # stage graphs: cut (or left whole) alike
        copy = portable.loads(portable.dumps(st.forward))
        sa, sb = split_regions(st.forward), split_regions(copy)
        assert (sa is st.forward) == (sb is copy)
        assert sa.meta.get("rp_regions") == sb.meta.get("rp_regions")


class _Named(fx.GraphModule):
    """A GraphModule subclass (module level, so a worker finds it by name)."""


def test_nested_graph_modules_subclass_and_module_meta():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("sub.weight")
    y = g.call_module("child", (x,))
    g.output(g.call_function(torch.add, (y, w), {"alpha": 2}))
    cg = fx.Graph()
    cx = cg.placeholder("x")
    cg.output(cg.call_function(torch.ops.aten.mul.Tensor, (cx, cx)))
    child = fx.GraphModule({}, cg, "Child")
    root = torch.nn.Module()
    root.child = child
    root.sub = torch.nn.Module()
    root.sub.register_buffer("weight", torch.arange(3.0))
    gm = _Named(root, g, "Outer")
    gm.meta["rp_regions"] = ["child"]
    gm.meta["unpicklable"] = threading.Lock()   # dropped: not an rp_ entry
    gm.eval()
    got = portable.loads(portable.dumps({"graphs": [gm, child]}))["graphs"]
    assert got[0].child is got[1], "one object stays one object"
    assert isinstance(got[0], _Named) and type(got[0]).__name__ == "Outer" and not got[0].training
    assert got[0].meta == {"rp_regions": ["child"]}
    assert torch.equal(got[0].get_buffer("sub.weight"), torch.arange(3.0))
    x = torch.ones(3)
    assert torch.equal(got[0](x), gm(x)) and got[0].code == gm.code


def test_unpicklable_leftovers_are_named(trained):
    _, _, plan, _ = trained
    st = portable.loads(portable.dumps(next(s for s in plan.stages if s.kind == "fused")))
    compute = st.backward.compute
    node = [n for n in compute.graph.nodes if n.op == "call_function"][3]
    node.meta["rp_probe"] = lambda: 0
    with pytest.raises(portable.PortableError) as e:
        portable.dumps(st.programs["fused"])
    msg = str(e.value)
    assert f"node {node.name!r}" in msg and "meta['rp_probe']" in msg
    assert "backward_graph -> " in msg and ".compute -> " in msg, "the path down to the graph"
    # a SymInt left in kept meta
    fake = next(n.meta["example_value"] for n in plan.gm.graph.nodes if n.meta.get("rp_kind") == "input")
    node.meta["rp_probe"] = fake.shape[0]
    with pytest.raises(portable.PortableError, match=rf"node '{node.name}'.*SymInt"):
        portable.dumps(st)
    del node.meta["rp_probe"]
    portable.dumps(st)
    # an attribute that does not pickle
    g = fx.Graph()
    g.output((g.placeholder("x"), g.get_attr("lock")))
    root = torch.nn.Module()
    root.lock = threading.Lock()
    with pytest.raises(portable.PortableError, match=r"WithLock: attribute 'lock'.*read by node 'lock'"):
        portable.dumps([fx.GraphModule(root, g, "WithLock")])
