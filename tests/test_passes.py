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
