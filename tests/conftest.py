import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread in each test process and the processes it starts (worker processes,
# benchmark children, scripts): the suite runs two at once on CI's two cores, each op of these
# small models is a few microseconds of work, and two threads per process oversubscribed the
# cores (the suite ran ~10% longer, its CPU time ~12% more).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


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
