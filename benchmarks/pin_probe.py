"""Host <-> GPU copy speed from each kind of page-locked host memory rpcompile uses.

    python -m benchmarks.pin_probe [--gib 2] [--gpus 2]

Worker threads copy from torch's pinned allocations (cudaHostAlloc); worker processes copy
from files in /dev/shm that each process maps and registers (cudaHostRegister, Note [shared
host memory]). This prints GB/s up and down for each, on one GPU and on every GPU at once.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch


def _shared(nbytes: int, flags: int) -> torch.Tensor:
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        f"pin-probe-{os.getpid()}-{flags}")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    os.unlink(path)
    t.fill_(1)                                   # fault the pages in, as a written buffer is
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, flags)
    assert int(err) == 0, err
    return t


def _kinds(nbytes):
    return {"cudaHostAlloc (threads)": lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1),
            "shm + cudaHostRegister(Portable|Mapped) (processes)": lambda: _shared(nbytes, 3),
            "shm + cudaHostRegister(default)": lambda: _shared(nbytes, 0)}


def _speed(host: torch.Tensor, device: int, reps: int = 4) -> tuple:
    torch.cuda.set_device(device)
    dev = torch.empty_like(host, device=f"cuda:{device}")
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s):
        dev.copy_(host, non_blocking=True)
    s.synchronize()
    out = []
    for direction in ("up", "down"):
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for _ in range(reps):
                if direction == "up":
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)
        s.synchronize()
        out.append(reps * host.numel() / (time.perf_counter() - t0) / 1e9)
    return tuple(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    for name, make in _kinds(nbytes).items():
        bufs = [make() for _ in range(args.gpus)]
        up, down = _speed(bufs[0], 0)
        results = [None] * args.gpus

        def one(i):
            results[i] = _speed(bufs[i], i)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.gpus)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = ", ".join(f"cuda:{i} {u:.1f}/{d:.1f}" for i, (u, d) in enumerate(results))
        print(f"{name}: one GPU up {up:.1f} GB/s, down {down:.1f} GB/s; all {args.gpus} at once (up/down) {together}",
              flush=True)


if __name__ == "__main__":
    main()
