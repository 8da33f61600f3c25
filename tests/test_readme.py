"""Every ```python block of README.md runs as written, in order, in one namespace (later
snippets use the tiny model an earlier one defines). A block whose first line is `# on GPUs`
runs with each "cuda:N" replaced by "cpu", as the README says."""
import re
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_MARK = "# on GPUs"


def python_blocks() -> list:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def as_run_here(block: str) -> str:
    if block.startswith(GPU_MARK) and not torch.cuda.is_available():
        return re.sub(r'"cuda:\d+"', '"cpu"', block)
    return block


def test_readme_has_the_entry_points():
    text = README.read_text()
    for needed in ("loss_fn=", "target=", 'backend="rpcompile"', "rpcompile.backend(rpcompile.Config(",
                   "print(cm.plan)", "cm.last_trace", "one CPU device and one microbatch"):
        assert needed in text, needed
    assert any(b.startswith(GPU_MARK) for b in python_blocks())


@pytest.fixture
def fresh_dynamo():
    """The snippets compile with dynamo backends: leave no automatic-dynamic state for later tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_readme_snippets_run(tmp_path, monkeypatch, capsys, fresh_dynamo):
    monkeypatch.chdir(tmp_path)            # cm.dump("rp_dump/") writes here
    namespace = {"__name__": "readme"}
    blocks = python_blocks()
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        code = compile(as_run_here(block), f"README.md python block {i + 1}", "exec")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # peft/transformers deprecations
            exec(code, namespace)
    printed = capsys.readouterr().out
    assert "model.layers.0" in printed and "rows per microbatch" in printed   # print(cm.plan)
    assert (tmp_path / "rp_dump" / "train" / "plan.json").is_file()
    assert torch.isfinite(namespace["loss"])
