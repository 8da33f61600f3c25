"""How many host seconds a compiled block costs to launch, and whether launches from worker
threads on different GPUs run side by side (the interpreter lock released) or one at a time.

    python -m benchmarks.launch_probe --gpus 2 --options '{}' '{"cpp_wrapper": true}'

A block of eight RMSNorm + SwiGLU layers on small tensors (the device work is short, so the
host's launch path sets the pace), compiled with Inductor under each option set, run forward
and backward (as a stage job's recompute + backward) on a side stream in one worker thread per
GPU. Per option set it prints: host ms per call with one thread; the same with a thread per GPU
at once; the speed-up of the threads together over one (1.0: launches queue behind one lock;
N: they run side by side). Failures print their first lines and the probe goes on.

`--processes` measures the other cure: one process per GPU (each its own interpreter), all
started together after each compiled and warmed up.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time
import traceback

import torch
import torch.nn.functional as F


def block(x, ws):
    for g, w1, w2, w3 in ws:
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * g
        x = x + (F.silu(h @ w1) * (h @ w2)) @ w3
    return x


def _inputs(device, width=256, rows=64, layers=8):
    def p(*shape):
        return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.05).requires_grad_()
    ws = [(p(width), p(width, 2 * width), p(width, 2 * width), p(2 * width, width)) for _ in range(layers)]
    x = torch.randn(rows, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, ws


def _calls(fn, device, n, out):
    """n forward+backward calls on a side stream of `device`; host seconds per call into out."""
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    x, ws = _inputs(device)
    leaves = [x] + [t for w in ws for t in w]
    with torch.cuda.stream(stream):
        for _ in range(3):     # compile / warm up
            torch.autograd.grad(fn(x, ws).float().sum(), leaves)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            torch.autograd.grad(fn(x, ws).float().sum(), leaves)
        host = time.perf_counter() - t0
        stream.synchronize()
    out.append(host / n)


def probe(options: dict, gpus: int, n: int) -> dict:
    torch._dynamo.reset()
    fn = torch.compile(block, options=options or None)
    t0 = time.perf_counter()
    one: list = []
    _calls(fn, torch.device("cuda:0"), 2, one)     # compile on one device first
    compile_s = time.perf_counter() - t0
    for d in range(1, gpus):                       # and warm the others one at a time
        _calls(fn, torch.device(f"cuda:{d}"), 2, [])
    one = []
    th = threading.Thread(target=_calls, args=(fn, torch.device("cuda:0"), n, one))
    th.start()
    th.join()
    together: list = []
    threads = [threading.Thread(target=_calls, args=(fn, torch.device(f"cuda:{d}"), n, together))
               for d in range(gpus)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    single = one[0]
    return {"compile_s": compile_s, "host_ms_per_call_alone": single * 1e3,
            "host_ms_per_call_together": [t * 1e3 for t in together],
            "speedup_together": (gpus * n * single) / wall}


def _process(device_index, options, n, barrier, results):
    fn = torch.compile(block, options=options or None)
    device = torch.device(f"cuda:{device_index}")
    _calls(fn, device, 2, [])          # compile and warm up
    barrier.wait()
    t0 = time.perf_counter()
    out: list = []
    _calls(fn, device, n, out)
    results.put((device_index, out[0], time.perf_counter() - t0))


def probe_processes(options: dict, gpus: int, n: int) -> dict:
    """A process per GPU; each compiles and warms up, then all run n calls at once."""
    ctx = mp.get_context("spawn")
    out = {}
    for count in (1, gpus):
        barrier, results = ctx.Barrier(count + 1), ctx.Queue()
        procs = [ctx.Process(target=_process, args=(d, options, n, barrier, results)) for d in range(count)]
        for p in procs:
            p.start()
        barrier.wait(timeout=600)
        t0 = time.perf_counter()
        got = [results.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for p in procs:
            p.join()
        out[count] = {"host_ms_per_call": [g[1] * 1e3 for g in sorted(got)], "wall_s": wall}
    single = out[1]["wall_s"] / n
    return {"host_ms_per_call_alone": out[1]["host_ms_per_call"][0],
            "host_ms_per_call_together": out[gpus]["host_ms_per_call"],
            "speedup_together": gpus * n * single / out[gpus]["wall_s"]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=max(1, torch.cuda.device_count()))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--options", nargs="+", default=["{}", '{"cpp_wrapper": true}'])
    ap.add_argument("--processes", action="store_true", help="a process per GPU instead of a thread per GPU")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    results = {}
    for text in a.options:
        try:
            r = (probe_processes if a.processes else probe)(json.loads(text), a.gpus, a.calls)
            print(f"{text}: {'processes' if a.processes else 'threads'}: host {r['host_ms_per_call_alone']:.2f} ms/call alone, "
                  + ", ".join(f"{t:.2f}" for t in r["host_ms_per_call_together"])
                  + f" ms/call with {a.gpus} at once; together {r['speedup_together']:.2f}x one", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            r = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{text}: FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
            traceback.print_exc(limit=6)
        results[text] = r
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
