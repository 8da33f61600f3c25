"""Where a multi-GPU rpcompile step loses its time: one process, one compile, several variants.

    python -m benchmarks.diagnose --model qwen3-1.7b --gpus 4 --steps 6 --out $OUT

Builds the model once, compiles it in `optimizer_mode="delayed"` (AdamW fused on the host),
warms up one step per GPU, then times `--steps` steps under each variant, each a switch that
takes one suspect out of the step:

  base              as it runs
  no_optimizer      the optimizer's update does nothing (the copies are still refreshed)
  resident_weights  each device keeps every weight it uploaded once: no weight uploads
  switch_0.5ms      sys.setswitchinterval(5e-4): the interpreter lock changes hands 10x as often
  opt_threads_32    the optimizer thread's intra-op threads
  widen_16M         FlatStepper.WIDEN: elements of a bf16 gradient widened and stepped at once

With `--kernels`, one more step runs under torch.profiler (CUDA activity) with each job's compute
in a named range: per job, its range seconds on the GPU, the seconds its kernels ran, the gaps
between them (the device waiting for the host inside the job), and its kernels of most seconds.

and prints per variant: tokens/s, step seconds, each device's compute busy share and the hand-over
gaps of the last step (a microbatch's compute end on one job to its start on the next). With
`--pyspy`, py-spy samples the process (and each worker process, with `--workers processes`)
during base's timed steps (threads with --native, then --gil) into --out. The variants are
instruments, not modes: they change results and live only here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from .common import adamw_kwargs, batch_ids, build_model, get_model
from .systems.rpcompile_runner import trace_summary
from .trace_hops import summarize


def _sampled(cm) -> dict:
    """The processes py-spy samples: this one ("main") and, with worker processes, each worker
    ("worker0", ...), where the launches of its device happen."""
    hub = getattr(cm.runner.executor, "hub", None)
    return {"main": os.getpid(), **{f"worker{i}": p.pid for i, p in enumerate(getattr(hub, "procs", None) or [])}}


def _spy_command(pid: int, path: str, *extra) -> list:
    """py-spy sampling `pid` for 6 s (raw stacks per thread) into `path`, without pausing it, but
    for native stacks: py-spy refuses `--native` with `--nonblocking` ("Can't get native stack
    traces with the --nonblocking option": no file, 41st session), so those pause it per sample."""
    pause = [] if "--native" in extra else ["--nonblocking"]
    return ["py-spy", "record", "--pid", str(pid), "--duration", "6", "--threads", "--format", "raw", *pause,
            "-o", path, *extra]


def _spy(pid: int, path: str, *extra):
    return subprocess.Popen(_spy_command(pid, path, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _hops(spans) -> list:
    compute = {}
    for s in spans:
        if s["stream"] == "compute" and s.get("job") is not None:
            key = (s["job"], s.get("microbatch"))
            a, b = compute.get(key, (s["start_s"], s["end_s"]))
            compute[key] = (min(a, s["start_s"]), max(b, s["end_s"]))
    return sorted((start - compute[(j - 1, mb)][1]) * 1e3 for (j, mb), (start, _) in compute.items()
                  if (j - 1, mb) in compute)


def _issue_seconds(spans) -> dict:
    """Host seconds each device's worker spent enqueueing compute in the last step (launches
    under the interpreter lock): their sum over devices against the step's seconds says how
    much of the step one interpreter must spend launching."""
    out: dict = {}
    for s in spans:
        if s["stream"] == "compute" and s.get("issue_s") is not None:
            out[s["device"]] = out.get(s["device"], 0.0) + s["issue_s"]
    return out


def _resident_weights():
    """Patch DeviceRuntime so every weight is uploaded once per device and then reused."""
    from rpcompile.runtime import device as device_mod
    cls = device_mod.DeviceRuntime
    originals = {name: getattr(cls, name) for name in ("upload_weight", "prefetch", "take_prefetched")}
    cache: dict = {}

    def upload_weight(self, param, dtype, host_weights, rows=None, wait=True):
        key = (self.device, id(param), rows)
        if key not in cache:
            cache[key] = originals["upload_weight"](self, param, dtype, host_weights, rows, True)
        return cache[key] if wait else (cache[key], None)

    def take(self, future, key):
        return None

    cls.upload_weight, cls.prefetch = upload_weight, lambda self, *a, **k: None
    cls.take_prefetched = take
    return lambda: [setattr(cls, name, fn) for name, fn in originals.items()]


def _kernel_profile(step, synchronize, out_dir) -> str:
    """One step under torch.profiler, each compute span of a job in a record_function range:
    per job the GPU range seconds, kernel seconds inside them, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from rpcompile.runtime.job import JobContext
    original = JobContext.span

    def span(self, stream_name, name, fn, mb=None, **attrs):
        if stream_name != "compute":
            return original(self, stream_name, name, fn, mb, **attrs)
        def ranged():
            with record_function(f"rpjob{self.job_index}:{self.role}:mb{mb}"):
                return fn()
        return original(self, stream_name, name, ranged, mb, **attrs)
    JobContext.span = span
    try:
        # CPU activity too: without it the trace has no ranges (gpu_user_annotation) to tell jobs apart
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            synchronize()
    finally:
        JobContext.span = original
    path = os.path.join(out_dir, "kernels_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return _kernels_by_job(json.load(f)["traceEvents"])


def _kernels_by_job(events) -> str:
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
              if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("rpjob")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not ranges and kernels:   # no job ranges recorded: the step as one range
        ranges = [(kernels[0][0], max(b for _, b, _ in kernels), "step")]
    jobs: dict = {}
    for a, b, name in ranges:
        job = name.split(":mb")[0]
        j = jobs.setdefault(job, {"range_us": 0.0, "kernel_us": 0.0, "n": 0, "by_name": {}})
        j["range_us"] += b - a
        busy_end = a
        for ka, kb, kname in kernels:
            if kb <= a or ka >= b:
                continue
            ka, kb = max(ka, a), min(kb, b)
            j["kernel_us"] += max(0.0, kb - max(ka, busy_end))   # union: overlapping kernels once
            busy_end = max(busy_end, kb)
            j["n"] += 1
            short = kname[:70]
            j["by_name"][short] = j["by_name"].get(short, 0.0) + (kb - ka)
    lines = ["job:role  GPU range s  kernels s  gaps s  kernels"]
    for job, j in sorted(jobs.items()):
        lines.append(f"{job:14s} {j['range_us'] / 1e6:8.3f} {j['kernel_us'] / 1e6:9.3f} "
                     f"{(j['range_us'] - j['kernel_us']) / 1e6:7.3f}  {j['n']}")
        for kname, us in sorted(j["by_name"].items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"    {us / 1e6:7.3f} s  {kname}")
    return "\n".join(lines)


def _no_optimizer(cm, opt):
    """The no_optimizer variant: the update steps nothing (the copies are still refreshed); returns
    its undo. The attached optimizer's flat stepper steps twins of the user's optimizer (and the
    devices' part), so replacing `opt.step` switched nothing off there; exact mode calls it."""
    overlapped = cm.runner.overlapped
    target, name = (opt, "step") if overlapped is None else (overlapped.stepper, "step")
    setattr(target, name, lambda *args, **kw: None)
    return lambda: delattr(target, name)       # (the class's own method again)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workers", default="threads", choices=["threads", "processes"],
                    help="Config.workers: a worker thread or a worker process per device")
    ap.add_argument("--variants", default="base,no_optimizer,resident_weights,switch_0.5ms")
    ap.add_argument("--mode", default="delayed")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="one more step under torch.profiler: kernels per job")
    ap.add_argument("--memory-budget-gib", type=float, default=0.0, help="Config.memory_budget (0: the device's)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own)")
    ap.add_argument("--inductor", default="", help="Config(inductor_options=JSON), e.g. '{\"cpp_wrapper\": true}'")
    ap.add_argument("--cpu", action="store_true", help="CPU devices (a smoke test of this script)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import rpcompile

    spec = get_model(a.model)
    if a.layers:
        spec = dataclasses.replace(spec, layers=a.layers)
    on_gpu = not a.cpu
    model = build_model(spec, init_device="cuda:0" if on_gpu else "cpu", max_positions=a.seq_len)
    devices = [f"cuda:{i}" for i in range(a.gpus)] if on_gpu else ["cpu"] * a.gpus
    cm = rpcompile.compile(model, rpcompile.Config(devices=devices, num_microbatches=a.microbatches,
                                                   dtype=torch.bfloat16, optimizer_mode=a.mode, workers=a.workers,
                                                   inductor_options=json.loads(a.inductor) if a.inductor else None,
                                                   memory_budget=int(a.memory_budget_gib * 2**30) if a.memory_budget_gib else None,
                                                   # the host optimizer's variants are what it weighs
                                                   optimizer_on_devices=0.0))
    opt = torch.optim.AdamW(model.parameters(), fused=on_gpu,
                            **adamw_kwargs(argparse.Namespace(lr=1e-5)))
    if a.mode != "exact":
        cm.attach_optimizer(opt)
    n_seqs = a.tokens_per_step // a.seq_len
    step_no = [0]

    def step():
        ids = batch_ids(spec.vocab, n_seqs, a.seq_len, step=step_no[0])
        step_no[0] += 1
        loss = cm.train_step(input_ids=ids, labels=ids)
        if a.mode == "exact":
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    for _ in range(max(1, a.gpus)):
        step()
    cm.synchronize()
    print(f"warm-up: {max(1, a.gpus)} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    from rpcompile.runtime.warmup import first_calls
    per_device: dict = {}
    for d, s in first_calls:
        per_device[d] = per_device.get(d, 0.0) + s
    print(f"first calls (compiling, under the write lock): {len(first_calls)} calls, "
          f"{sum(s for _, s in first_calls):.1f} s: " + ", ".join(f"{d} {s:.1f} s" for d, s in per_device.items()),
          flush=True)
    print(cm.plan, flush=True)
    results = {}
    for run_no, variant in enumerate(a.variants.split(",")):
        undo = None
        if variant == "no_optimizer":
            undo = _no_optimizer(cm, opt)
        elif variant == "resident_weights":
            undo = _resident_weights()
        elif variant.startswith("switch_"):
            old = sys.getswitchinterval()
            sys.setswitchinterval(float(variant.split("_")[1].rstrip("ms")) * 1e-3)
            undo = lambda: sys.setswitchinterval(old)   # noqa: E731
        elif variant == "peer":
            # Config.peer_transfers: boundary activations go GPU to GPU instead of via the host
            devs = cm.runner.executor.devices
            for d in devs:
                d.peer_transfers = not d.is_cpu
            undo = lambda: [setattr(d, "peer_transfers", False) for d in devs]   # noqa: E731
        elif variant.startswith("opt_threads_"):
            # intra-op threads of the optimizer thread only (OpenMP's thread count is per thread)
            opt_thread = cm.runner.overlapped
            inner_step, n = opt_thread._step, int(variant.split("_")[2])

            def limited(*args, _inner=inner_step, _n=n):
                torch.set_num_threads(_n)
                return _inner(*args)
            old_n = torch.get_num_threads()

            def restore(*args, _inner=inner_step):
                torch.set_num_threads(old_n)
                opt_thread._step = _inner
                return _inner(*args)
            opt_thread._step = limited
            undo = lambda: setattr(opt_thread, "_step", restore)   # noqa: E731
        elif variant.startswith("threads_"):
            # the host's intra-op threads (the optimizer's AdamW and copies) against the cores
            # the launching worker threads need
            old_threads = torch.get_num_threads()
            torch.set_num_threads(int(variant.split("_")[1]))
            undo = lambda: torch.set_num_threads(old_threads)   # noqa: E731
        elif variant.startswith("widen_"):
            # elements of a bf16 gradient the host AdamW widens and steps at once (widen_16M): fewer
            # make more calls and parallel regions a step, more leave the widened slice out of cache
            from rpcompile.runtime.flat import FlatStepper
            old_widen = FlatStepper.WIDEN
            FlatStepper.WIDEN = int(variant.split("_")[1].rstrip("M")) << 20
            undo = lambda: setattr(FlatStepper, "WIDEN", old_widen)   # noqa: E731
        elif variant != "base":
            raise SystemExit(f"unknown variant {variant}")
        step()       # a step to settle into the variant
        cm.synchronize()
        spy = None
        if a.pyspy and variant == "base" and shutil.which("py-spy"):
            sampled = _sampled(cm)
            spy = [_spy(pid, os.path.join(a.out, f"pyspy_threads_{name}.txt"), "--native")
                   for name, pid in sampled.items()]
        times = []
        for _ in range(a.steps):
            s = time.perf_counter()
            step()
            times.append(time.perf_counter() - s)
        s = time.perf_counter()
        cm.synchronize()
        times[-1] += time.perf_counter() - s
        if spy:
            for p in spy:
                p.wait(timeout=60)
            # a second sample, only the GIL holders, over the next steps
            gil = [_spy(pid, os.path.join(a.out, f"pyspy_gil_{name}.txt"), "--gil") for name, pid in sampled.items()]
            for _ in range(a.steps):
                step()
            cm.synchronize()
            for p in gil:
                p.wait(timeout=60)
        spans = cm.last_trace or []
        summ = trace_summary(spans) if spans else {"devices": {}}
        hops = _hops(spans)
        issue = _issue_seconds(spans)
        tok = a.tokens_per_step * len(times) / sum(times)
        opt_t = list(getattr(cm.runner.overlapped, "timings", []) or [])[-a.steps:]
        opt_mean = {k: sum(t[k] for t in opt_t) / len(opt_t) for k in opt_t[0]} if opt_t else {}
        results[f"{run_no}:{variant}"] = {"tokens_per_s": tok, "step_s": times, "optimizer_s": opt_mean,
                            "busy": {d: v["compute_busy_frac"] for d, v in summ["devices"].items()},
                            "issue_s": issue,
                            "hop_ms_median": hops[len(hops) // 2] if hops else None,
                            "hop_ms_max": hops[-1] if hops else None}
        print(f"== {variant}: {tok:,.0f} tokens/s; steps " + " ".join(f"{t:.2f}" for t in times)
              + "; busy " + " ".join(f"{d}={v:.2f}" for d, v in results[f"{run_no}:{variant}"]["busy"].items() if v is not None)
              + "; host s issuing compute " + " ".join(f"{d}={v:.3f}" for d, v in issue.items())
              + (f"; hops median {hops[len(hops) // 2]:.1f} ms max {hops[-1]:.1f} ms" if hops else "")
              + ("; optimizer " + " ".join(f"{k}={v:.3f}" for k, v in opt_mean.items()) if opt_mean else ""), flush=True)
        if spans:
            print(summarize(spans), flush=True)
        if variant == "base" and spans:
            with open(os.path.join(a.out, "base_trace.json"), "w") as f:
                json.dump(spans, f, default=str)
        if undo is not None:
            undo()
    if a.kernels and on_gpu:
        print(_kernel_profile(step, cm.synchronize, a.out), flush=True)
    with open(os.path.join(a.out, "diagnose.json"), "w") as f:
        json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
