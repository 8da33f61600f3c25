"""The oldest torch rpcompile runs on, checked when rpcompile is imported.

Note [the oldest torch]: rpcompile captures through dynamo's `ignore_logging_functions` (Note [log
calls] in capture.py), which torch 2.10 does not have: there every capture failed with an
AttributeError deep in dynamo's config. torch 2.11 is the oldest release the suite and the GPU
checks ran on (the lent GPU machines' torch; README, Known issues, says what it lacks); 2.13, 2.14
and 2.15 pass the whole suite. pip keeps to the floor through pyproject.toml; an environment that
went around it (an install with --no-deps, a torch changed after) is told at import, by name,
instead of failing at the first call.
"""
from __future__ import annotations

import re

OLDEST = (2, 11)


def check(version: str) -> None:
    """Raise ImportError, saying what to install, where `version` (torch.__version__) is older
    than OLDEST. A pre-release or local build counts as its release (2.11.0a0+git... is 2.11)."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is None or tuple(map(int, found.groups())) >= OLDEST:
        return
    oldest = ".".join(map(str, OLDEST))
    raise ImportError(f"rpcompile needs torch {oldest} or newer, and this is torch {version}: upgrade it "
                      f"(pip install -U 'torch>={oldest}', with the CUDA build your GPUs need)")
