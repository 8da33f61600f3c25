"""What a user reads: the plan in the model's own words, and no noise they cannot act on."""
import re
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile
from rpcompile import passes
from rpcompile.passes.cost import annotate_costs

from models import lm_batch, qwen3
from test_cost import capture


def test_plan_names_module_ranges_units_and_symbols():
    cm = rpcompile.compile(qwen3(layers=3), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                             lm_head_shards=3))
    cm.train_step(**lm_batch(batch=4))
    # the same capture planned for one device (as rpcompile.Config(lm_head_shards=3) plans its
    # first call): one job, the whole model in one row
    one = passes.compile_graph(cm.plan.captured, rpcompile.Config(lm_head_shards=3), "train")
    (whole,) = [r["modules"] for r in one.stage_rows()]
    assert whole == "model.embed_tokens, model.layers.0-2, model.norm, lm_head shards 1-3/3, loss"

    text = str(cm.plan)
    rows = cm.plan.stage_rows()
    modules = [r["modules"] for r in rows]
    assert modules[0].startswith("model.embed_tokens, model.layers.0"), modules
    assert any("lm_head shard" in m and "/3" in m for m in modules), modules      # shards as k/K
    assert any("(" in m for m in modules), modules      # a layer a stage holds in part says which part
    fused = next(r for r in rows if r["kind"] == "fused")
    assert fused["modules"].endswith("loss")
    for m in modules:
        assert m in text
        assert not re.search(r"\b(cos|sin|input|mul|getitem|view)(_\d+)?\b", m), m    # no FX node names
    # sizes carry units, the batch and length symbols are explained, and every row says its device memory
    assert "KiB" in text and (" ms" in text or " us" in text)
    legend = {meaning: (sym, value) for sym, value, meaning in cm.plan.symbol_legend()}
    sym, value = legend["rows per microbatch (dim 0 of input_ids)"]
    assert value == 2 and f"{sym} = rows per microbatch (dim 0 of input_ids); costed at {value}" in text
    length, value = legend["a dynamic size: dim 1 of input_ids"]     # the sequence length (lengths.py)
    assert value == 12 and f"{length} = a dynamic size: dim 1 of input_ids; costed at 12" in text
    assert "legend:" in text and "device mem" in text and "host act" in text
    assert all(r["planned_memory"] > 0 for r in rows)
    assert cm.plan.to_json()["symbols"][sym]["value"] == 2


def test_dynamo_backend_plan_names_modules_and_dynamic_sizes():
    model = qwen3(layers=2)
    backend = rpcompile.backend(rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    batch = lm_batch(batch=4)
    try:
        compiled(**batch).loss.backward()
    finally:
        torch._dynamo.reset()   # no compiled frames or dynamic-shape state left for later tests
    text = str(backend.plans[-1])
    assert "model.embed_tokens" in text and "lm_head" in text and "model.layers.0" in text
    assert "_modules" not in text and "L['" not in text
    assert "rows per microbatch" in text and "a dynamic size: dim 1 of" in text   # the sequence length


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.embed(x))))


def test_classifier_plan_speaks_of_its_own_modules_quietly():
    """A 10-class classifier trained with a loss_fn: no `lm_head` in its plan, no warnings."""
    cm = rpcompile.compile(Classifier(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                          loss_fn=F.cross_entropy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.train_step(torch.randn(8, 12), target=torch.randint(0, 10, (8,)))
    text = str(cm.plan)
    assert "lm_head" not in text and "shard" not in text
    assert "embed" in text and "blocks." in text and "head" in text
    assert "dim 0 of args[0], target" in text


class ScaledHead(nn.Module):
    """A head with an op between logits and loss that split_lm_head does not support."""

    def __init__(self, classes=10):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.out = nn.Linear(8, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.body(x)) * 2.0, y)


def test_unsplittable_small_head_is_left_whole_without_a_warning():
    cm = rpcompile.compile(ScaledHead(), rpcompile.Config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.train_step(torch.randn(4, 8), torch.randint(0, 10, (4,)))
    # asked for shards explicitly: then it says why not and what to do, in one line
    cm = rpcompile.compile(ScaledHead(), rpcompile.Config(lm_head_shards=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm.train_step(torch.randn(4, 8), torch.randint(0, 10, (4,)))
    ours = [str(w.message) for w in caught if "split_lm_head" in str(w.message)]
    assert len(ours) == 1 and "lm_head_shards=0" in ours[0] and "\n" not in ours[0]


def _unmeasurable(t):
    raise RuntimeError("cannot run on fake tensors")


class NormType(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("norm_type", torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x).norm(dim=-1).pow(self.norm_type.item()).sum()


def test_cost_annotation_does_not_warn_about_scalar_nodes():
    """A node that only reads 0-dim tensors (a module's norm_type) is cheap: no warning if it
    cannot be measured; a real tensor op that cannot be measured still warns."""
    for target, warns in (("item", False), ("norm", True)):
        gm = capture(NormType(), torch.randn(3, 4))
        for n in gm.graph.nodes:
            if n.target == target:
                n.op, n.target, n.kwargs = "call_function", _unmeasurable, {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            annotate_costs(gm)
        assert any("could not measure" in str(w.message) for w in caught) == warns, target


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 8))
        self.out = nn.Linear(8, 4)

    def forward(self, idx):
        return self.out(torch.relu(self.table[idx]))


def test_failing_step_prints_nothing_when_the_error_is_caught(capfd):
    """torch.fx prints the generated code of a failing GraphModule call to stderr; a caught
    StageError must leave stderr empty (the error names stage, microbatch and device)."""
    cm = rpcompile.compile(Lookup(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                      loss_fn=F.mse_loss))
    idx, y = torch.randint(0, 10, (4,)), torch.randn(4, 4)
    cm.train_step(idx, target=y)
    capfd.readouterr()
    idx[3] = 17
    try:
        cm.train_step(idx, target=y)
    except rpcompile.StageError as e:
        assert "out of bounds" in str(e) and "microbatch 1" in str(e)
    else:
        raise AssertionError("no StageError")
    sys.stderr.flush()
    out, err = capfd.readouterr()
    assert "FX-traced" not in err + out and err == "", err


def test_module_paths_read_as_the_model_names_them():
    from rpcompile.plan import _clean_path
    assert _clean_path("L['model'].model.layers.3.mlp") == "model.layers.3.mlp"
    assert _clean_path("L['self'].layers[3]") == "layers.3"
    assert _clean_path("L['args'][0]._modules['model']._modules['layers']._modules['0']") == "model.layers.0"
    assert _clean_path("L['model'].__dict__['_modules']['base_model'].__dict__['_modules']['model']"
                       ".model.embed_tokens") == "base_model.model.model.embed_tokens"   # peft


def test_static_batch_backend_warns_once_and_says_what_to_do():
    """README: a backend made from a Config with num_microbatches > 1 and a static batch runs one
    microbatch, with one warning that says how to mark the batch dynamic; backend="rpcompile"
    (one microbatch) does not warn."""
    from models import MLP
    x = torch.randn(6, 8)
    try:
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.compile(MLP(), backend="rpcompile")(x).sum().backward()
        torch._dynamo.reset()
        compiled = torch.compile(MLP(), backend=rpcompile.backend(rpcompile.Config(num_microbatches=2)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                compiled(x).sum().backward()
    finally:
        torch._dynamo.reset()
    ours = [str(w.message) for w in caught if "rpcompile" in str(w.message)]
    assert len(ours) == 1 and "num_microbatches=1" in ours[0], ours
    assert "dynamic=True" in ours[0] and "mark_dynamic" in ours[0]
