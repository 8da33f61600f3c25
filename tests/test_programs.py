"""The stage programs read as what a job does; their printed form is pinned by golden files."""
import json
import os

import torch
import torch.nn.functional as F

import rpcompile

from models import MLP

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "mlp_programs.txt")


def _compiled_mlp():
    torch.manual_seed(0)
    cm = rpcompile.compile(MLP(depth=2), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                          loss_fn=F.mse_loss, memory_budget=6000))
    cm.train_step(torch.randn(4, 8), target=torch.randn(4, 4))
    return cm


def _programs_text(cm):
    parts = []
    for st in cm.plan.stages:
        parts.append(f"### stage {st.index} ({st.kind}) span {st.span}\n{st.program.code.strip()}\n")
    return "\n".join(parts)


def test_stage_programs_match_golden():
    text = _programs_text(_compiled_mlp())
    if os.environ.get("RPCOMPILE_UPDATE_GOLDEN"):
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read(), "stage programs changed; rerun with RPCOMPILE_UPDATE_GOLDEN=1 if intended"


def test_program_order_and_print_readable():
    cm = _compiled_mlp()
    kinds = [st.kind for st in cm.plan.stages]
    assert kinds[0] == "fwd" and "fused" in kinds and kinds[-1] == "bwd"
    for st in cm.plan.stages:
        code = st.program.code
        assert code.index("wait(") < code.index("compute(") < code.index("done(")
        if "fetch(" in code and "weight(" in code:
            assert code.index("fetch(") < code.index("weight("), "activations are uploaded before weights"
    fused = next(st for st in cm.plan.stages if st.kind == "fused")
    assert "loss_seed(" in fused.program.code and "accumulate_grads(" in fused.program.code
    assert "vjp(" in fused.backward.code
    assert isinstance(cm.stages[1].program.print_readable(print_output=False), str)


def test_dump_writes_graphs_and_plan(tmp_path):
    cm = _compiled_mlp()
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
