"""Every host buffer of the runtime comes from runtime/host_buffers.py, which counts them
(Note [planned host memory]): warm steps allocate none, and what the runtime allocated agrees
with the host bytes `cm.plan` states."""
import threading
import warnings

import pytest
import torch

import rpcompile
from rpcompile.runtime import host_buffers, outputs, timeline

from models import lm_batch, qwen3

VOCAB = 127


def _counted_since(before):
    now = host_buffers.snapshot()
    return now[0] - before[0], now[1] - before[1]


@pytest.mark.parametrize("mode,tied", [("exact", True), ("overlapped", True), ("delayed", True), ("delayed", False)])
def test_warm_steps_allocate_no_host_buffers_and_the_plan_says_what_is_allocated(mode, tied):
    model = qwen3(tied=tied, vocab=VOCAB)
    model.model.layers[0].mlp.requires_grad_(False)       # frozen parameters: one working copy
    start = host_buffers.snapshot()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                   memory_budget="300KiB", lm_head_shards=3,
                                                   optimizer_mode=mode))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if mode != "exact":
        cm.attach_optimizer(opt)

    def step(t):
        cm.train_step(**lm_batch(vocab=VOCAB, seed=t))
        if mode == "exact":
            opt.step(), opt.zero_grad()

    for t in range(2):          # warm-up: delayed mode uses its second gradient set in step 1
        step(t)
    cm.synchronize()
    warm = host_buffers.snapshot()
    for t in range(2, 5):
        step(t)
    cm.synchronize()
    nbytes, count = _counted_since(warm)
    assert +count == {} and +nbytes == {}, f"warm steps allocated {dict(count)} buffers ({dict(nbytes)} bytes)"

    # the head is split over the vocabulary: row gradients, added into the tied embedding's
    # whole gradient, or (untied) its whole gradient in place or summed into a buffer of its own
    layout = cm.plan.host_memory.grad_layout
    keys = [k for ks in layout.keys.values() for k, _, _ in ks]
    split = {k[0] for k in keys if isinstance(k, tuple)}
    assert split and (split <= set(keys) if tied else set(layout.row_sums) | set(layout.whole_rows) == split)

    planned = cm.plan.host_memory
    allocated, _ = _counted_since(start)
    assert allocated["gradients"] == planned.grads and "gradients in flight" not in allocated
    assert allocated["working copies"] == planned.working_copies
    # CPU devices hand activations on as they are (no host copy); a GPU downloads them, into
    # the chunks of a slot set per step alive (Note [slot sets]), reused from step to step
    assert allocated["activations"] == 0 < planned.activations
    assert cm.runner.executor.slot_sets.made == planned.steps_alive == (2 if mode == "delayed" else 1)


def test_slot_sets_are_reused_once_their_copies_completed():
    """Note [slot sets]: a set given back with events is taken again only once they completed;
    a job's pool fills the set's chunks in order and adds one where they are full."""
    from rpcompile.runtime.shared import SlotPool, SlotSets

    class Event:
        done = False

        def query(self):
            return self.done

    class Chunks:
        made = []

        @classmethod
        def empty(cls, shape, dtype):
            cls.made.append(torch.empty(shape, dtype=dtype))
            return cls.made[-1]

    sets = SlotSets()
    first = sets.take()
    pool = SlotPool(Chunks, first.setdefault((0, "fwd"), []))
    a, b = pool.empty((1000,), torch.float32), pool.empty((300 << 10,), torch.uint8)
    first[(0, "fwd")].extend(pool.created)
    assert len(Chunks.made) == 2 and a.data_ptr() != b.data_ptr()     # b did not fit a's 256 KiB chunk
    ev = Event()
    sets.give(first, [ev])
    second = sets.take()                 # the copies may still read the first set's slots
    assert second is not first and sets.made == 2
    sets.give(second)
    ev.done = True
    taken = [sets.take(), sets.take()]
    assert {id(s) for s in taken} == {id(first), id(second)} and sets.made == 2
    again = SlotPool(Chunks, first[(0, "fwd")])      # the next step's same job: the same slots
    assert again.empty((1000,), torch.float32).data_ptr() == a.data_ptr()
    assert again.empty((300 << 10,), torch.uint8).data_ptr() == b.data_ptr() and not again.created
    # a set is given back by a step's finalizer, which may run in a thread holding the sets'
    # lock (Note [finalizers take no lock]): it returns at once, and the set is free after
    given = threading.Thread(target=lambda: [sets._lock.acquire(), sets.give(first), sets._lock.release()],
                             daemon=True)
    given.start()
    given.join(10)
    assert not given.is_alive() and sets.free_sets() == [first] and sets.take() is first


def test_exact_pinned_buffers_are_registered_pageable_memory_of_their_size(monkeypatch):
    """Note [exact pinned buffers]: a pinned buffer allocated once is pageable memory of exactly
    its size, page-aligned, registered with CUDA (here a stand-in), and unregistered before its
    memory goes, when the tensor object dies."""
    calls = []

    class Cudart:
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", address, nbytes))
            return 0

        def cudaHostUnregister(self, address):
            calls.append(("unregister", address, host_buffers._registered.get(address) is not None))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    before = host_buffers.snapshot()
    t = host_buffers.host_empty((3, 1000), torch.bfloat16, True, "working copies", exact=True)
    assert t.shape == (3, 1000) and t.dtype == torch.bfloat16 and t.data_ptr() % 4096 == 0
    assert calls == [("register", t.data_ptr(), 6000)]
    assert _counted_since(before)[0]["working copies"] == 6000
    address = t.data_ptr()
    del t
    timeline.collect()       # (Note [a collection of its own])
    # unregistered while its memory was still held, then let go
    assert calls[1] == ("unregister", address, True) and address not in host_buffers._registered

    class Refuses(Cudart):
        def cudaHostRegister(self, address, nbytes, flags):
            return 1

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refuses())
    monkeypatch.setattr(torch, "empty", _empty_without_pinning(torch.empty))
    monkeypatch.setattr(host_buffers, "register_failures", {})
    with pytest.warns(UserWarning, match=r"cudaHostRegister failed \(CUDA error 1\) for .* of gradients"):
        t = host_buffers.host_empty((10,), torch.float32, True, "gradients", exact=True)   # falls back to pin_memory
    assert t.shape == (10,) and not host_buffers._registered
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # warned once per kind, counted every time
        host_buffers.host_empty((10,), torch.float32, True, "gradients", exact=True)
    assert host_buffers.register_failures == {"gradients": [2, 1]}


def _empty_without_pinning(empty):
    """torch.empty that accepts pin_memory=True on a machine without CUDA (where it would fail)."""
    def f(*args, pin_memory=False, **kwargs):
        return empty(*args, **kwargs)
    return f


def test_first_call_gives_back_autotune_pinned_copies(monkeypatch):
    """Note [autotune's pinned copies]: a first call that grew torch's caching host allocator
    empties its cache (after syncing the device); one that did not, and repeat calls, leave it."""
    from rpcompile.runtime import warmup
    held = {"allocated_bytes.current": 100}
    calls = []
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(held))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", str(d))))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append(("empty",)), raising=False)
    cuda = torch.device("cuda", 0)
    assert warmup.pinned_bytes(cuda) == 100 and warmup.pinned_bytes(torch.device("cpu")) == 0
    assert not warmup.release_autotune_copies(cuda, 100) and calls == []
    held["allocated_bytes.current"] = 2 ** 33          # the autotuner's copies: 8 GiB cached
    assert warmup.release_autotune_copies(cuda, 100)
    assert calls == [("sync", "cuda:0"), ("empty",)]

    seen = []
    monkeypatch.setattr(warmup, "release_autotune_copies", lambda device, before: seen.append((str(device), before)))
    guard = warmup.WarmupGuard(torch.nn.Linear(2, 2))
    x = torch.ones(3, 2)
    guard(x)
    guard(x)                                             # a known signature: no first call
    assert seen == [("cpu", 0)]


def test_outgrown_slots_leave_the_set():
    """Note [outgrown slots]: a step whose downloads outgrew the job's chunks (a longer
    sequence) keeps only the chunks it used; a step that fits the chunks it has (the same or a
    shorter length) keeps them all, so lengths that vary do not reallocate."""
    from rpcompile.runtime.shared import SlotPool

    class Chunks:
        @staticmethod
        def empty(shape, dtype):
            return torch.empty(shape, dtype=dtype)

    def step(mine, *sizes):
        pool = SlotPool(Chunks, mine, chunk_bytes=1024)
        for n in sizes:
            pool.empty((n,), torch.uint8)
        return pool.kept(), len(pool.created)

    short, made = step([], 4096, 4096)                    # two checkpoints of a short length
    assert made == 2 and [c.numel() for c in short] == [4096, 4096]
    long, made = step(short, 8192, 8192)                  # twice the length: new chunks, the old ones go
    assert made == 2 and [c.numel() for c in long] == [8192, 8192]
    again, made = step(long, 4096, 4096)                  # the short length again: fits the first chunk
    assert made == 0 and [c.data_ptr() for c in again] == [c.data_ptr() for c in long]
    mixed, made = step(again, 16384, 8192)                # one outgrew: the chunk left unused goes
    assert made == 1 and [c.numel() for c in mixed] == [8192, 16384]


def test_idle_compile_pools_are_shut():
    """Note [idle compile pools]: a worker's Inductor compile pool (a sidecar process and its
    compiling processes) is shut once nothing has compiled for the idle time, and not before;
    the next compilation gets a pool again."""
    import threading
    import time

    from torch._inductor import async_compile, config as inductor_config

    from rpcompile.runtime import warmup

    with inductor_config.patch(compile_threads=2, worker_start_method="subprocess"):
        async_compile.shutdown_compile_workers()
        pool = async_compile.AsyncCompile.process_pool()
        assert pool.submit(int, "7").result(timeout=120) == 7
        sidecar = pool.process
        warmup._last_alone[0] = time.monotonic()
        assert not warmup.close_compile_pools_if_idle(60.0)       # compiled just now: kept
        assert async_compile._pool_set and sidecar.poll() is None
        # shut outside the lock: a compiled call (the read side) goes on while the pool ends
        warmup._last_alone[0] = time.monotonic() - 61.0
        release, real_shutdown = threading.Event(), pool.shutdown
        pool.shutdown = lambda: (release.wait(30), real_shutdown())
        closed: list = []
        closer = threading.Thread(target=lambda: closed.append(warmup.close_compile_pools_if_idle(60.0)))
        closer.start()
        while async_compile._pool_set:       # taken from Inductor first
            time.sleep(0.01)
        reader = threading.Thread(target=lambda: (warmup._LOCK.acquire_read(), warmup._LOCK.release_read()))
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive() and closer.is_alive()
        release.set()
        closer.join(timeout=60)
        assert closed == [True]
        assert sidecar.wait(timeout=30) is not None                # the sidecar ended
        assert not warmup.close_compile_pools_if_idle(60.0)        # nothing left to shut
        again = async_compile.AsyncCompile.process_pool()
        assert again is not pool and again.submit(int, "8").result(timeout=120) == 8
        async_compile.shutdown_compile_workers()


def test_a_calls_batched_output_comes_down_into_the_one_tensor_the_caller_gets():
    """Note [a call's outputs] (runtime/outputs.py): each microbatch's logits land in their rows of
    one host buffer of exactly their size (no buffer per microbatch, no concatenation); the
    rows are uneven (5 rows in 4 microbatches) and the head is split over the vocabulary. Once the
    caller lets a call's logits go, the next call's come down into the same memory (Note [reused
    host buffers]); logits the caller still holds, or a view of them, are never written again;
    a train step gives the free memory back."""
    model = qwen3(vocab=VOCAB)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=4,
                                                   memory_budget="300KiB", lm_head_shards=3))
    batches = [lm_batch(vocab=VOCAB, seed=s) for s in (3, 4, 5)]
    outputs.release()                 # (what calls of earlier tests in this process left)
    with torch.no_grad():
        want = [model(**b) for b in batches]
        before = host_buffers.snapshot()
        cm(**batches[0])              # the first call compiles; its logits are let go
        nbytes, count = _counted_since(before)
        assert count["outputs"] == 1 and nbytes["outputs"] == want[0].logits.numel() * want[0].logits.element_size()
        before = host_buffers.snapshot()
        got = cm(**batches[1])
        assert +_counted_since(before)[1] == {}, "the second call did not come down into the first's memory"
        assert got.logits.shape == want[1].logits.shape
        torch.testing.assert_close(got.logits, want[1].logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.loss, want[1].loss, rtol=1e-5, atol=1e-6)
        kept = got.logits[-2:]         # a view outlives the caller's tensor: its memory stays the caller's
        del got
        third = cm(**batches[2])
        assert _counted_since(before)[1]["outputs"] == 1
        torch.testing.assert_close(kept, want[1].logits[-2:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(third.logits, want[2].logits, rtol=1e-5, atol=1e-5)
        del kept, third
    assert len(outputs.buffers.free) == 2
    cm.train_step(**batches[0])
    assert outputs.buffers.free == []

def test_reused_regions_are_lent_again_only_when_free_and_settled():
    """Note [reused host buffers]: a region is lent again once its tensor's storage is gone and
    its writes were settled; an unsettled one goes to `drop`, as do free regions beyond twice
    the largest lease and every free one at `release`."""
    dropped = []
    lender = host_buffers.Reused("test", drop=lambda regions: dropped.extend(r.data_ptr() for r in regions))
    held = [lender.lend((256,), torch.float32, False) for _ in range(4)]
    regions = {t.data_ptr() for t, _ in held}
    for k in range(3):
        held[k][1][0] = True
    storage = held[0][0][7:9].untyped_storage()       # a caller's storage keeps its region lent
    held.clear()
    assert len(lender.free) == 2 and dropped == []
    t, settled = lender.lend((16, 16), torch.float32, False)   # the unsettled one goes now
    assert t.data_ptr() in regions and len(dropped) == 1 and dropped[0] in regions
    assert t.data_ptr() != storage.data_ptr() and len(lender.free) == 1
    del storage
    small = lender.lend((2,), torch.float32, False)[0]        # under half a region: a new one
    assert small.data_ptr() not in regions
    assert lender.release() == 2 * 1024 and lender.free == [] and len(dropped) == 3
