"""Worker processes (Config(workers="processes"), Note [worker processes]): the same results as
eager PyTorch and as worker threads, errors raised in the caller, nothing changed by a failed step."""
import copy
import dataclasses
import os
import time
import warnings

import pytest
import torch

import rpcompile

from models import lm_batch, qwen3
from parity import check_grads, close, delayed_run, scalar_loss_step, train_both
from rpcompile.runtime.processes import WorkerDied
from rpcompile.runtime.shared import SharedMemory, SharedMemoryFull, remove_stale_directories


def _config(workers="processes", memory_budget="300KiB", devices=("cpu", "cpu"), **kw):
    return rpcompile.Config(devices=list(devices), num_microbatches=2, memory_budget=memory_budget, workers=workers,
                            **kw)


class _TinyLM(torch.nn.Module):
    """Token embeddings, residual blocks of a Linear and tanh, an LM head and a mean cross-entropy
    over the counted labels (lm_batch's): a model of sequences, its length dynamic as a decoder's,
    planned on two CPU devices at a 300KiB budget as qwen3(layers=1) is (fwd, fused, bwd jobs; with
    replicas, a copy of them on each device), for tests of the workers rather than the model. A
    worker dry-runs (compiles through aot_eager) its three programs in about 3 s, against about
    13 s for qwen3(layers=1)'s."""

    def __init__(self, vocab=128, width=64, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_exact_mode_in_worker_processes_matches_eager():
    """train_step and a differentiable call (one compiled model, one pair of worker processes:
    each start is a fresh interpreter) equal eager; a worker that dies is an error in the caller."""
    from rpcompile.runtime import timeline
    timeline.reset()     # marks are the process's; this test reads its own model's
    cm = train_both(qwen3(layers=1), [lm_batch(seed=s) for s in range(2)], _config(), steps=3)
    # warm steps reuse the shared files (activation slots go back when a step ends, and the
    # gradients lent as param.grad when zero_grad() dropped them): none is added
    cm.model.zero_grad()
    files = set(os.listdir(cm.runner.executor.memory.directory))
    for s in range(3):
        cm.model.zero_grad()
        cm.train_step(**lm_batch(seed=s))
    assert set(os.listdir(cm.runner.executor.memory.directory)) == files
    # a user who keeps each step's gradients past zero_grad: each step writes a new set, and
    # every process forgets the last one's files (the workers kept them: /dev/shm grew by a
    # gradient set a step); the kept gradients read as they were, and their memory goes with them
    kept = []
    for s in range(3):
        cm.model.zero_grad()
        cm.train_step(**lm_batch(seed=s))
        kept.append([(p.grad, p.grad.clone()) for p in cm.model.parameters()])
    assert len(os.listdir(cm.runner.executor.memory.directory)) == len(files)
    assert all(torch.equal(g, value) for grads in kept for g, value in grads)
    # a larger layout (another plan's) replaces the gradient buffer: every process forgets the
    # old one's files (they stayed mapped in the workers for as long as the model lived), and the
    # next step writes the same gradients into the new one
    last = [p.grad.clone() for p in cm.model.parameters()]
    layout = cm.plan.host_memory.grad_layout
    old_file = cm.runner.executor.memory.ref(cm.runner.host_grads.flat).file
    larger = dataclasses.replace(layout, keys={**layout.keys, -1: []}, numel=layout.numel + 64)
    cm.runner.host_grads.set_for(larger).flat()
    assert not cm.runner.executor._grad_sets
    assert old_file not in os.listdir(cm.runner.executor.memory.directory)
    cm.model.zero_grad()
    cm.train_step(**lm_batch(seed=2))
    assert all(torch.equal(p.grad, g) for p, g in zip(cm.model.parameters(), last))
    assert len(os.listdir(cm.runner.executor.memory.directory)) == len(files)
    del kept
    cm.model.zero_grad()
    directory = cm.runner.executor.memory.directory
    for pid in [os.getpid()] + [p.pid for p in cm.runner.executor.hub.procs]:
        deleted = [line for line in open(f"/proc/{pid}/maps") if directory in line and "(deleted)" in line]
        assert not deleted, f"process {pid} maps removed files: {deleted[:3]}"
    # Note [setup timeline]: each worker's marks came back, in the order its first steps went
    timeline = cm.setup_timeline
    assert [r["t"] for r in timeline] == sorted(r["t"] for r in timeline)
    for w in ("worker 0", "worker 1"):
        whats = [r["what"] for r in timeline if r["where"] == w]
        first_job = next(i for i, what in enumerate(whats) if what.startswith("job "))
        assert whats.index("imported") < whats.index("set up") < whats.index("plan loaded") < first_job
        # the plan loaded without the model's modules: no transformers in a worker (Note [early workers])
        assert "model's modules imported" not in whats
        assert "compile stack imported" not in whats      # nothing compiles here (CPU, eager)
    main = [r["what"] for r in timeline if r["where"] == "main"]
    assert main.index("first call") < main.index("captured") < main.index("workers ready") < \
        main.index("train_step returned")
    # the jobs ran in the workers, alternating, and their spans came back with their devices
    assert {w for _, _, _, w in cm.last_placements} == {0, 1}
    spans = cm.last_trace
    assert {s["worker"] for s in spans if s["stream"] == "compute"} == {0, 1}
    assert all(s["end_s"] >= s["start_s"] >= -1.0 for s in spans)
    # when each compute span was issued, on the spans' clock (Note [issue lag]): on CPU devices, its start
    assert all(s["issued_s"] == pytest.approx(s["start_s"], abs=1e-9) for s in spans if s["stream"] == "compute")
    # each worker reports its caching host allocator's bytes (none pinned on CPU)
    assert cm.runner.executor.worker_pinned() == {"0:cpu": 0, "1:cpu": 0}
    # every hand-over went out at once, stamped with its worker's counter (Note [hand-over flags])
    assert all(n > 0 for n in cm.runner.executor.counters.tolist())
    # a differentiable call runs in the same workers: outputs and gradients as eager
    model = cm.model
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    batch = lm_batch(seed=2)
    out = cm(**batch)
    out.loss.backward()
    ref_out = ref(**batch)
    ref_out.loss.backward()
    close(out.loss.detach(), ref_out.loss.detach(), 1e-5, 1e-6, "loss")
    close(out.logits.detach(), ref_out.logits.detach(), 1e-5, 1e-5, "logits")
    check_grads(model, ref)
    # a worker that dies: the next step says so in the caller's thread (no hang), nothing changed
    params = [(p.detach().clone(), p.grad.clone()) for p in cm.model.parameters()]
    proc = cm.runner.executor.hub.procs[1]
    proc.kill()
    proc.wait()
    with pytest.raises(WorkerDied, match="compile the model again"):
        cm.train_step(**lm_batch(seed=0))
    assert all(torch.equal(a, p) and torch.equal(g, p.grad) for (a, g), p in zip(params, cm.model.parameters()))


@pytest.mark.parametrize("mode", ["exact", "overlapped"])
def test_frozen_parameters_move_into_the_shared_files_a_chunk_at_a_time(monkeypatch, mode):
    """Note [frozen weights in place] in exact and overlapped modes: at the plan's first step the
    frozen parameters in their working dtype (fp32 on CPU devices) move into the run's shared
    memory together, at most SHARED_CHUNK bytes a file (before, each into a file of its own at
    its first upload: a 32B LoRA base's ~700 files, each mapped and pinned by every worker), and
    the run equals eager, the frozen values unchanged."""
    from rpcompile.runtime import weights
    model = qwen3(layers=1)
    frozen = [p for n, p in model.named_parameters() if ".mlp." in n or ".self_attn." in n]
    for p in frozen:
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    chunk = 2 * max(p.nbytes for p in frozen)
    monkeypatch.setattr(weights, "SHARED_CHUNK", chunk)
    batches = [lm_batch(seed=s) for s in range(2)]
    if mode == "exact":
        cm = train_both(model, batches, _config(), steps=2)
    else:
        ref = copy.deepcopy(model)
        cm = rpcompile.compile(model, _config(optimizer_mode="overlapped"))
        cm.attach_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9))
        opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
        for b in batches:
            loss = ref(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            close(cm.train_step(**b), loss.detach(), 1e-5, 1e-6, "loss")
        cm.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            close(p.detach(), q.detach(), 1e-4, 1e-6, "parameters after 2 SGD steps")
    memory = cm.runner.executor.memory
    files: dict = {}
    for p in frozen:
        files.setdefault(memory.ref(p.detach()).file, []).append(p.nbytes)
    assert len(files) < len(frozen) and all(sum(b) <= chunk or len(b) == 1 for b in files.values()), files
    assert all(torch.equal(p, b) for p, b in zip(frozen, before))
    assert cm.runner.host_weights.nbytes() == sum(p.nbytes for p in model.parameters() if p.requires_grad)


def _lent(host_buffers) -> tuple:
    counts = host_buffers.snapshot()[1]
    return counts["call gradients"], counts["outputs"]


def test_calls_in_worker_processes_leave_no_gradient_set_behind():
    """`loss.backward(); opt.step()` on calls (an untied head split over the vocabulary: row
    sums too): a call's gradient set of its own is shared files, lent again to the next call
    once let go (Note [call gradient sets]: no new file after the first call, which each worker
    mapped and pinned; before, each call left a whole fp32 gradient set in /dev/shm: 6.4 GiB for
    Qwen3-1.7B), as is the memory of its logits (Note [a call's outputs]); a call under no_grad
    makes no gradient set; a train step lets the spare set go, in every
    process. Parameters after SGD with momentum as eager's."""
    from rpcompile.runtime import host_buffers, outputs
    model = qwen3(tied=False, layers=1, seed=4)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, _config(lm_head_shards=3))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    memory = cm.runner.executor.memory

    def files():
        return {f: os.path.getsize(os.path.join(memory.directory, f)) for f in os.listdir(memory.directory)}
    outputs.release()                 # (what calls of earlier tests in this process left)
    seen, before = [], _lent(host_buffers)
    for s in range(4):
        batch = lm_batch(seed=s)
        for m, opt, run in ((cm, opts[0], True), (ref, opts[1], False)):
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if run:
                got = loss.detach()
            else:
                close(got, loss.detach(), 1e-5, 1e-6, f"loss {s}")
        seen.append((files(), _lent(host_buffers)))
    with torch.no_grad():
        close(cm(**lm_batch(seed=9)).loss, ref(**lm_batch(seed=9)).loss, 1e-5, 1e-6, "a call under no_grad")
    assert seen[0][1][0] > before[0] and seen[0][1][1] > before[1], "the first call lent no memory"
    assert seen[1] == seen[2] == seen[3] == (files(), _lent(host_buffers))
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p.detach(), q.detach(), 1e-4, 1e-5, "parameters after 4 steps")
    spare = {memory.ref(r).file for _, r in cm.runner.host_grads.calls.free}
    assert spare and spare <= set(files())
    cm.train_step(**lm_batch(seed=5))
    assert not spare & set(files())
    # no process maps a removed file of the run (the workers dropped the sets; zero_grad the views)
    for pid in [os.getpid()] + [p.pid for p in cm.runner.executor.hub.procs]:
        deleted = [line for line in open(f"/proc/{pid}/maps") if memory.directory in line and "(deleted)" in line]
        assert not deleted, f"process {pid} maps removed files: {deleted[:3]}"


def test_shared_memory_that_is_too_small_says_how_to_fix_it(monkeypatch):
    real = os.statvfs

    def small(path):   # a 64 MiB /dev/shm, docker's default
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, 16384, 16384, 16384, st.f_files, st.f_ffree, st.f_favail,
                                  st.f_flag, st.f_namemax))
    monkeypatch.setattr(os, "statvfs", small)
    memory = SharedMemory()
    try:
        memory.empty((1024, 1024), torch.float32)      # 4 MiB fits
        with pytest.raises(SharedMemoryFull, match="shm-size"):
            memory.empty((64, 1024, 1024), torch.float32)
    finally:
        memory.close()


def test_a_killed_runs_shared_files_go_at_the_next_run_and_a_live_ones_stay():
    """Note [stale shared files]: a run killed with SIGKILL leaves its directory in /dev/shm; the
    next SharedMemory removes it, and leaves alone the directory of a run still alive."""
    import signal
    import subprocess
    import sys
    child = ("import sys, time, torch; from rpcompile.runtime.shared import SharedMemory; m = SharedMemory(); "
             "m.empty((1 << 20,), torch.uint8).fill_(1); print(m.directory, flush=True); time.sleep(120)")
    procs = [subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        dead, alive = (p.stdout.readline().strip() for p in procs)
        assert os.path.isdir(dead) and len(os.listdir(dead)) == 2      # the lock file and a buffer
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        assert os.path.isdir(dead)                                   # nothing ran at its end
        memory = SharedMemory()
        try:
            assert not os.path.exists(dead) and os.path.isdir(alive) and os.path.isdir(memory.directory)
        finally:
            memory.close()
        assert not os.path.exists(memory.directory)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert alive in remove_stale_directories() and not os.path.exists(alive)


def test_page_lock_registers_each_file_once_and_unpins_it_before_it_goes(monkeypatch):
    """Note [gradients page-locked in the main process]: the main process page-locks a file the
    first time the optimizer uploads from it, never twice, never a tensor outside its files, and
    unpins it when the file is forgotten or the memory closed (pinned pages would outlive their
    mapping)."""
    import rpcompile.runtime.shared as shared
    pinned, unpinned = [], []
    monkeypatch.setattr(shared, "cuda_register", lambda base: pinned.append(base.data_ptr()))
    monkeypatch.setattr(shared, "cuda_unregister", lambda base: unpinned.append(base.data_ptr()))
    memory = SharedMemory()
    try:
        a, b = memory.empty((1024,), torch.bfloat16), memory.empty((64, 8), torch.float32)
        assert memory.page_lock(a[100:200]) and memory.page_lock(a) and memory.page_lock(b[3])
        assert pinned == [a.data_ptr(), b.data_ptr()]
        assert not memory.page_lock(torch.zeros(4)) and len(pinned) == 2
        memory.forget([memory.ref(a).file])
        assert unpinned == [a.data_ptr()]
    finally:
        memory.close()
    assert unpinned == [a.data_ptr(), b.data_ptr()]
    assert pinned == [a.data_ptr(), b.data_ptr()]


def test_a_new_shared_file_is_resident_before_any_process_pins_it():
    """Note [shared files touched before pinning]: the process that makes a file faults its pages
    in before its registration hook runs (cudaHostRegister would make them one fault at a time),
    and the file still reads as zeros in every mapping."""
    def resident_shmem():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))
    seen = []
    memory = SharedMemory(register=lambda base: seen.append(resident_shmem()))
    try:
        before = resident_shmem()
        t = memory.empty((16 << 20,), torch.uint8)
        assert seen and seen[0] - before >= 15 << 20      # resident when the hook ran
        other = SharedMemory(directory=memory.directory)  # a worker's view of the same file
        assert int(other.tensor(memory.ref(t)).count_nonzero()) == 0
    finally:
        memory.close()


def test_a_file_that_cannot_be_page_locked_is_warned_of_once_and_copied_as_pageable(monkeypatch):
    """A registration the system refuses (a locked-memory limit) does not fail the optimizer's
    step: page_lock says False (the copy is then from pageable memory), warns once, never retries."""
    import rpcompile.runtime.shared as shared
    calls = []

    def refuse(base):
        calls.append(base.data_ptr())
        raise RuntimeError("cudaHostRegister of 4096 bytes of shared host memory failed: 2")
    monkeypatch.setattr(shared, "cuda_register", refuse)
    memory = SharedMemory()
    try:
        a, b = memory.empty((1024,), torch.float32), memory.empty((1024,), torch.float32)
        with pytest.warns(UserWarning, match="failed: 2.*synchronous"):
            assert not memory.page_lock(a)
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # once: not again for this file or the next
            assert not memory.page_lock(a) and not memory.page_lock(b)
        assert calls == [a.data_ptr(), b.data_ptr()]
    finally:
        memory.close()


def test_the_optimizer_uploads_through_the_main_processs_memory():
    """Worker processes: the attached optimizer's stepper page-locks the shared gradient files
    through the main process's SharedMemory; worker threads' gradients are pinned already."""
    model = qwen3()
    for workers, want in (("processes", True), ("threads", False)):
        cm = rpcompile.compile(model, _config(workers=workers, optimizer_mode="delayed"))
        cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        page_lock = cm.runner.overlapped.stepper.page_lock
        assert (page_lock == cm.runner.executor.memory.page_lock) if want else page_lock is None


def _bad_batch(seed):
    b = lm_batch(seed=seed)
    b["input_ids"] = b["input_ids"].clone()
    b["input_ids"][1, 3] = 10_000          # out of the vocabulary: the embedding fails in a worker
    return b


def test_delayed_mode_equals_threads_and_a_failed_step_changes_nothing(delayed_reference):
    """parity.delayed_run in worker processes, with a step whose batch fails in a worker: the
    losses and parameters of worker threads without the failure (delayed_reference)."""
    def fail(cm, model, t):
        cm.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(rpcompile.StageError) as info:
            cm.train_step(**_bad_batch(t))
        # the error names the stage and device, and the schedule with the failing job marked
        assert "on cpu" in str(info.value) and "failed]" in str(info.value)
        assert "IndexError" in str(info.value.__cause__) or "index" in str(info.value.__cause__).lower()
        cm.synchronize()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))

    losses_t, params_t = delayed_reference
    losses_p, params_p = delayed_run("processes", fail_at=2, fail=fail)
    for t, (a, b) in enumerate(zip(losses_t, losses_p, strict=True)):
        # (1e-5 as train_both's losses: one suite run read 5.25e-6 apart at step 0, fp32 sums of a
        # loss near 5 in two processes' thread pools; alone, and in the run before, it passed at 1e-6)
        close(b, a, 1e-5, 1e-7, f"loss at step {t}")
    for a, b in zip(params_t, params_p, strict=True):
        close(b, a, 1e-6, 1e-7, "parameter after 3 delayed steps")


def _backward(loss):
    loss.backward()
    return loss


def test_an_operator_of_the_models_module_loads_in_a_worker_after_importing_it():
    """Note [early workers]: a worker imports the model's modules only for a plan that names
    what they define, here an operator the model's module registers (tests/custom_op_model.py):
    the workers import it, load the plan again, and train as eager."""
    from custom_op_model import ScaledMLP
    from rpcompile.runtime import timeline
    timeline.reset()     # marks are the process's; this test reads its own model's
    batches = [{"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(s))} for s in range(2)]
    cm = train_both(ScaledMLP(), batches, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                           workers="processes", memory_budget=3000),
                    eager_step=lambda m, b: _backward(m(**b)), steps=2)
    for w in ("worker 0", "worker 1"):
        whats = [r["what"] for r in cm.setup_timeline if r["where"] == w]
        assert whats.index("model's modules imported") < whats.index("plan loaded")


def test_a_plan_a_worker_cannot_load_fails_the_step_in_the_caller(monkeypatch):
    import sys
    import types
    # a module the main process has but a fresh interpreter cannot import, registering an operator
    mod = types.ModuleType("rpcompile_ephemeral_models")
    exec("import torch\n"
         "@torch.library.custom_op('rpcompile_ephemeral::twice', mutates_args=())\n"
         "def twice(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
         "twice.register_fake(lambda x: torch.empty_like(x))\n"
         "twice.register_autograd(lambda ctx, g: g * 2)\n"
         "class Net(torch.nn.Module):\n"
         "    def __init__(self):\n        super().__init__()\n"
         "        self.a = torch.nn.Linear(8, 8)\n        self.b = torch.nn.Linear(8, 8)\n"
         "    def forward(self, x):\n        return self.b(twice(torch.tanh(self.a(x)))).square().mean()\n",
         mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    model = mod.Net()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, workers="processes",
                                                   memory_budget=3000))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(rpcompile.StageError, match="could not start the run: UnpicklingError: no operator "
                       r"torch.ops.rpcompile_ephemeral.twice(.|\n)*could not import rpcompile_ephemeral_models "
                       r"\(ModuleNotFoundError"):
        cm.train_step(torch.randn(4, 8))
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, model.parameters()))



def test_slot_chunks_a_longer_sequence_outgrew_are_forgotten_by_every_process():
    """Note [outgrown slots]: after a longer sequence the step's slot set keeps only the chunks
    its jobs used, the files of the others are gone, a known length again adds no file, and
    the gradients equal eager's over every call."""
    model = qwen3()
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, _config(memory_budget="16MiB"))
    ex = cm.runner.executor

    def step(seq):
        batch = lm_batch(batch=4, seq=seq)
        cm.train_step(**batch)
        ref(**batch).loss.backward()
        cm.synchronize()
        return set(os.listdir(ex.memory.directory)), {r.file for s in ex.slot_sets.free_sets()
                                                      for refs in s.values() for r in refs}

    # (lengths past SlotPool's 256 KiB chunk, shorter than the 2000 and 2300 tokens this took,
    # whose attention cost more every step, eager's and the workers', for the same chunks)
    step(1200)                                   # hidden states of 307,200 bytes: one chunk each
    files, short = step(1200)
    files_long, long = step(1400)                # 358,400 bytes: new chunks
    dropped = short - long
    assert dropped and long <= files_long and not dropped & files_long
    files_again, _ = step(1200)
    assert step(1200)[0] == files_again          # a known length: no new file
    check_grads(model, ref)


def test_worker_processes_start_before_the_first_capture_and_go_with_an_unrun_model():
    """Note [early workers]: the first call starts the worker processes before it captures, so
    they are running when capture fails (an InputError: float ids); the next call connects them; a model whose workers never
    got their part kills them when it goes."""
    import time

    from rpcompile.runtime import timeline
    model = qwen3(layers=1)
    cm = rpcompile.compile(model, _config())
    with pytest.raises(rpcompile.InputError):   # float ids: the embedding cannot take them
        cm.train_step(input_ids=torch.zeros(2, 8, 3), labels=torch.zeros(2, 8, dtype=torch.long))
    server, path, token, procs, _ = cm.runner.executor._early
    assert cm.runner.executor.hub is None and len(procs) == 2 and all(p.poll() is None for p in procs)
    cm.train_step(**lm_batch(seed=0))
    assert cm.runner.executor._early is None and cm.runner.executor.hub.procs == procs
    # a model that never ran: its started workers end with it
    other = rpcompile.compile(qwen3(layers=1), _config())
    with pytest.raises(rpcompile.InputError):
        other.train_step(input_ids=torch.zeros(2, 8, 3), labels=torch.zeros(2, 8, dtype=torch.long))
    early = other.runner.executor._early[3]
    del other
    timeline.collect()       # (Note [a collection of its own])
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in early) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in early)


def test_workers_are_told_the_models_modules(monkeypatch):
    """Note [early workers]: the first call starts the workers with the model's modules to
    import beside the capture (transformers' Qwen3 here), never __main__."""
    cm = rpcompile.compile(qwen3(layers=1), _config(workers="threads"))
    seen = []
    monkeypatch.setattr(cm.runner, "prestart", lambda modules=(): seen.append(list(modules)))
    cm.train_step(**lm_batch(seed=0))
    assert "transformers.models.qwen3.modeling_qwen3" in seen[0] and "__main__" not in seen[0]


def test_a_hand_over_that_comes_before_its_runs_start_waits_for_it(monkeypatch):
    """Note [hand-overs of a run] (worker.py): a differentiable call's backward run reaches one
    worker late (here 0.5 s after the other), so the first backward job's hand-over comes to it
    before that run started there; it waits for the run instead of being lost (the call hung),
    and the gradients equal eager's."""
    import threading

    from rpcompile.runtime import processes
    real = processes._Hub.to_all

    def to_all(self, msg):
        if msg[0] != "run" or msg[2]["run"] < 1:
            return real(self, msg)
        first = msg[2]["actions"][0].device
        for i, (conn, lock) in enumerate(zip(self.conns, self.locks)):
            if i == first:
                processes.send(conn, lock, msg)
            else:
                threading.Timer(0.5, processes.send, (conn, lock, msg)).start()
    monkeypatch.setattr(processes._Hub, "to_all", to_all)
    model = qwen3(layers=1)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, _config())
    batch = lm_batch(seed=2)
    done = []

    def call():
        out = cm(**batch)
        out.loss.backward()
        done.append(out.loss.detach())
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=120)
    assert done, "the backward run waited for a hand-over that had come before it started"
    ref_out = ref(**batch)
    ref_out.loss.backward()
    close(done[0], ref_out.loss.detach(), 1e-5, 1e-6, "loss")
    check_grads(model, ref)
    _steps_released(cm)      # (before the patch is undone: the receiver thread sends the releases through it)


def _steps_released(cm, timeout=30.0):
    """Wait until the main process has released every step of cm's workers (its receiver thread
    sends each release once the step is collected)."""
    import gc
    hub, deadline = cm.runner.executor.hub, time.monotonic() + timeout
    while True:
        gc.collect()
        hub.release_gone()
        if not hub.records or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not hub.records, "a step of the test was never released"


# (The tests that take this fixture and see the same environment follow one another, with no
# test that starts workers in another environment between them: they share a worker launcher,
# _one_launcher_across_tests in conftest.py.)
@pytest.fixture
def aot_eager_workers(monkeypatch):
    """Worker processes that compile stage programs with aot_eager (tests/aot_eager_workers), and
    the process's setup timeline emptied (its marks are the process's; a test reads its own model's)."""
    from rpcompile.runtime import timeline
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_eager_workers")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    timeline.reset()


@pytest.mark.parametrize("replicas", [False, True])
def test_each_worker_compiles_a_program_in_a_dry_run_before_its_job(monkeypatch, tmp_path, aot_eager_workers,
                                                                    replicas):
    """With compiled stages, a worker process dry-runs a stage program when a job of it comes up
    for the first time (Note [dry runs]): every graph compiles there, none in a job, each
    program once per worker, and the results equal eager's. Note [first programs compiled beside
    the setup]: each worker's first program (with replicas: every program) is dry-run while the
    main process still makes the first step, not after it: the main process's part of the first
    step is held here until the workers have marked those dry runs (up to two minutes; without
    the warm-up none comes before the step's jobs, and the order asserted below fails)."""
    from rpcompile.runner import GraphRunner
    from rpcompile.runtime import timeline
    real_new_step, held = GraphRunner.new_step, []
    monkeypatch.setenv("RPCOMPILE_TEST_MARKS", str(tmp_path))     # (tests/aot_eager_workers)

    def dry_runs_marked(w):     # worker w's marks so far are files named "w.n"
        return sum(open(f).read().startswith("dry run of ") for f in tmp_path.glob(f"{w}.*") if f.suffix != ".part")

    def new_step(self, *a, **k):      # the main process's own part of the first step, held
        if not held:
            deadline = time.monotonic() + 120.0
            while min(map(dry_runs_marked, (0, 1))) < (3 if replicas else 1) and time.monotonic() < deadline:
                time.sleep(0.1)
            held.append(True)
            timeline.mark("first step made")
        return real_new_step(self, *a, **k)
    monkeypatch.setattr(GraphRunner, "new_step", new_step)
    cm = train_both(_TinyLM(), [lm_batch(seed=s) for s in range(2)],
                    _config(compile_stages=True, max_jobs=3, data_parallel=replicas or None),
                    eager_step=scalar_loss_step, steps=2)
    assert [st.kind for st in cm.plan.stages] == ["fwd", "fused", "bwd"] and cm.plan.replicas == (2 if replicas else 1)
    marks = [(r["where"], r["what"]) for r in cm.setup_timeline]
    dry = [(w, what.split()[3]) for w, what in marks if what.startswith("dry run of ")]
    assert sorted(dry) == [(f"worker {w}", f"{st.index}{st.kind}") for w in (0, 1) for st in cm.plan.stages]
    made = next(r["t"] for r in cm.setup_timeline if r["what"] == "first step made")
    for w in ("worker 0", "worker 1"):
        runs = [r["t"] for r in cm.setup_timeline if r["where"] == w and r["what"].startswith("dry run of ")]
        assert max(runs) < made if replicas else runs[0] < made, (w, runs, made)
    assert not [m for m in marks if "failed" in m[1] or (m[1].startswith("job ") and "compiled" in m[1])]
    for w in ("worker 0", "worker 1"):     # Note [compile stack imported early] (worker.py)
        whats = [what for where, what in marks if where == w]
        assert whats.index("compile stack imported") < whats.index("set up")
        # Note [compile seconds by phase] (timeline.py): TorchDynamo's frame compiles, after the first dry run
        first = next(i for i, what in enumerate(whats) if what.startswith("dry run of "))
        phases = [r for r in cm.setup_timeline if r["where"] == w and r["what"].startswith("compile seconds so far: ")]
        assert any("compile_inner" in r["what"] and r["seconds"] > 0 for r in phases), phases
        assert whats.index(phases[0]["what"]) > first


def test_a_warm_up_that_fails_leaves_the_programs_to_their_jobs(monkeypatch, aot_eager_workers):
    """Note [first programs compiled beside the setup]: a warm-up the worker cannot read (here its
    parameters are missing) is marked failed; each job's program is then dry-run before the job,
    as without a warm-up, and the results equal eager's."""
    from rpcompile.runtime import processes
    real = processes._Hub.to_all
    monkeypatch.setattr(processes._Hub, "to_all", lambda self, msg: real(self, msg if msg[0] != "warm" else (
        msg[0], msg[1], {k: v for k, v in msg[2].items() if k != "params"})))
    cm = train_both(_TinyLM(), [lm_batch(seed=s) for s in range(2)], _config(compile_stages=True, max_jobs=3),
                    eager_step=scalar_loss_step, steps=2)
    whats = [(r["where"], r["what"]) for r in cm.setup_timeline]
    assert sorted(w for w, what in whats if what.startswith("warm-up on ")) == ["worker 0", "worker 1"]
    assert all("failed: KeyError: 'params'" in what for _, what in whats if what.startswith("warm-up on "))
    dry = [(w, what.split()[3]) for w, what in whats if what.startswith("dry run of ")]
    assert sorted(dry) == [(f"worker {w}", f"{st.index}{st.kind}") for w in (0, 1) for st in cm.plan.stages]
    _steps_released(cm)      # (before the patch is undone)


def test_a_jobs_outputs_are_read_once_their_copies_completed():
    """Note [outputs before the landing] (worker.py): "ended" names the output copies still in
    flight; the worker's "outputs" message, ahead of the job's landing, wakes their readers."""
    from rpcompile.runtime.device import Pending
    from rpcompile.runtime.processes import _Hub
    from rpcompile.runtime.worker import _pending_events

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done
    loss, done, running = torch.ones(()), Event(True), Event(False)
    assert _pending_events({0: {"loss": Pending(loss, done)}, 1: {"loss": loss}}) == []    # (a CPU device's: no copy)
    assert _pending_events({0: {"loss": Pending(loss, done)}, 1: {"out": (loss, Pending(loss, running))}}) == [running]
    assert _pending_events({}) == []
    hub = _Hub([], [], [], None, None)
    record = hub.record(7, {})
    run = record.new_run([0, 0], None)           # job 0 in two copies
    readers = record.outputs_landed(run, 0, 1)
    hub.outputs_landed(7, run, 0, 1)
    assert readers.is_set() and not record.outputs_landed(run, 0, 0).is_set() and not record.landed[(run, 0)].is_set()
    hub.die("gone")          # a worker's death wakes every reader too
    assert record.outputs_landed(run, 0, 0).is_set()


def test_a_landing_carries_the_spans_of_its_own_job_not_the_next_ones():
    """Note [spans of a landing]: the spans a job's "landed" message carries are those recorded up
    to its end; a span the next job records before the notifier sends the landing waits for the
    next landing (on GPUs, resolving it waited for the next job's work)."""
    from types import SimpleNamespace

    from rpcompile.runtime.trace import Tracer
    from rpcompile.runtime.worker import Worker

    tracer = Tracer([])
    tracer.add("cpu", "compute", "forward", tracer.now(), tracer.now(), job=0)
    sent, notices = [], []
    plan = SimpleNamespace(stages=[SimpleNamespace(buffers=[])], mutated_buffers=set())
    step = SimpleNamespace(param_grads={}, micro=[], error=None, plan=plan, buffers={}, run_no=0, step_id=1,
                           tracer=tracer, trace_shift=0.0)
    pool = SimpleNamespace(created=[], dropped=lambda: [])
    worker = SimpleNamespace(to_main=sent.append, later=lambda events, fn, on_error=None: notices.append(fn),
                             pool=lambda step, job: pool, memory=None, is_cuda=False, first_calls_sent=0,
                             index=0, label="cpu", device=torch.device("cpu"), peers={})
    Worker.finished(worker, step, SimpleNamespace(job=0, stage=0, role="fwd", replica=0, next_device=None,
                                                  then_reads=frozenset()))
    tracer.add("cpu", "compute", "forward", tracer.now(), tracer.now(), job=1)     # the next job, meanwhile
    notices[-1]()           # the notifier: the job's events have completed
    landed = [m for m in sent if m[0] == "landed"]
    assert [m[0] for m in sent] == ["ended", "landed"] and [s["job"] for s in landed[0][4]["spans"]] == [0]
    assert [s["job"] for s in tracer.resolve(tracer.detach())] == [1]


def test_a_step_collected_while_its_thread_holds_the_hubs_lock_is_released_after_without_a_hang():
    """Note [finalizers take no lock] (shared.py): a step's finalizer may run in a thread that
    holds the hub's lock (a garbage collection); it queues the record, and the receiver thread,
    woken, releases it: the workers are told and the slot set is free again. Dropped while the
    receiver is not reading, the step is released when a slot set is next counted or taken."""
    import multiprocessing
    import threading
    import weakref
    from rpcompile.runtime.processes import _Hub
    from rpcompile.runtime.shared import SlotSets

    class Step:
        pass
    ours, theirs = multiprocessing.Pipe()
    sets = SlotSets()
    hub = _Hub(["cpu"], [], [ours], sets, None)
    sets.gather = hub.release_gone
    told = []
    hub.to_all = told.append

    def issue(step_id):
        slots = {(1, 0, 0): [f"chunk of step {step_id}"]}
        steps = [Step()]
        weakref.finalize(steps[0], hub.step_gone, hub.record(step_id, slots))
        return steps, slots

    def drop_holding_the_lock(steps):
        def drop():
            with hub.lock:
                steps.clear()           # the finalizer runs here
        t = threading.Thread(target=drop, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the finalizer waited for a lock its own thread held"

    steps, slots = issue(7)
    drop_holding_the_lock(steps)
    assert 7 in hub.records and told == []          # queued, not released under the lock
    assert sets.free_sets() == [slots] and 7 not in hub.records and told == [("release", 7)]

    receiver = threading.Thread(target=hub.receive, daemon=True)
    receiver.start()
    steps, slots = issue(8)
    drop_holding_the_lock(steps)
    deadline = time.monotonic() + 10
    while 8 in hub.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 8 not in hub.records and told[-1] == ("release", 8)       # the receiver released it
    assert sets.take() in ({(1, 0, 0): ["chunk of step 7"]}, slots) and len(sets.free_sets()) == 1
    hub.stopping = True
    theirs.close()                  # the receiver ends, and closes its wake-up sockets
    receiver.join(10)
    assert not receiver.is_alive() and hub._wake.fileno() == -1
    hub.step_gone(hub.record(9, {}))               # a finalizer after the hub stopped: no error


def test_a_models_finalizer_run_while_its_thread_writes_to_a_worker_does_not_hang():
    """Note [finalizers take no lock] (shared.py): the executor's finalizer (processes._stop) may
    run in a thread halfway through a message to a worker, holding that connection's lock: it
    sends that worker no "stop" (a worker ends at its connection's end as well), tells the
    others, closes every connection and returns."""
    import multiprocessing
    import threading
    from rpcompile.runtime import processes
    from rpcompile.runtime.shared import SlotSets

    class Memory:
        closed = False

        def close(self):
            self.closed = True
    (ours, theirs), (other, others) = multiprocessing.Pipe(), multiprocessing.Pipe()
    hub, memory = processes._Hub(["cpu", "cpu"], [], [ours, other], SlotSets(), None), Memory()

    def collected_mid_message():
        with hub.locks[0]:
            processes._stop(hub, memory)
    t = threading.Thread(target=collected_mid_message, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and memory.closed and hub.stopping
    with pytest.raises(EOFError):
        theirs.recv()
    assert others.recv() == ("stop",)


class _Regression(torch.nn.Module):
    """Two layers, nothing repeated: each stage program's compute graph is one piece."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 5)

    def forward(self, x, t, count):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), t, reduction="sum") / count


def test_compiled_programs_of_one_piece_train_as_eager(aot_eager_workers):
    """With compiled stages, a program whose compute graph is one piece (no repeated blocks)
    takes its compile lock in a worker process under its own key, apart from its piece's
    (warmup.program_key). A dry run takes no program lock (Note [pieces compiled side by
    side]); through the backend with dynamic=True an int argument is the program's input, so
    its second value is a job's first call, which failed with "'Arriving' object has no
    attribute 'code'" (worker processes are the default on two or more GPUs)."""
    model = _Regression()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=rpcompile.backend(_config(compile_stages=True)), dynamic=True)
    g = torch.Generator().manual_seed(0)
    for count in (6, 40):
        x, t = torch.randn(6, 8, generator=g), torch.rand(6, 5, generator=g)
        loss, expected = compiled(x, t, count), ref(x, t, count)
        loss.backward()
        expected.backward()
        close(loss.detach(), expected.detach(), 1e-5, 0.0, f"loss with count {count}")
    check_grads(model, ref)


def test_spans_a_worker_cannot_read_fail_no_step(monkeypatch, aot_eager_workers):
    """A worker whose trace cannot be read (here Tracer.resolve raises in the workers, as reading
    an unfinished CUDA event did on an H200) lands its jobs without their spans: the steps train
    as eager (before, the landing carried the error and failed them), the trace has no job spans
    (a run without the failure has them), and the setup timeline says why."""
    def workers_spans(cm):
        return [s for s in cm.last_trace if s["name"] in ("forward", "forward+backward", "recompute+backward")]
    cm = train_both(_TinyLM(), [lm_batch(seed=0)], _config(), eager_step=scalar_loss_step, steps=1)
    assert workers_spans(cm)
    monkeypatch.setenv("RPCOMPILE_TEST_TRACE_FAILS", "1")
    cm = train_both(_TinyLM(), [lm_batch(seed=s) for s in range(2)], _config(), eager_step=scalar_loss_step, steps=2)
    assert not workers_spans(cm)
    lost = [r for r in cm.setup_timeline if r["what"].startswith("spans of job ")]
    assert lost and all(r["where"].startswith("worker ") and "(a test's)" in r["what"] for r in lost)


def test_a_job_names_what_a_later_run_reads_of_its_values_to_the_main_process():
    """Note [values a later run reads]: any job of a run (not only its last) names the values it
    handed on that a later run reads, those it sent the peers as it sent them; not another job's
    values, not what no later run reads, not a copy's."""
    from types import SimpleNamespace

    from rpcompile.runtime.worker import handed_later

    mine, theirs, act, unread, copied = (torch.zeros(2) for _ in range(5))
    step = SimpleNamespace(position={7: 1}, replicated=False,
                           owner=[{("grads", "h"): (1, mine), ("grads", "g"): (0, theirs), ("acts", "x"): (1, act),
                                   ("grads", "u"): (1, unread)}, {}],
                           sent={(0, ("acts", "x")): (act, ("sent", 1)), (0, ("grads", "h")): (copied, ("stale", 2))})
    memory = SimpleNamespace(ref=lambda t: ("ref", t.data_ptr()))
    job = SimpleNamespace(job=7, then_reads=frozenset({("grad", "h"), ("grad", "g"), "x"}))
    assert handed_later(step, job, memory, None) == {0: {("grads", "h"): ("ref", mine.data_ptr()),
                                                          ("acts", "x"): ("sent", 1)}}
    assert handed_later(step, SimpleNamespace(job=7, then_reads=frozenset()), memory, None) == {}
    assert handed_later(SimpleNamespace(**{**vars(step), "replicated": True}), job, memory, None) == {}


def test_a_later_run_gets_every_value_it_reads_of_the_runs_before_through_the_main_process():
    """Note [values a later run reads]: four workers, a call whose forward run has three jobs
    (0F@0 1F@1 2FB@2) and whose backward has four: its first job runs on worker 3, which ran no
    forward job and so never waited for their hand-overs, and reads job 1's boundary. Once the
    forward run ended, the main process holds for the backward run, per microbatch, every value
    of the forward run that the backward reads (the boundaries and the loss job's gradients),
    and the gradients equal eager's. (Read off the step, not by patching the hub: a test's patch
    undone while the receiver thread sends through it crashed the interpreter once, in CI.)"""
    torch.manual_seed(0)
    model = _TinyLM(layers=6)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, _config(memory_budget="200KiB", devices=["cpu"] * 4))
    batch = lm_batch(seed=1)
    out = cm(**batch)
    forward = cm.last_schedule
    handed = {mb: set(values) for mb, values in out.grad_fn.step.remote.handed.items()}
    out.backward()
    backward = cm.last_schedule
    assert {a.device for a in backward.actions} - {a.device for a in forward.actions}, (forward, backward)
    made = set().union(*(forward.stage(a.job).outputs for a in forward.actions))
    fused = set().union(*(forward.stage(a.job).inputs for a in forward.actions if a.role == "fused"))
    reads = [(backward.stage(a.job).inputs, backward.stage(a.job).grad_outputs) for a in backward.actions]
    expected = {("acts", n) for ins, _ in reads for n in ins if n in made} | \
               {("grads", n) for _, gouts in reads for n in gouts if n in fused}
    assert handed == {0: expected, 1: expected}
    ref_loss = ref(**batch)
    ref_loss.backward()
    close(out.detach(), ref_loss.detach(), 1e-5, 1e-6, "loss")
    check_grads(model, ref)
