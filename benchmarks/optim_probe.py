"""How fast the host can step AdamW over a model's parameters, and refresh their bf16 copies.

    python -m benchmarks.optim_probe [--params 1.72e9] [--threads 0,16,32] [--reps 3]

Delayed mode steps the host AdamW while the devices go on; on 4 GPUs its seconds per step set
the pace (the 22:25 run: 1.06 s per step, of which AdamW 0.74 s and the bf16 refresh 0.28 s,
against 0.71 s of device work). This measures, on the host alone and with nothing else running:
the memory bandwidth (copy and triad), torch's fused AdamW over per-layer tensors as rpcompile
steps them (in chunks) and over one flat tensor, the refresh copy, and a single pass written with
torch.compile that steps and writes the bf16 copy together, each at a few intra-op thread counts.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch


def _best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def _shapes(n: float):
    """Qwen3-shaped tensors (hidden 2048, MLP 6144) adding up to about n elements."""
    h, f = 2048, 6144
    layer = [(h, h), (h // 2, h), (h // 2, h), (h, h), (f, h), (f, h), (h, f)]
    shapes, total = [(151936, h)], 151936 * h
    while total < n:
        shapes += layer
        total += sum(a * b for a, b in layer)
    return shapes, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.72e9)
    ap.add_argument("--threads", default="0,16,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    for cmd in (["lscpu"], ["numactl", "-H"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            print("\n".join(l for l in out.splitlines() if any(k in l for k in (
                "Model name", "Socket", "NUMA", "node", "Thread", "Core"))))
        except Exception as exc:  # noqa: BLE001 (a tool missing is only less information)
            print(cmd[0], "unavailable:", exc)
    shapes, n = _shapes(a.params)
    print(f"{len(shapes)} tensors, {n / 1e9:.2f}B elements; torch {torch.__version__}, "
          f"default intra-op threads {torch.get_num_threads()}")
    default_threads = torch.get_num_threads()
    params = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    work = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    flat = {k: torch.randn(n) for k in ("p", "g", "m", "v")}
    flat["v"].abs_()
    flat_w = torch.empty(n, dtype=torch.bfloat16)

    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    opt_flat = torch.optim.AdamW([flat["p"]], lr=1e-5, weight_decay=0.01, fused=True)
    flat["p"].grad = flat["g"]
    size = -(-len(params) // a.chunks)

    def chunked_step():
        for s in range(0, len(params), size):
            for p, g in zip(params[s:s + size], grads[s:s + size]):
                p.grad = g
            opt.step()
            for p in params[s:s + size]:
                p.grad = None

    def refresh():
        torch._foreach_copy_(work, params)

    compiled = None
    if not a.no_compile:
        @torch.compile(dynamic=False, fullgraph=True)
        def adamw_refresh(p, g, m, v, w, lr, b1c, b2c):
            # one pass: decoupled decay, both moments, the update and the bf16 copy
            p.mul_(1 - lr * 0.01)
            m.lerp_(g, 0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            p.addcdiv_(m, (v / b2c).sqrt_().add_(1e-8), value=-lr / b1c)
            w.copy_(p)

        piece = 1 << 26
        ranges = [(s, min(n, s + piece)) for s in range(0, n, piece)]
        full = [r for r in ranges if r[1] - r[0] == piece]

        def compiled_step():
            for s, e in ranges:
                adamw_refresh(flat["p"][s:e], flat["g"][s:e], flat["m"][s:e], flat["v"][s:e], flat_w[s:e],
                              1e-5, 0.9, 0.99)
        compiled = compiled_step
        t = time.perf_counter()
        try:
            adamw_refresh(*(flat[k][:piece] for k in "pgmv"), flat_w[:piece], 1e-5, 0.9, 0.99)
            if len(full) != len(ranges):
                s, e = ranges[-1]
                adamw_refresh(*(flat[k][s:e] for k in "pgmv"), flat_w[s:e], 1e-5, 0.9, 0.99)
            print(f"torch.compile of the one-pass step: {time.perf_counter() - t:.1f} s")
        except Exception as exc:  # noqa: BLE001
            print("torch.compile failed:", type(exc).__name__, str(exc)[:300])
            compiled = None

    gb = n * 4 / 1e9
    for th in [int(x) for x in a.threads.split(",")]:
        torch.set_num_threads(th or default_threads)
        th = torch.get_num_threads()
        copy_s = _best(lambda: flat["m"].copy_(flat["g"]), a.reps)
        triad_s = _best(lambda: torch.add(flat["g"], flat["v"], alpha=0.5, out=flat["m"]), a.reps)
        rows = [("copy fp32 (8 B/elem)", copy_s, 8), ("triad fp32 (12 B/elem)", triad_s, 12),
                (f"fused AdamW, {len(shapes)} tensors in {a.chunks} chunks", _best(chunked_step, a.reps), 28),
                ("fused AdamW, one flat tensor", _best(lambda: opt_flat.step(), a.reps), 28),
                ("refresh _foreach_copy_ fp32 -> bf16", _best(refresh, a.reps), 6),
                ("refresh one flat copy_ fp32 -> bf16", _best(lambda: flat_w.copy_(flat["p"]), a.reps), 6)]
        if compiled is not None:
            rows.append(("torch.compile one pass (AdamW + bf16 copy)", _best(compiled, a.reps), 30))
        print(f"\n-- {th} intra-op threads")
        for name, s, bpe in rows:
            print(f"{name:48s} {s:7.3f} s  {bpe * gb / 4 / s:6.1f} GB/s")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
