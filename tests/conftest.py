import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
