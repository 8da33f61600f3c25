"""Note [the oldest torch] (rpcompile/torch_version.py): an older torch is told at import."""
import subprocess
import sys

import pytest
import torch

from rpcompile.torch_version import OLDEST, check


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.9.1", "1.13.1", "2.5.0"])
def test_an_older_torch_is_refused_with_what_to_install(version):
    with pytest.raises(ImportError) as err:
        check(version)
    text = str(err.value)
    assert f"this is torch {version}" in text and "pip install -U 'torch>=2.11'" in text


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0a0+git1234abc", "2.13.0+cpu", "2.15.0+cu132", "3.0.0", "2.20.1"])
def test_the_oldest_and_newer_pass(version):
    check(version)


def test_this_torch_passes_and_the_floor_matches_pyproject():
    check(torch.__version__)
    import pathlib
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"torch>={OLDEST[0]}.{OLDEST[1]}"' in text


def test_importing_rpcompile_under_an_older_torch_says_so():
    """In a fresh interpreter whose torch reports 2.10: `import rpcompile` raises the ImportError
    before any module that needs the newer torch is imported."""
    code = ("import sys, torch; torch.__version__ = '2.10.0+cu128'\n"
            "try:\n    import rpcompile\nexcept ImportError as e:\n    print('refused:', e)\n"
            "print('backend imported' if 'rpcompile.backend' in sys.modules else 'nothing else imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "refused: rpcompile needs torch 2.11 or newer, and this is torch 2.10.0+cu128" in out, out
    assert "nothing else imported" in out, out
