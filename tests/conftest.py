import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on 2 cores: one intra-op thread per test process and per worker process it
    # starts (measured 8-10% less wall time than two each, on the 2-core CI machine)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
else:
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
