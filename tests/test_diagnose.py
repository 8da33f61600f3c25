"""benchmarks.diagnose runs its variants on CPU devices (a smoke test of the instrument: each
variant times its steps and puts the switch it made back)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks import diagnose
from rpcompile.runtime.flat import FlatStepper


def test_diagnose_variants_run_and_undo(tmp_path):
    threads, widen = torch.get_num_threads(), FlatStepper.WIDEN
    diagnose.main(["--model", "tiny", "--cpu", "--gpus", "2", "--layers", "2", "--steps", "2", "--seq-len", "64",
                   "--tokens-per-step", "256", "--variants", "base,peer,opt_threads_1,threads_1,no_optimizer,widen_1M,base",
                   "--out", str(tmp_path)])
    results = json.loads((tmp_path / "diagnose.json").read_text())["results"]
    assert list(results) == ["0:base", "1:peer", "2:opt_threads_1", "3:threads_1", "4:no_optimizer", "5:widen_1M",
                            "6:base"]
    for r in results.values():
        assert r["tokens_per_s"] > 0 and len(r["step_s"]) == 2
    assert results["6:base"]["optimizer_s"]["step_s"] > 0     # the optimizer steps again after no_optimizer
    assert torch.get_num_threads() == threads and FlatStepper.WIDEN == widen


@pytest.mark.parametrize("mode", ["delayed", "exact"])
def test_no_optimizer_steps_nothing_until_undone(mode):
    """The no_optimizer variant: no parameter moves while it is on (the attached optimizer's flat
    stepper steps twins of the user's optimizer, so replacing `opt.step` alone did nothing in
    overlapped and delayed modes); after its undo the steps move them again."""
    import rpcompile
    from models import lm_batch, qwen3
    model = qwen3(layers=1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"], optimizer_mode=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode != "exact":
        cm.attach_optimizer(opt)

    def steps(n):
        for t in range(n):
            cm.train_step(**lm_batch(seed=t))
            if mode == "exact":
                opt.step()
                opt.zero_grad()
        cm.synchronize()
        return [p.detach().clone() for p in model.parameters()]
    before = steps(1)
    undo = diagnose._no_optimizer(cm, opt)
    still = steps(3)
    assert all(torch.equal(a, b) for a, b in zip(before, still))
    undo()
    after = steps(3)
    assert not any(torch.equal(a, b) for a, b in zip(still, after))


def test_pyspy_samples_the_main_process_and_each_worker_process():
    """--pyspy: with worker processes the launches happen in the workers, so each is sampled."""
    procs = [SimpleNamespace(pid=11), SimpleNamespace(pid=12)]
    cm = SimpleNamespace(runner=SimpleNamespace(executor=SimpleNamespace(hub=SimpleNamespace(procs=procs))))
    assert diagnose._sampled(cm) == {"main": os.getpid(), "worker0": 11, "worker1": 12}
    threads = SimpleNamespace(runner=SimpleNamespace(executor=SimpleNamespace()))
    assert diagnose._sampled(threads) == {"main": os.getpid()}


def test_pyspy_samples_native_stacks_pausing_the_process():
    """py-spy refuses --native with --nonblocking (and writes nothing): the native sample pauses,
    the others do not."""
    native, gil = diagnose._spy_command(7, "n.txt", "--native"), diagnose._spy_command(7, "g.txt", "--gil")
    assert "--native" in native and "--nonblocking" not in native
    assert "--gil" in gil and "--nonblocking" in gil and gil[gil.index("--pid") + 1] == "7"


def test_hops_summary_of_replicas_leaves_the_sum_out():
    """A replicated job's trace has a compute span of no microbatch (the copies' gradient sum):
    the per-microbatch table leaves it out instead of failing to sort it."""
    from benchmarks.trace_hops import summarize
    spans = [{"device": f"cuda:{r}", "stream": "compute", "name": "forward+backward", "job": 0, "microbatch": r,
              "worker": r, "start_s": 0.01, "end_s": 0.35, "issue_s": 0.2} for r in range(2)]
    spans += [{"device": f"cuda:{r}", "stream": "compute", "name": "sum_replicas", "job": 0, "microbatch": None,
               "worker": r, "start_s": 0.36, "end_s": 0.37, "issue_s": 0.001} for r in range(2)]
    text = summarize(spans)
    assert "0.350" in text and "0.370" not in text.splitlines()[1]
