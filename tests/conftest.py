import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _keep_captures():
    import rpcompile.compiled
    from capture_cache import kept
    rpcompile.compiled.capture_call = kept(rpcompile.compiled.capture_call)


if os.environ.get("RPCOMPILE_TEST_FRESH_CAPTURES") != "1":
    _keep_captures()     # (tests/capture_cache.py)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def delayed_reference():
    """parity.delayed_run() without a failure: losses and parameters of three delayed-mode steps
    on worker threads, run once per pytest worker (test_delayed.py and test_processes.py compare
    their failing runs with it; nothing changes it)."""
    from parity import delayed_run
    return delayed_run()
