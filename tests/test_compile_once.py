"""Note [compile each piece once] (runtime/compile_once.py): a piece's (or a program's) first call
with a new input signature holds a file lock named by its code and that signature until one
process has made that call, so worker processes that ask for the same piece at once compile it
one after the other (the later ones from Inductor's caches), and different pieces compile side
by side. Each LengthDynamic below stands for one process's copy of a piece; each lock is its own
file descriptor, as in two processes."""
import os
import threading
import time

import torch
import torch.fx as fx

import pytest

from rpcompile.runtime import programs
from rpcompile.runtime import compile_once
from rpcompile.runtime.compile_once import CompileLocks, sharing_pass
from rpcompile.runtime.programs import LengthDynamic
from rpcompile.runtime.warmup import WarmupGuard, _signature, program_key


_helpers: list = []         # _blocks' threads: each ends within the test that started it


def _join_helpers():
    while _helpers:
        _helpers.pop().join(timeout=10)


@pytest.fixture(autouse=True)
def _helpers_joined():
    """A call _blocks left waiting goes on once its lock is released; it ends before the next test
    (left running, it compiled beside that test, whose fx tracing it then broke)."""
    yield
    _join_helpers()


@pytest.fixture
def in_first_call(monkeypatch):
    """Pieces called as if inside their program's first call, where the runtime calls a piece
    with a new signature (each thread here stands for a process); _blocks' calls end inside it."""
    monkeypatch.setattr(programs, "calling_alone", lambda: True)
    yield
    _join_helpers()


def _piece(scale: float) -> fx.GraphModule:
    class M(torch.nn.Module):
        def forward(self, x):
            return x * scale
    return fx.symbolic_trace(M())


class _SlowFirstCalls:
    """Stands for torch.compile's function: the first call of a signature takes `seconds`."""

    def __init__(self, gm, log, name, seconds=0.3):
        self.gm, self.log, self.name, self.seconds, self.seen = gm, log, name, seconds, set()

    def __call__(self, *args):
        sig = tuple(a.shape for a in args)
        if sig not in self.seen:
            self.log.append(("start", self.name, time.monotonic()))
            time.sleep(self.seconds)
            self.log.append(("end", self.name, time.monotonic()))
            self.seen.add(sig)
        return self.gm(*args)


def _call_together(calls):
    threads = [threading.Thread(target=fn, args=args) for fn, args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def _span(log, name):
    return [t for kind, n, t in log if n == name]


def test_the_same_piece_compiles_in_one_process_at_a_time(tmp_path, in_first_call):
    locks, log, gm = CompileLocks(str(tmp_path)), [], _piece(2.0)
    a, b = (LengthDynamic(gm, _SlowFirstCalls(gm, log, name), locks) for name in "ab")
    x = torch.ones(3)
    _call_together([(a, (x,)), (b, (x,))])
    (a0, a1), (b0, b1) = _span(log, "a"), _span(log, "b")
    assert a1 <= b0 or b1 <= a0, log          # one after the other, never side by side
    assert torch.equal(a(x), 2 * x) and torch.equal(b(x), 2 * x)


def test_other_pieces_and_signatures_compile_side_by_side(tmp_path, in_first_call):
    locks, log = CompileLocks(str(tmp_path)), []
    g2, g3 = _piece(2.0), _piece(3.0)
    a, b, c = (LengthDynamic(g2, _SlowFirstCalls(g2, log, "a"), locks),
               LengthDynamic(g3, _SlowFirstCalls(g3, log, "b"), locks),    # other code
               LengthDynamic(g2, _SlowFirstCalls(g2, log, "c"), locks))    # same code, other shape
    _call_together([(a, (torch.ones(3),)), (b, (torch.ones(3),)), (c, (torch.ones(4),))])
    starts, ends = [min(_span(log, n)) for n in "abc"], [max(_span(log, n)) for n in "abc"]
    assert max(starts) < min(ends), log       # all three were compiling at once


def _blocks(fn, *args) -> bool:
    """Whether fn(*args) is still running after 0.3 s (it then finishes within 5 s)."""
    t = threading.Thread(target=fn, args=args)
    t.start()
    _helpers.append(t)
    t.join(timeout=0.3)
    return t.is_alive()


def test_once_one_process_made_the_call_the_others_need_no_lock(tmp_path, in_first_call):
    locks, log, gm = CompileLocks(str(tmp_path)), [], _piece(2.0)
    a, b = (LengthDynamic(gm, _SlowFirstCalls(gm, log, name, seconds=0), locks) for name in "ab")
    x = torch.ones(3)
    a(x)
    lock = locks(gm.code, _signature((x,)))
    with lock:                                # held by a third process, say
        assert not _blocks(b, x)


def test_a_first_call_that_failed_leaves_the_next_process_to_compile_alone(tmp_path, in_first_call):
    locks, gm = CompileLocks(str(tmp_path)), _piece(2.0)

    def fails(*args):
        raise RuntimeError("compile failed")
    a = LengthDynamic(gm, fails, locks)
    b = LengthDynamic(gm, _SlowFirstCalls(gm, [], "b", seconds=0), locks)
    x = torch.ones(3)
    try:
        a(x)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failing call did not raise")
    with locks(gm.code, _signature((x,))):
        assert _blocks(b, x)                  # not marked done: b takes the lock


def test_a_known_signature_takes_no_lock(tmp_path, in_first_call):
    locks, log, gm = CompileLocks(str(tmp_path)), [], _piece(2.0)
    a = LengthDynamic(gm, _SlowFirstCalls(gm, log, "a", seconds=0), locks)
    x = torch.ones(3)
    a(x)
    with locks(gm.code, _signature((x,))):        # the lock of that very call, held elsewhere: a second call must not wait
        done = []
        t = threading.Thread(target=lambda: done.append(a(x)))
        t.start()
        t.join(timeout=5)
        assert done and torch.equal(done[0], 2 * x)
    y = torch.ones(5)
    with locks(gm.code, _signature((y,))):
        assert _blocks(a, y)                  # a new signature waits for its lock


def test_no_locks_without_inductors_fx_graph_cache(tmp_path):
    """With the cache off a process that waited would compile everything again after the first."""
    from torch._inductor import config
    from rpcompile.runtime.compile_once import compile_locks
    assert isinstance(compile_locks(str(tmp_path)), CompileLocks)
    with config.patch(fx_graph_cache=False):     # (not monkeypatch: see test_capture's side-effect test)
        assert compile_locks(str(tmp_path)) is None


def test_a_piece_takes_its_lock_only_inside_its_programs_first_call(tmp_path):
    """A piece's inputs follow from its program's: outside the program's first call (the
    steady state) it computes no signature and takes no lock."""
    locks, gm = CompileLocks(str(tmp_path)), _piece(2.0)
    piece = LengthDynamic(gm, _SlowFirstCalls(gm, [], "a", seconds=0), locks)
    program = WarmupGuard(piece)
    x, y = torch.ones(3), torch.ones(4)
    with locks(gm.code, _signature((x,))):
        assert _blocks(program, x)            # the program's first call: the piece waits
    program(x)                                # (known now: waits for that first call to end)
    with locks(gm.code, _signature((y,))):
        assert not _blocks(piece, y)          # called outside one: no lock


def _in_thread(fn):
    """fn() in another thread (another process's sharing pass: its state is per thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=10)
    assert out, "the call did not return"
    return out[0]


def test_a_sharing_pass_compiles_the_pieces_no_other_process_compiles(tmp_path, in_first_call):
    """Note [pieces compiled side by side]: in a sharing pass (a dry run's first), a piece
    whose lock another process holds runs uncompiled and is left to it; a free one is this
    process's to compile, and its lock is held until the pass settles, then marked done: the
    next call elsewhere takes no lock and compiles from the caches."""
    one, two, log = CompileLocks(str(tmp_path)), CompileLocks(str(tmp_path)), []
    g2, g3 = _piece(2.0), _piece(3.0)
    a1 = LengthDynamic(g2, _SlowFirstCalls(g2, log, "a1", seconds=0), one)
    a2, b2 = (LengthDynamic(g, _SlowFirstCalls(g, log, name, seconds=0), two) for g, name in ((g2, "a2"), (g3, "b2")))
    x = torch.ones(3)
    with sharing_pass() as first:
        assert torch.equal(a1(x), 2 * x)

        def process_two():
            with sharing_pass() as second:
                out = (a2(x), b2(x))
            two.settle(True)
            return out, second.skipped
        (a, b), skipped = _in_thread(process_two)
    assert torch.equal(a, 2 * x) and torch.equal(b, 3 * x)      # a2 ran uncompiled: the same values
    assert skipped == 1 and first.skipped == 0
    assert [n for kind, n, _ in log if kind == "start"] == ["a1", "b2"]
    lock_a = one(g2.code, _signature((x,)))
    assert not os.path.exists(lock_a.lock_file + ".done")       # held until the pass settles
    assert _blocks(a2, x)                                       # two's next call waits for one
    one.settle(True)
    assert os.path.exists(lock_a.lock_file + ".done")
    time.sleep(0.5)
    assert [n for kind, n, _ in log if kind == "start"] == ["a1", "b2", "a2"]   # a2 from the caches
    with lock_a:                                                # done: later calls take no lock
        assert not _blocks(LengthDynamic(g2, _SlowFirstCalls(g2, [], "a3", seconds=0), two), x)


def test_a_sharing_pass_that_failed_marks_nothing_done(tmp_path, in_first_call):
    locks, gm = CompileLocks(str(tmp_path)), _piece(2.0)
    a = LengthDynamic(gm, _SlowFirstCalls(gm, [], "a", seconds=0), locks)
    x = torch.ones(3)
    with pytest.raises(RuntimeError):
        with sharing_pass():
            a(x)
            raise RuntimeError("the dry run failed after the piece compiled")
    locks.settle(False)
    lock = locks(gm.code, _signature((x,)))
    assert not os.path.exists(lock.lock_file + ".done")
    lock.acquire(timeout=0)                 # released
    lock.release()


def test_a_program_whose_sharing_pass_left_pieces_runs_them_next_without_its_own_lock(tmp_path):
    """The program's first call was a sharing pass that left a piece to another process: that
    call does not count as made, so the next is alone again (its pieces wait for their
    compilers), but without the program's lock (the pieces' compilers hold their locks through
    their backward: nothing of the program is left to autotune outside a piece)."""
    one, two = CompileLocks(str(tmp_path)), CompileLocks(str(tmp_path))
    gm = _piece(2.0)

    class Program(torch.nn.Module):
        code = "program"

        def __init__(self):
            super().__init__()
            self.piece = LengthDynamic(gm, _SlowFirstCalls(gm, [], "a", seconds=0), two)

        def forward(self, x):
            return self.piece(x)
    program = WarmupGuard(Program(), two)
    x = torch.ones(3)
    piece_lock, program_lock = one(gm.code, _signature((x,))), one(program_key(Program), _signature((x,)))
    with program_lock:                      # held by another process throughout
        with piece_lock:                    # another process compiles the piece
            with sharing_pass() as shared:
                assert torch.equal(program(x), 2 * x)
            assert shared.skipped == 1 and not program._seen
            assert _blocks(program, x)      # waits for the piece's compiler ...
        time.sleep(0.5)
        assert program._seen                # ... then makes its first call, the program's lock still held
    assert compile_once.skipped() == 0 and not compile_once.in_sharing_pass()


def test_a_program_of_one_piece_takes_its_lock_apart_from_its_pieces(tmp_path, monkeypatch):
    """A stage program's compute graph without repeated blocks is one piece (an Arriving around
    the compiled graph, not a GraphModule). With worker processes' locks its first call takes
    the program's lock and, inside it, the piece's, under another key (warmup.program_key). It
    failed ("'Arriving' object has no attribute 'code'") for a two-layer regression through the
    backend on one H200; under the piece's own key the piece waited on its program."""
    monkeypatch.setattr(torch, "compile", lambda gm, **kw: gm)     # what Inductor makes is not tested here
    g = fx.Graph()
    g.output(g.call_module("forward_graph", (g.placeholder("x"),)))
    prog = programs.compiled(fx.GraphModule({"forward_graph": _piece(3.0)}, g), locks=CompileLocks(str(tmp_path)))
    assert isinstance(prog.forward_graph, WarmupGuard)
    assert isinstance(prog.forward_graph.inner, programs.Arriving)
    x = torch.ones(2)
    assert torch.equal(prog(x), 3 * x)
    locks = CompileLocks(str(tmp_path))
    for code in (_piece(3.0).code, program_key(prog.forward_graph.inner)):
        assert os.path.exists(locks(code, _signature((x,))).lock_file + ".done")
