"""How fast rpcompile's host AdamW steps bf16 gradients at each size of its widening slice.

    python -m benchmarks.widen_probe [--params 2e9] [--widen 26,24,23,22,21] [--reps 5]

FlatStepper (runtime/flat.py) steps fp32 masters with bf16 gradients a slice of WIDEN elements at
a time: the slice's gradient is widened into one reused fp32 buffer, then the fused AdamW reads it
back. At WIDEN = 2^26 that buffer is 256 MiB, past any cache, so each element's widened gradient
goes to memory and back (8 B of 34); a buffer that stays in the last-level cache would save that
traffic, for more calls (each may wait for the interpreter lock: Note [few calls per step]). On
a 2-GPU Llama-3.1-8B run the host update (2.0-2.6 s a step) sets the pace whenever it outlasts the
devices' 2.9 s (RESULTS.md, 45th session). This steps the real FlatStepper over Llama-shaped
parameters on the host alone, the slice sizes taken in turn each round (so a drift of the host
touches every size alike), and prints each size's median and best seconds a step.

On the 2-H200 host (46th session) 2^24 stepped 2.18B elements in 0.458 s against 2^26's 0.551 s,
yet in Llama-3.1-8B runs beside the devices' copies its update was no faster (2.26 against 1.98 s
a step at 1 GPU, 2.11 against 1.99-2.05 s at 2): rpcompile keeps 2^26. Run with OMP_NUM_THREADS
set, it also shows what fewer cores cost the update (32 threads 0.51-0.54 s, 24 0.54-0.56 s, 16
0.62-0.70 s, 8 0.84 s on that host).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from rpcompile.runtime.flat import FlatMasters, FlatStepper

from .common import LR, WEIGHT_DECAY


def _shapes(n: float) -> list:
    """Llama-3.1-8B-shaped tensors (hidden 4096, MLP 14336, 8 KV heads) adding up to about n elements."""
    h, f, kv = 4096, 14336, 1024
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    shapes, total = [], 0
    while total < n:
        shapes += layer
        total += sum(torch.Size(s).numel() for s in layer)
    return shapes


def probe(n: float, widths: list, reps: int) -> dict:
    """{WIDEN: [seconds of each step]} over parameters of about n elements."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in _shapes(n)]
    masters = FlatMasters()
    masters.flatten(params)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    stepper = FlatStepper(opt, masters)
    flat = (torch.randn(masters.buffers[0].numel()) * 1e-3).to(torch.bfloat16)
    grads, off = [], 0
    for p in params:                        # adjacent views, as the host gradient set gives them
        grads.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    stepper.step(params, grads)             # the first step makes the state (per parameter)
    times: dict = {w: [] for w in widths}
    for _ in range(reps):
        for w in widths:
            FlatStepper.WIDEN = w
            t = time.perf_counter()
            stepper.step(params, grads)
            times[w].append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--widen", default="26,24,23,22,21", help="log2 of each slice size")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        print("\n".join(line for line in out.splitlines() if any(k in line for k in ("Model name", "Socket", "NUMA", "L2", "L3"))))
    except Exception as exc:  # noqa: BLE001 (a tool missing is only less information)
        print("lscpu unavailable:", exc)
    widths = [1 << int(x) for x in a.widen.split(",")]
    default = FlatStepper.WIDEN
    try:
        times = probe(a.params, widths, a.reps)
    finally:
        FlatStepper.WIDEN = default
    n = sum(torch.Size(s).numel() for s in _shapes(a.params))
    print(f"{n / 1e9:.2f}B elements, bf16 gradients, fused AdamW; torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads; {a.reps} steps per size, sizes in turn")
    for w, ts in times.items():
        print(f"WIDEN 2^{w.bit_length() - 1:<3d} ({w * 4 / 2**20:6.0f} MiB fp32)  median {statistics.median(ts):.3f} s"
              f"  best {min(ts):.3f} s  ({n / statistics.median(ts) / 1e9:.2f}G elements/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
