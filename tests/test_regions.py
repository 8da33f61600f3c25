"""Regional compilation: stage graphs cut at decoder layers, identical layers compiled once."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.passes import regions
from rpcompile.passes.cut_points import body_nodes
from rpcompile.passes.regions import block_of, compile_regions, piece_key, split_regions

from models import MLP, lm_batch, qwen3
from parity import TIGHT, aot_eager_compile, plan_kept_capture, train_both


def _planned(model, batch, kept=None, **config):
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], **config))
    if kept is not None:     # the capture kept in `kept` (the first call's) is the one planned
        plan_kept_capture(cm, kept)
    cm.train_step(**batch)
    return cm


@pytest.fixture(scope="module")
def qwen3_3_layers():
    """A 3-layer Qwen3 and a dict that keeps its capture at lm_batch(): each test below plans
    that one capture with its own Config (the passes read the Config when they plan a capture,
    as a re-plan does) and reads the plan, no value of the model."""
    return qwen3(layers=3), {}


def _split_graphs(cm, program=None):
    """The compute graphs of cm's stage programs (or of `program`) that run as pieces; a forward
    job's compute may be several parts (Note [forward parts] in passes/codegen.py)."""
    for prog in [program] if program is not None else cm.runner._programs.values():
        for name, g in prog.named_children():
            if not name.startswith(("forward_", "backward_")):
                continue
            inner = getattr(g, "inner", None)
            inner = getattr(inner, "compute", inner)
            if "rp_regions" in getattr(inner, "meta", {}):
                yield inner


def _pieces(split):
    """The compiled pieces of a split graph (unwrapped from runtime.programs.Arriving and
    LengthDynamic)."""
    pieces = [getattr(split, name) for name in split.meta["rp_regions"]]
    pieces = [getattr(p, "inner", p) for p in pieces]
    return [getattr(p, "compiled", p) for p in pieces]


def test_split_cuts_one_piece_per_decoder_layer(qwen3_3_layers):
    model, kept = qwen3_3_layers
    cm = _planned(model, lm_batch(), kept=kept)
    split = split_regions(cm.plan.gm)
    pieces = _pieces(split)
    # Embedding, mask and rotary tables; the 3 layers; final norm, LM head shards and loss.
    assert len(pieces) == 5
    layer_of = [{block_of(n) for n in body_nodes(p)} for p in pieces]
    assert [{b[1] for b in blocks} for blocks in layer_of[1:4]] == [{0}, {1}, {2}]
    assert layer_of[0] == {None} and layer_of[4] == {None}
    # Canonical names: identical layers give byte-identical code, and so one compiled function.
    assert pieces[1].code == pieces[2].code == pieces[3].code
    assert piece_key(pieces[1]) == piece_key(pieces[3]) != piece_key(pieces[0])
    # A layer returns the hidden states alone: no value from inside it is held to its end
    # (Note [pieces at handed-out values]; returning each value live at a legal cut held ~16
    # token-sized values more, 7.2 GiB against 3.3 for a forward job at 65,536 tokens).
    for p in pieces[1:4]:
        assert len(next(n for n in p.graph.nodes if n.op == "output").args[0]) == 1
    compiled = []
    compile_regions(cm.plan.gm, lambda gm: compiled.append(gm) or gm, {})
    assert len(compiled) == 3     # the 3 layers share one


def test_split_graph_gives_the_same_values_and_gradients():
    """The pieces called in order compute the graph, and autograd chains through them."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm

    model = qwen3(layers=3)
    torch._dynamo.reset()     # sizes seen by earlier tests' compiles would make the batch dynamic here
    torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(**lm_batch())
    gm, inputs = captured["gm"], captured["inputs"]
    split = split_regions(gm)
    # Each layer in two pieces: this raw graph also returns every layer's key/value cache, values
    # from inside the layer (Note [pieces at handed-out values]); embedding and tail around them.
    assert split is not gm and len(split.meta["rp_regions"]) == 2 + 3 * 2

    def outputs_and_grads(fn):
        xs = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
        outs = fn(*xs)
        loss = next(o for o in outs if isinstance(o, torch.Tensor) and o.dim() == 0)
        wrt = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        return outs, torch.autograd.grad(loss, wrt)

    outs, grads = outputs_and_grads(gm)
    outs_split, grads_split = outputs_and_grads(split)
    assert len(outs) == len(outs_split)
    for o, p in zip(outs, outs_split):
        assert torch.equal(o, p)
    assert len(grads) == len(grads_split) > 0
    for g, h in zip(grads, grads_split):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)


class _Rotate(torch.nn.Module):
    """A function as a module the modeling file holds (transformers 5.25 wraps
    apply_rotary_pos_emb so): dynamo records it as `G['_ROTATE']` inside the layer's stack."""

    def forward(self, x):
        return torch.cat([-x[..., 4:], x[..., :4]], dim=-1) * 0.5 + x


_ROTATE = _Rotate()


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = _ROTATE(torch.tanh(self.a(x)))
        return x + self.b(torch.relu(h) * h.sigmoid() + h.pow(2).mean(-1, keepdim=True))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_held_outside_the_model_counts_in_its_layer():
    """Nodes traced in a module the model does not hold (Note [module path] in graph_utils.py)
    belong to the layer that called it: one piece per layer, and the plan names layers. Before,
    transformers 5.25's rotary module cut each Qwen3 layer in three (11 pieces for 5)."""
    cm = rpcompile.compile(_Stack(), rpcompile.Config(devices=["cpu"], loss_fn=F.mse_loss))
    cm.train_step(torch.randn(4, 8), target=torch.randn(4, 8))
    body = body_nodes(cm.plan.gm)
    rotated = [n for n in body if any("_ROTATE" in str(e[0]) for e in (n.meta.get("nn_module_stack") or {}).values())]
    assert rotated and {block_of(n) for n in rotated} == {("L['model'].layers", k) for k in range(3)}
    split = split_regions(cm.plan.gm)
    pieces = _pieces(split)
    blocks = [{block_of(n) for n in body_nodes(p)} for p in pieces]
    expected = [{("L['model'].layers", k)} for k in range(3)] + [{None}]     # (the loss)
    assert blocks == expected, _stray_nodes(pieces, expected)
    assert "layers.0-2" in str(cm.plan), str(cm.plan)


def _stray_nodes(pieces, expected) -> str:
    """What the test above saw where a piece held a node of another block: each such node with its
    module stack and where it was traced (it failed once in a whole-suite run with a loss node in
    "L['model'].blocks", another test's module; not reproduced)."""
    lines = []
    for p, want in zip(pieces, expected):
        for n in body_nodes(p):
            if block_of(n) not in want:
                trace = (n.meta.get("stack_trace") or "").strip().splitlines()[-2:]
                lines.append(f"{n.name} {n.target} stack={n.meta.get('nn_module_stack')} traced at {trace} "
                             f"from={n.meta.get('from_node')}")
    return "\n".join(lines)


def test_graph_without_repeated_blocks_stays_one_piece():
    # A ModuleList of single Linears is no decoder: its blocks are too small to cut out.
    cm = rpcompile.compile(MLP(depth=4), rpcompile.Config(devices=["cpu"], loss_fn=F.mse_loss))
    cm.train_step(torch.randn(4, 8), target=torch.randn(4, 4))
    assert split_regions(cm.plan.gm) is cm.plan.gm
    compiled = []
    out = compile_regions(cm.plan.gm, lambda gm: compiled.append(gm) or "whole", {})
    assert out == "whole" and compiled == [cm.plan.gm]


def test_inductor_regions_train_like_eager():
    """Qwen3 with Inductor-compiled stages on 2 CPU devices: loss, gradients and parameters
    after 2 AdamW steps equal eager; the stage holding the layers ran as compiled pieces."""
    config = rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, compile_stages=True, max_jobs=3)
    cm = train_both(qwen3(layers=2), [lm_batch(batch=4)], config, steps=2, min_stages=1)
    split = [prog.backward_graph.inner.compute for prog in cm.runner._programs.values()
             if "rp_regions" in getattr(prog.backward_graph.inner.compute, "meta", {})]
    assert split, "expected the fused stage's compute to be split into regions"
    pieces = _pieces(split[0])
    assert len(pieces) == 4 and pieces[1] is pieces[2], "the two layers share one compiled piece"
    assert isinstance(pieces[1], torch._dynamo.eval_frame.OptimizedModule)


def test_stage_programs_of_a_device_share_compiled_pieces(monkeypatch):
    """A decoder layer is compiled once per device, not once per stage program: with several
    stage jobs on one device (forward, fused and backward roles), a layer piece of one program
    is the very compiled object of another's, and results still equal eager. Config.inductor_options
    is what every stage piece is compiled with (aot_eager stands in for Inductor, which the
    options are for)."""
    monkeypatch.setattr(regions, "MIN_REPEATS", 1)
    compiles, seen = [], []
    compile_ = torch.compile

    def counting(gm, **kw):
        if "backend" in kw:        # the capture's own call
            return compile_(gm, **kw)
        compiles.append(gm)
        seen.append(kw.pop("options", None))
        return compile_(gm, **{**kw, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", counting)
    config = rpcompile.Config(devices=["cpu"], num_microbatches=2, compile_stages=True, memory_budget=TIGHT,
                              inductor_options={"cpp_wrapper": True})
    # 3 times the smallest budget: 3 stage jobs, one of each role (1.15 times made 7 jobs and 13
    # pieces to compile, against 3, for the same sharing)
    cm = train_both(qwen3(layers=2), [lm_batch()], config, steps=2, slack=3)
    assert len(cm.plan.stages) >= 3
    assert seen and all(o == {"cpp_wrapper": True} for o in seen)
    with pytest.raises(ValueError, match="inductor_options"):
        rpcompile.Config(inductor_options="cpp_wrapper")
    by_program = [{piece_key(p._orig_mod): p for split in _split_graphs(cm, prog) for p in _pieces(split)
                   if hasattr(p, "_orig_mod") and piece_key(p._orig_mod) is not None}
                  for prog in cm.runner._programs.values()]
    by_program = [d for d in by_program if d]
    common = [k for k in by_program[0] if sum(k in d for d in by_program) >= 2]
    assert common, "no piece occurs in two stage programs"
    for k in common:
        assert len({id(d[k]) for d in by_program if k in d}) == 1
    # one compile per distinct piece of the device, however many programs hold it
    keys = [piece_key(gm) for gm in compiles]
    assert len(keys) == len(set(k if k is not None else id(gm) for k, gm in zip(keys, compiles)))


def test_each_lm_head_shard_is_a_piece_of_its_own(monkeypatch):
    """An LM head of several shards is cut into one piece per shard (block (SHARD, k)), so a
    compiler cannot schedule the shards together: Inductor fused the backward of all 8 shards of
    a fused job into one kernel with 8 logit-sized outputs, all live at once (CPU output code;
    on an H100 a forward job of 14 Qwen3-1.7B shards at 65,536 tokens peaked at 12.5 GiB against
    its traced 5.75 GiB). Loss and gradients still equal eager with the pieces compiled."""
    from rpcompile.passes import lm_head
    monkeypatch.setattr(lm_head, "SHARD_SHARE", 4096)     # shards by memory: several of them
    monkeypatch.setattr(torch, "compile", aot_eager_compile(torch.compile))
    config = rpcompile.Config(devices=["cpu"], num_microbatches=2, compile_stages=True, memory_budget=TIGHT)
    # 3 times the smallest budget: 3 stage jobs (fwd, fused, bwd), half the pieces to compile of
    # the 7 jobs at 1.15 times, and still 64 shards (the cap) at this SHARD_SHARE
    cm = train_both(qwen3(layers=2), [lm_batch()], config, steps=2, slack=3)
    K = cm.plan.gm.meta["rp_lm_head"]["K"]
    assert K >= 3
    shards = []
    for p in _pieces(split_regions(cm.plan.gm)):
        ks = _shards_in(p)
        assert len(ks) <= 1, f"a piece holds several shards: {ks}"
        shards += ks
    assert sorted(shards) == list(range(K)), f"every shard a piece of its own: {sorted(shards)} of {K}"
    # Shards of one size share a compiled piece: their bounds are inputs (Note [shard bounds as inputs]).
    compiled = {id(p) for split in _split_graphs(cm) for p in _pieces(split) if _shards_in(p)}
    assert len(compiled) <= 8 < K, f"{len(compiled)} compiled pieces for {K} shards"


def _shards_in(piece) -> list:
    gm = getattr(piece, "_orig_mod", piece)
    return sorted({n.meta.get("rp_lm_head", {}).get("k") for n in gm.graph.nodes if n.op == "call_function"} - {None})


def test_a_plan_for_a_longer_length_reuses_the_compiled_layers(monkeypatch):
    """A longer sequence that the first plan cannot fit gets a plan of more, smaller jobs, cut
    elsewhere inside the layers; its whole-layer pieces are the very pieces compiled for the
    first plan (Note [pieces at handed-out values]), so only the new partial pieces compile.
    Where a forward job hands out a value from inside a layer, that layer used to be a whole-layer
    piece with one more output, compiled again for every plan."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    monkeypatch.setattr(torch, "compile", aot_eager_compile(torch.compile, backend="eager"))
    torch.manual_seed(0)
    # wider than models.qwen3, so that the plans cut inside layers; 3 layers, not 6 (as many
    # pieces to compile, and a longer capture): at 256 tokens the forward job keeps layers 0-1
    # whole and the backward jobs cut them where the 128-token plan did not (after the attention
    # norm, before the MLP), so a whole-layer piece with one more output would be compiled anew
    # (the code before Note [pieces at handed-out values] compiled 2 such pieces here)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=256))
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=1, compile_stages=True,
                                                   memory_budget=7 * 2**20))   # 4 jobs at 128 tokens, 5 at 256 (two devices: one device plans for the sum of the job times, Note [one device sums])
    cm.train_step(**lm_batch(batch=1, seq=128, vocab=512))
    layer_nodes = Counter(block_of(n) for n in body_nodes(cm.plan.gm))
    shared = next(iter(cm.runner.programs._pieces.values()))
    first = set(shared)
    cm.train_step(**lm_batch(batch=1, seq=256, vocab=512))
    assert len(cm._plans.plans()) == 2, "the longer length needs a plan of its own"
    new = [shared[k].inner.compiled._orig_mod for k in set(shared) - first]
    whole = [gm for gm in new if _whole_layer(gm, layer_nodes)]
    assert new and not whole, f"{len(whole)} of {len(new)} new pieces are whole layers compiled again"


def test_a_new_shard_count_reuses_the_compiled_shards(monkeypatch):
    """A longer length whose plan splits the LM head into more shards (6 -> 11), and moves its
    first shards into the forward job, compiles no shard again for a training call: the first
    shard takes its end as an input like the others their bounds (Note [shard bounds as
    inputs]), and a shard at a job's end is the plain shard piece, not cut at the running max and
    sum it hands out (Note [pieces at handed-out values]). Before, 9 pieces compiled at the new
    length, 4 of them for training calls; now the forward job's pieces (a new role for them)
    and the piece of the final norm where the new plan puts its job boundary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from torch._dynamo.backends.registry import lookup_backend
    compiled = []
    compile_ = torch.compile

    def counting(gm, **kw):
        if "backend" in kw:        # the capture's own call
            return compile_(gm, **kw)
        # (the eager backend: the same graphs reach it as reach aot_eager, 9 and 4 before the
        # fix as with aot_eager; this test counts them and checks no values)
        return compile_(gm, **kw, backend=lambda g, ex: (compiled.append(torch.is_grad_enabled()),
                                                         lookup_backend("eager")(g, ex))[1])
    monkeypatch.setattr(torch, "compile", counting)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=1024))
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], num_microbatches=1, compile_stages=True,
                                                   memory_budget=12 * 2**20))
    shards = []
    for seq in (256, 512):
        first = len(compiled)
        cm.train_step(**lm_batch(batch=1, seq=seq, vocab=4096))
        shards.append(cm.plan.gm.meta["rp_lm_head"]["K"])
    new = compiled[first:]
    assert len(cm._plans.plans()) == 2 and shards[1] > shards[0], shards
    assert sum(new) <= 1 and len(new) <= 5, f"{len(new)} pieces compiled at the new length, {sum(new)} for training"


def _whole_layer(gm, layer_nodes) -> bool:
    blocks = Counter(block_of(n) for n in body_nodes(gm))
    return len(blocks) == 1 and None not in blocks and all(c == layer_nodes[b] for b, c in blocks.items())


def test_shards_the_flops_rule_made_stay_in_one_graph(qwen3_3_layers):
    """Shards the memory rule did not ask for (here: a shard count given by the user; at the
    benchmarks' sizes, the FLOPs rule's) are no blocks: one piece holds them all."""
    from rpcompile.passes.regions import SHARD, block_keys
    model, kept = qwen3_3_layers
    cm = _planned(model, lm_batch(), kept=kept, lm_head_shards=4)
    assert cm.plan.gm.meta["rp_lm_head"]["K"] == 4
    assert not any(k is not None and k[0] == SHARD for k in block_keys(body_nodes(cm.plan.gm)).values())
    pieces = _pieces(split_regions(cm.plan.gm))
    holding = [p for p in pieces if any(n.meta.get("rp_lm_head") for n in p.graph.nodes)]
    assert len(holding) == 1
