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

# Note [the suite's collections]: a test process keeps what it imported and every capture the
# suite shares (tests/capture_cache.py), and a full garbage collection walks all of it: 108 s of
# one pytest worker's ~550 s went to collections, 38 full ones of up to 2.4 s. So what lives on
# is frozen (gc.freeze: later collections skip it): the imports here, and after each test file
# what survives a collection (a file's objects that live on are the shared captures; a file's
# garbage is collected before the freeze). With both, that worker's collections took 52 s, and
# the suite 623 s against 723 s (user CPU 970 s against 1,210 s), with the kept captures'
# wider key of the same commit.
# (The library freezes its worker processes' compiled programs alike: runtime/timeline.py.)
import gc  # noqa: E402
import importlib  # noqa: E402

importlib.import_module("transformers")      # (what every test file imports: frozen with the rest)
gc.freeze()
# Within a file, a capture makes hundreds of thousands of objects (dynamo's trace, fake tensors,
# sympy), and the default thresholds (700, 10, 10) collected the young generations ~30,000 times
# in a worker and what the file's tests left 230-285 times: 110 s of the two workers' time in a
# suite run (95th session). Collected less often, the full collections are mostly the files' own
# (above) and the tests': 64 s, the suite 683 -> 625 s (one run each, peak RSS 1.9 -> 1.7 GB).
gc.set_threshold(20_000, 50, 1_000)


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


@pytest.fixture(autouse=True, scope="module")
def _frozen_after_each_file():
    """Note [the suite's collections]."""
    yield
    from rpcompile.runtime import timeline
    timeline.freeze_survivors()      # (a collection, then gc.freeze: Note [a collection of its own])


# Note [longest files first]: with --dist loadfile each file runs whole in one worker, and the
# workers take files in collection order, alphabetical: test_zoo.py (about 90 s) came last, and
# one worker ran it while the other had nothing left. The longest files go first, the rest keep
# their order (a suite run's per-file seconds, 2 cores: benchmarks 104, zoo 92, processes 81,
# launcher 74, parity 73, finetune 66, cost 44, regions 44).
_LONGEST_FIRST = ("test_benchmarks", "test_zoo", "test_processes", "test_launcher", "test_parity", "test_finetune",
                  "test_cost", "test_regions")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
