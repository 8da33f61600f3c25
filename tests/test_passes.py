"""The compiler is a list of passes over one CompileState; every intermediate is printable."""
import os

import rpcompile
from rpcompile.passes import PASSES

from models import lm_batch, qwen3


def test_the_pass_list_runs_in_order_and_keeps_every_intermediate(tmp_path):
    names = [name for name, _, _ in PASSES]
    assert names[0] == "capture" and names.index("normalize_loss") < names.index("annotate_costs") \
        < names.index("solve_stages") < names.index("build_programs")
    cm = rpcompile.compile(qwen3(), rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    cm.train_step(**lm_batch())
    kept = cm.plan.passes
    assert [name for name, _, _ in kept] == names
    text = {name: t for name, _, t in kept}
    # normalize_loss rewrote the mean cross-entropy into a token sum: the two files differ there
    assert "cross_entropy" in text["capture"] and text["capture"] != text["normalize_loss"]
    assert "reduction = 'sum'" in text["normalize_loss"] or "'sum'" in text["normalize_loss"]
    assert "FLOPs" in text["annotate_costs"] and "rpcompile.fetch" in text["build_programs"]
    cm.dump(str(tmp_path))
    files = sorted(os.listdir(tmp_path / "train" / "passes"))
    assert files[0] == "00_capture.py" and files[2] == "02_normalize_loss.py" and len(files) == len(names)
    # the seconds of each pass, and of dynamo's capture for the capture's first plan, in plan.json
    assert list(cm.plan.compile_seconds) == ["dynamo_capture"] + names
    assert all(s >= 0 for s in cm.plan.compile_seconds.values()) and cm.plan.compile_seconds["dynamo_capture"] > 0
    import json
    assert json.load(open(tmp_path / "train" / "plan.json"))["compile_seconds"] == cm.plan.compile_seconds


def test_and_or_are_pure_although_named_like_in_place_ops():
    """operator.and_ / or_ (`a & b`, `a | b`: how transformers combines mask functions) end in an
    underscore like add_ but write nothing: dead ones are dropped, and no value counts as written."""
    import operator

    import torch
    import torch.fx as fx

    from rpcompile.passes.graph_utils import is_impure, mutated_values
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    pure = [g.call_function(operator.and_, (a, b)), g.call_function(operator.or_, (a, b))]
    written = [g.call_function(operator.iand, (a, b)), g.call_method("add_", (a, b))]
    for n in written:
        n.meta["example_value"] = torch.ones(2)
    a.meta["example_value"] = torch.ones(2)
    assert not any(is_impure(n) or mutated_values(n) for n in pure)
    assert all(is_impure(n) or mutated_values(n) == [a] for n in written)
