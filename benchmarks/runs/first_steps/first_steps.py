"""First steps of Qwen3-1.7B (delayed, worker processes) with N worker processes sharing cuda:0.

    python .ab/first_steps.py N BUDGET_GIB STEPS OUT.json
"""
import json, os, sys, time, threading
import torch
t_start = time.time()
import rpcompile
from benchmarks.common import build_model, get_model, batch_ids, process_tree_memory

n, budget, steps, out = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = get_model("qwen3-1.7b")
model = build_model(spec, dtype=torch.float32, device="cpu", init_device="cuda:0")
nparams = sum(p.numel() for p in model.parameters())

def meminfo():
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
def used():
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]
MI0 = meminfo()
def mi_delta():
    m = meminfo()
    return {k: round((m[k] - MI0[k]) / 2**30, 2) for k in ("MemFree", "MemAvailable", "AnonPages", "Shmem", "Cached", "Buffers", "Mapped", "PageTables", "SUnreclaim", "SReclaimable", "KernelStack", "Unevictable", "Mlocked", "AnonHugePages", "ShmemHugePages", "VmallocUsed", "Percpu", "HugePages_Total") if k in m and k in MI0}
samples, stop = [], [False]
def by_kind():
    import subprocess as sp
    out = sp.run(["ps", "-e", "-o", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    acc = {"main": 0, "worker": 0, "compile": 0}
    try:
        roll = {x.split(":")[0]: int(x.split()[1]) for x in open("/proc/self/smaps_rollup").read().splitlines()[1:] if x.split()[1].isdigit()}
        for f in ("Pss_Anon", "Pss_File", "Pss_Shmem", "Rss"):
            acc["main_" + f] = roll.get(f, 0) * 1024
    except Exception:
        pass
    for l in out:
        pid, _, args = l.strip().partition(" ")
        kind = "compile" if "compile_worker" in args else "worker" if "rpcompile.runtime.worker" in args else "main" if int(pid) == os.getpid() else None
        if kind:
            try:
                acc[kind] += int(next(x for x in open(f"/proc/{pid}/smaps_rollup") if x.startswith("Pss:")).split()[1]) * 1024
            except Exception:
                pass
    return {k: round(v / 2**30, 2) for k, v in acc.items()}
kinds = []
best = [0, None]
def fast_sampler():
    while not stop[0]:
        samples.append((time.time(), used()))
        time.sleep(0.05)
def sampler():
    i = 0
    while not stop[0]:
        if True:
            kinds.append((time.time(), used(), {**by_kind(), 'mi': mi_delta()}))
            u = kinds[-1][1]
            if "t0" in globals() and time.time() - t0 > 35 and u > best[0]:
                best[0] = u
                import traceback
                me = threading.get_ident()
                best[1] = (round(time.time() - t0, 2), round((u - used0) / 2**30, 2), {threading._active.get(tid).name if tid in threading._active else tid: "".join(traceback.format_stack(fr)[-6:]) for tid, fr in sys._current_frames().items() if tid != me})
        i += 1; time.sleep(0.25)
used0 = used()
threading.Thread(target=sampler, daemon=True).start()
threading.Thread(target=fast_sampler, daemon=True).start()


# instrument: seconds per optimizer submission in page_lock / _first_in_slices / copy_down / _upload
import collections
from rpcompile.runtime import shared as _sh, flat as _fl
OPT_T = collections.defaultdict(float)
def _timed(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            OPT_T[(len(marks_t) if "marks_t" in globals() else -1, name)] += time.perf_counter() - t
    setattr(cls, name, g)
for _c, _n in ((_sh.SharedMemory, "page_lock"), (_fl.FlatStepper, "_first_in_slices"), (_fl.FlatStepper, "copy_down"),
               (_fl.FlatStepper, "_upload"), (_fl.FlatStepper, "_step_run"), (_fl.FlatStepper, "step"), (_fl.FlatStepper, "_per_param")):
    _timed(_c, _n)
cfg = rpcompile.Config(devices=["cuda:0"] * n, num_microbatches=4, dtype=torch.bfloat16, workers="processes",
                       optimizer_mode="delayed", memory_budget=int(budget * 2**30),
                       **({"optimizer_on_devices": float(os.environ["OPT_ON_DEV"])} if os.environ.get("OPT_ON_DEV") else {}))
cm = rpcompile.compile(model, config=cfg)
cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
t0 = time.time()
times, marks_t = [], []
for s in range(steps):
    ids = batch_ids(spec.vocab, 32, 2048, step=s)
    a = time.time()
    loss = cm.train_step(input_ids=ids, labels=ids)
    times.append(time.time() - a); marks_t.append(time.time())
cm.synchronize()
stop[0] = True
mem = process_tree_memory()
peak_t, peak = max(samples, key=lambda x: x[1])
step_at_peak = sum(1 for t in marks_t if t < peak_t)
tl = cm.setup_timeline
res = {"n": n, "budget_gib": budget, "steps_s": [round(x, 3) for x in times], "first4_s": round(sum(times[:4]), 2),
       "loss": float(loss), "plan_jobs": len(cm.plan.stages), "schedule": str(cm.last_schedule),
       "host_used_peak_gib": round((peak - used0) / 2**30, 2), "peak_during_step": step_at_peak + 1,
       "host_used_end_gib": round((samples[-1][1] - used0) / 2**30, 2), "bytes_per_param_peak": round((peak - used0) / nparams, 2),
       "mem": {k: {"pss": round(v["pss_bytes"] / 2**30, 2), "n": v["processes"], **{m: round(b / 2**30, 2) for m, b in v["pss_by_mapping"].items()}} for k, v in mem.items()},
       "host_buffers": {k: [round(x / 2**30, 2) if isinstance(x, int) and x > 2**20 else x for x in v] if isinstance(v, (list, tuple)) else v for k, v in cm.host_buffer_bytes().items()} if False else {k: round(v / 2**30, 2) for k, v in cm.host_buffer_bytes().items()},
       "plan_host": [l for l in str(cm.plan).splitlines() if "host" in l][:3],
       "marks": [m for m in tl if m["what"].startswith(("dry run", "call alone", "job ", "captured", "planned", "workers ready", "train_step returned", "optimizer step")) and not m["what"].endswith("ended")],
       "at_peak": min(kinds, key=lambda k: abs(k[0] - peak_t))[2] if kinds else None,
       "kinds_trace": [(round(t - t0, 1), round((u - used0) / 2**30, 2), k) for t, u, k in kinds[::3]],
       "used_trace": [(round(t - t0, 1), round((u - used0) / 2**30, 2)) for t, u in samples[::8]],
       "around_peak": [(round(t - t0, 2), round((u - used0) / 2**30, 2), k) for t, u, k in kinds if abs(t - peak_t) < 4]}
res["opt_timings"] = [{k: round(v, 3) for k, v in t.items()} for t in cm.runner.overlapped.timings]
res["opt_t"] = sorted((str(k), round(v, 3)) for k, v in OPT_T.items())
print("opt timings", res["opt_timings"]); print("opt_t", res["opt_t"])
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("marks", "used_trace", "kinds_trace", "around_peak")}, indent=None))
print("stacks at the last new maximum", best[1] and best[1][:2])
for name, st in (best[1][2].items() if best[1] else []):
    if "rpcompile" not in st: continue
    print("--", name); print(st)
print("step ends", [round(t - t0, 2) for t in marks_t])
for t, u, k in res["around_peak"]:
    mi = k.pop("mi")
    k = {a: round(b / 2**30, 2) if b > 2**20 else b for a, b in k.items()}
    print(t, u, k, {x: mi[x] for x in ("AnonPages", "Shmem", "Cached", "VmallocUsed", "SUnreclaim", "PageTables")})
for m in res["marks"]:
    print(f'{m["t"]:8.2f} {m["where"]:9s} {m["what"]} {m["seconds"] or ""}')
import subprocess
def tree(root):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    procs = {}
    for l in out:
        pid, ppid, args = l.strip().split(None, 2) + [""] * (3 - len(l.strip().split(None, 2)))
        procs[int(pid)] = (int(ppid), args)
    def desc(p, d=0):
        for c, (pp, a) in sorted(procs.items()):
            if pp == p:
                try:
                    roll = {x.split(":")[0]: int(x.split()[1]) for x in open(f"/proc/{c}/smaps_rollup").read().splitlines()[1:] if x.split()[1].isdigit()}
                except Exception:
                    roll = {}
                print("  " * d, c, a[:110], "pss_MiB", roll.get("Pss", 0) // 1024, "anon_MiB", roll.get("Pss_Anon", 0) // 1024)
                desc(c, d + 1)
    desc(root)
print("main async_compile:", "torch._inductor.async_compile" in sys.modules,
      len(getattr(sys.modules.get("torch._inductor.async_compile"), "_pool_set", ()) or ()))
tree(os.getpid())
# main's anonymous mappings > 64 MiB, and which CPU tensors (reachable by gc) lie in them
import gc
maps, cur = [], None
for line in open("/proc/self/smaps"):
    parts = line.split()
    if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
        a, b = (int(x, 16) for x in parts[0].split("-"))
        cur = [a, b, parts[5] if len(parts) > 5 else "", 0, 0]
        maps.append(cur)
    elif parts[0] == "Rss:" and cur:
        cur[3] = int(parts[1]) * 1024
    elif parts[0] == "Anonymous:" and cur:
        cur[4] = int(parts[1]) * 1024
tensors = {}
for o in gc.get_objects():
    try:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            tensors[s.data_ptr()] = (s.nbytes(), tuple(o.shape), str(o.dtype).replace("torch.", ""), "pinned" if o.is_pinned() else "")
    except Exception:
        pass
tot = sum(m[4] for m in maps)
print(f"main anonymous total {tot / 2**30:.2f} GiB; mappings with > 64 MiB anonymous:")
for a, b, name, rss, anon in sorted(maps, key=lambda m: -m[4]):
    if anon < 64 * 2**20:
        break
    inside = [t for p, t in tensors.items() if a <= p < b]
    print(f"  {anon / 2**20:9.1f} MiB anon ({(b - a) / 2**20:.0f} MiB mapped) {name[:30]:30s} {len(inside)} tensors {sum(t[0] for t in inside) / 2**20:.1f} MiB", sorted(inside, key=lambda t: -t[0])[:4])
# each worker's anonymous memory by mapping size
def anon_maps(pid):
    maps, cur = [], None
    for line in open(f"/proc/{pid}/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
            a, b = (int(x, 16) for x in parts[0].split("-"))
            cur = [a, b, parts[5] if len(parts) > 5 else "", 0]
            maps.append(cur)
        elif parts[0] == "Anonymous:" and cur:
            cur[3] = int(parts[1]) * 1024
    return maps
out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
for l in out:
    pid, ppid, args = (l.strip().split(None, 2) + ["", ""])[:3]
    if "rpcompile.runtime.worker" in args or "compile_worker" in args:
        try:
            m = anon_maps(pid)
        except OSError:
            continue
        tot = sum(x[3] for x in m)
        big = sorted(m, key=lambda x: -x[3])[:8]
        buckets = {"<1M": 0, "1-16M": 0, "16-64M": 0, ">64M": 0}
        for x in m:
            k = "<1M" if x[3] < 2**20 else "1-16M" if x[3] < 16 * 2**20 else "16-64M" if x[3] < 64 * 2**20 else ">64M"
            buckets[k] += x[3]
        print(pid, args[:60], f"anon {tot / 2**20:.0f} MiB", {k: round(v / 2**20) for k, v in buckets.items()},
              [(round(x[3] / 2**20), round((x[1] - x[0]) / 2**20), x[2][:20]) for x in big])
