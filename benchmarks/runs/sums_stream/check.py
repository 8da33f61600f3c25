"""53rd session: Note [copies' sum beside the next step] (runtime/replicas.py) on one GPU. Two copies
cannot share a GPU through NCCL, so the other copy is played by a stand-in collective: the
all-to-all sleeps ~0.1 s in the sums stream, then hands this copy its own part of slice 0 as the
other copy's. Three runs of one job a copy, with the real DeviceRuntime and PeerExchange:

- kept (one job a copy): the compute stream's next work ends while the sum still sleeps (the next
  step's forward does not wait), and each run's download holds 2x its own run's values, so the
  next run's first accumulation waited for the last sum and download (KeptSum.free);
- the same with KeptSum.free dropped (no wait): some run's download is wrong (the check can fail);
- not kept (several jobs a copy): the compute stream waits for the sum;
- another job (run 2 another plan's): the kept accumulator is given back (KeptSum.release, the
  compute stream waiting for what is in flight on it) and run 2 makes its own: run 1's download
  stays right; also without that wait ("another job, no wait"), as the download's record_stream
  keeps the caching allocator from handing the memory out before the download has read it.

From the repository root: `python benchmarks/runs/sums_stream/check.py` (prints one line a case)."""
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
from rpcompile.runtime.device import DeviceRuntime           # noqa: E402
from rpcompile.runtime.replicas import KeptSum, PeerExchange  # noqa: E402

N, NUMEL, SLEEP = 2, 1 << 22, int(2e8)


def slow_all_to_all(out, inp, group=None):
    torch.cuda._sleep(SLEEP)
    out.view(N, -1).copy_(inp.view(N, -1)[:1].expand(N, -1))


dist.all_to_all_single = slow_all_to_all
dev = DeviceRuntime(torch.device("cuda:0"))
dev.enter_thread()
step = SimpleNamespace(error=None, failed_copies=set(), micro=[None] * 4, grads=SimpleNamespace(dtype=torch.bfloat16))


def release_without_wait(self, dev):
    self.padded, self.key, self.free = None, None, None


def runs(case):
    kept = KeptSum() if case != "not kept" else None
    if case == "another job, no wait":
        KeptSum.release = release_without_wait
    hosts, overlapped = [], []
    for run in range(3):
        ex = PeerExchange(N, lambda keys: None, lambda: None)
        ex.kept, ex.kept_key = kept, ("b" if case.startswith("another job") and run == 2 else "a")
        ex.arrive(1, [0])
        acc = ex.accumulator(0, dev, torch.empty(NUMEL), None, torch.float32)
        acc.copy_(torch.arange(NUMEL, device=dev.device, dtype=torch.float32) % 1000 + run)   # first gradients
        ex.share(0, acc, {0}, dev, step, NUMEL)
        total = ex.reduce(0, dev, NUMEL)
        summed = torch.cuda.Event()
        summed.record(dev.sums)
        host = torch.empty(NUMEL // N, dtype=torch.bfloat16, pin_memory=True)
        down = dev.download_into(total, host, after="sums")
        ex.landed(down, dev)
        if case == "no wait":
            kept.free = None
        nxt = torch.cuda.Event()
        nxt.record(dev.compute)       # (what the compute stream runs next is queued behind this)
        nxt.synchronize()
        overlapped.append(not summed.query())
        hosts.append((host, down))
        del ex, acc, total        # (so a released accumulator's memory can serve the next run)
    right = []
    for run, (host, down) in enumerate(hosts):
        down.resolve()
        want = (2 * (torch.arange(NUMEL // N, dtype=torch.float32) % 1000 + run)).bfloat16()
        right.append(bool(torch.equal(host, want)))
    return overlapped, right


for case in ("kept", "no wait", "not kept", "another job", "another job, no wait"):
    t0 = time.perf_counter()
    overlapped, right = runs(case)
    print(f"{case}: compute went on while the sum ran {overlapped}; downloads right {right} "
          f"({time.perf_counter() - t0:.2f} s)", flush=True)
