"""Host working copies (runtime/weights.py): rewritten only when a parameter changed, never
while an upload reads them, with one wait per stream and one copy call for many parameters."""
import time

import torch

from rpcompile.runtime import weights
from rpcompile.runtime.shared import SharedMemory
from rpcompile.runtime.weights import DelayedWeights, HostWeights, upload_mark, wait_for_uploads

from parity import FakeEvent


def test_only_the_newest_upload_of_each_stream_is_waited_on():
    events = [FakeEvent() for _ in range(5)]
    marks = [upload_mark(events[0], "s0"), upload_mark(events[1], "s1"), upload_mark(events[2], "s0"),
             upload_mark(events[3], "s1"), upload_mark(None, "s2")]
    wait_for_uploads(list(reversed(marks)))
    assert [e.waited for e in events[:4]] == [0, 0, 1, 1]


def test_refresh_many_rewrites_changed_copies_only():
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    hw = HostWeights(pin=False)
    copies, events = [], []
    for p in params:
        with hw.refreshed(p, torch.bfloat16) as entry:
            events.append(FakeEvent())
            hw.mark_upload(entry, events[-1], "stream")
            copies.append(entry)
    with torch.no_grad():
        params[0].add_(1.0)
        params[2].mul_(2.0)
    before = copies[1][1].clone()
    hw.refresh_many(params, torch.bfloat16)
    for p, entry in zip(params, copies):
        assert torch.equal(entry[1], p.detach().to(torch.bfloat16))
        assert entry[0] == p._version
    assert torch.equal(copies[1][1], before)
    assert events[2].waited == 1 and events[0].waited == 0   # the newest upload only


def test_delayed_write_many_goes_to_one_slot():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    dw = DelayedWeights(params + [frozen], torch.bfloat16, pin=False)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    dw.write_many(params, 1)
    for p in params:
        slots = dw._copies[id(p)]
        assert torch.equal(slots[1][0], p.detach().to(torch.bfloat16))
        assert not torch.equal(slots[0][0], slots[1][0])
    assert dw._copies[id(frozen)][0] is dw._copies[id(frozen)][1]


def test_rows_of_a_parameter_are_views_of_its_one_copy():
    """A tied embedding is uploaded whole by one job and by vocabulary rows by others: one copy,
    rows of it, refreshed as one when the parameter moves; a stream's newer upload replaces its
    older mark, and a rewrite waits for the newest upload of every stream that read the copy."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    hw = HostWeights(pin=False)
    events = [FakeEvent() for _ in range(3)]
    with hw.refreshed(p, torch.bfloat16) as whole:
        hw.mark_upload(whole, events[0], "s0")
    with hw.refreshed(p, torch.bfloat16, rows=(2, 4)) as part:
        assert part[1].data_ptr() == whole[1][2:4].data_ptr() and torch.equal(part[1], p.detach()[2:4].bfloat16())
        hw.mark_upload(part, events[1], "s0")
    with hw.refreshed(p, torch.bfloat16, rows=(4, 6)) as part:
        hw.mark_upload(part, events[2], "s1")
    assert [m[2] for m in whole[2]] == [events[1], events[2]]
    assert hw.nbytes() == p.numel() * 2
    with torch.no_grad():
        p.mul_(3.0)
    with hw.refreshed(p, torch.bfloat16, rows=(0, 2)) as part:
        assert torch.equal(whole[1], p.detach().bfloat16())
    assert [e.waited for e in events] == [0, 1, 1]


def test_a_jobs_delayed_copies_go_up_as_runs_of_adjacent_copies():
    """Note [one upload per run] (runtime/device.py): the copies a job reads, sorted by address,
    fall into runs of copies that continue each other; each run is one tensor over its copies."""
    from rpcompile.runtime.device import upload_runs
    from rpcompile.runtime.flat import _joined

    params = [torch.nn.Parameter(torch.randn(n, 3)) for n in (2, 5, 1, 4, 3)]
    params.append(torch.nn.Parameter(torch.randn(2, 3), requires_grad=False))   # frozen: a buffer of its own
    store = DelayedWeights(params, torch.bfloat16, pin=False)
    job = [(0, params[0]), (4, params[4]), (5, params[5]), (1, params[1]), (3, params[3])]   # not in address order
    with store.view(1).held(job) as entries:
        ptrs = [e[1].data_ptr() for _, e in entries]
        assert ptrs == sorted(ptrs)                                # address order
        # 2 is not in the job; the frozen 5 has a buffer of its own, below or above the flat one
        assert [i for i, _ in entries if i != 5] == [0, 1, 3, 4] and len(entries) == 5
        runs = upload_runs(entries)
        assert sorted([i for i, _ in run] for run in runs) == [[0, 1], [3, 4], [5]]
        for run in runs:
            joined = _joined([e[1] for _, e in run])
            assert joined.data_ptr() == run[0][1][1].data_ptr()
            assert torch.equal(joined, torch.cat([params[i].detach().to(torch.bfloat16).reshape(-1) for i, _ in run]))


def test_held_copies_and_write_many_take_their_locks_in_one_order():
    """A prefetch holds the locks of a job's copies while it issues their upload, and the
    optimizer thread those of the copies it rewrites: both in address order, so neither waits for
    the other forever whatever order each was given its parameters in."""
    import random
    import threading

    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(12)]
    store = DelayedWeights(params, torch.bfloat16, pin=False)
    stop = time.monotonic() + 1.0
    errors = []

    def prefetcher(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            job = rng.sample(list(enumerate(params)), 6)
            with store.view(0).held(job):
                pass

    def optimizer(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            store.write_many(rng.sample(params, 6), 0)

    threads = [threading.Thread(target=f, args=(s,), daemon=True) for s, f in enumerate([prefetcher, optimizer] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        if t.is_alive():
            errors.append("deadlock")
    assert not errors


def test_a_frozen_parameter_in_its_working_dtype_is_its_own_copy():
    """Note [frozen weights in place]: a frozen parameter already in the working dtype is read
    where it lies (no copy, no bytes); one that trains, or in another dtype, is copied; one
    unfrozen, or given new memory, gets a copy, or is read there, from then on."""
    base = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16), requires_grad=False)
    wide = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)       # fp32: a bf16 copy
    trained = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
    hw = HostWeights(pin=False)
    for p, own in ((base, True), (wide, False), (trained, False)):
        with hw.refreshed(p, torch.bfloat16) as entry:
            assert (entry[1].data_ptr() == p.data_ptr()) is own
            assert torch.equal(entry[1], p.detach().bfloat16())
    assert hw.nbytes() == 2 * (wide.numel() + trained.numel())
    with torch.no_grad():
        base.mul_(2.0)                         # a write of the user's (a LoRA base reloaded)
    with hw.refreshed(base, torch.bfloat16, rows=(1, 3)) as part:
        assert part[1].data_ptr() == base[1:3].data_ptr() and torch.equal(part[1], base.detach()[1:3])
    base.data = torch.randn(6, 4, dtype=torch.bfloat16)                    # new memory
    with hw.refreshed(base, torch.bfloat16) as entry:
        assert entry[1].data_ptr() == base.data_ptr()
    base.requires_grad_(True)                 # unfrozen: the optimizer writes it, so a copy
    with hw.refreshed(base, torch.bfloat16) as entry:
        assert entry[1].data_ptr() != base.data_ptr() and torch.equal(entry[1], base.detach())
    assert hw.nbytes() == 2 * (wide.numel() + trained.numel() + base.numel())
    assert len(hw.release()) == 3              # (the copies let go: not a parameter's own memory)


def test_delayed_copies_of_a_frozen_parameter_in_its_working_dtype_are_the_parameter():
    trained = torch.nn.Parameter(torch.randn(5))
    base = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    dw = DelayedWeights([trained, base], torch.float32, pin=False)
    assert dw._copies[id(base)][0] is dw._copies[id(base)][1] and dw._copies[id(base)][0][0].data_ptr() == base.data_ptr()
    assert dw.nbytes() == 2 * trained.numel() * 4 and all(b.data_ptr() != base.data_ptr() for b in dw.buffers)
    with torch.no_grad():
        base.add_(1.0)
    assert dw.written_since([trained, base]) == [base]
    dw.rewrite_shared([base])                 # (nothing to copy: it is the parameter)
    assert dw.written_since([trained, base]) == []
    assert torch.equal(dw.view(1).shared_copy(base, torch.float32), base.detach())


def test_frozen_parameters_move_into_the_shared_memory_worker_processes_read(monkeypatch):
    """Note [frozen weights in place] with worker processes: a frozen parameter in its working
    dtype moves into the run's shared files (its data a view there, its values kept, its old
    memory let go), a chunk at a time, and is its own copy; one that trains, or in another
    dtype, is copied as before."""
    monkeypatch.setattr(weights, "SHARED_CHUNK", 2 * 6 * 4 * 2)        # two of the bf16 parameters a file
    memory = SharedMemory()
    try:
        base = [torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16), requires_grad=False) for _ in range(3)]
        wide = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)         # fp32: a bf16 copy
        trained = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
        values = [p.detach().clone() for p in base]
        dw = DelayedWeights([*base, wide, trained], torch.bfloat16, pin=memory)
        refs = [memory.ref(p.detach()) for p in base]
        assert all(r is not None for r in refs) and len({r.file for r in refs}) == 2      # (2 + 1)
        assert all(torch.equal(p, v) for p, v in zip(base, values))
        assert all(dw.view(k).shared_copy(p, torch.bfloat16) is not None for k in (0, 1) for p in base)
        assert all(dw._copies[id(p)][0][0].data_ptr() == p.data_ptr() for p in base)
        assert dw.nbytes() == 2 * wide.numel() + 2 * 2 * trained.numel()
        assert memory.ref(wide.detach()) is None and memory.ref(trained.detach()) is None
        again = DelayedWeights([*base, wide, trained], torch.bfloat16, pin=memory, previous=dw)
        assert [memory.ref(p.detach()) for p in base] == refs                 # (moved once)
        assert all(again._copies[id(p)][1][0].data_ptr() == p.data_ptr() for p in base)
        hw = HostWeights(pin=memory)
        moved = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16), requires_grad=False)
        with hw.refreshed(moved, torch.bfloat16) as entry:
            assert entry[1].data_ptr() == moved.data_ptr() and memory.ref(moved.detach()) is not None
        assert hw.nbytes() == 0 and hw.release() == []
    finally:
        memory.close()
