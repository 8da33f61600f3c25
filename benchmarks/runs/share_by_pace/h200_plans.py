"""Plans for H200s made here on CPU (benchmarks/cpu_plans.py: Config.on_gpu forced, the budget the H200 plans
printed, 125.3 GiB). Run from the repository root: python benchmarks/runs/share_by_pace/h200_plans.py MODEL"""
import sys, time
sys.path.insert(0, ".")
from benchmarks import cpu_plans
from rpcompile.passes import compile_graph

cpu_plans.as_on_gpu()
name = sys.argv[1]
caps = {}
for n, tokens, M in [(2, 65536, 4), (2, 32768, 2), (4, 65536, 4), (1, 65536, 4)]:
    rows = tokens // 2048
    c = caps[rows] = caps.get(rows) or cpu_plans.capture(name, rows)
    t = time.perf_counter()
    plan = compile_graph(c, cpu_plans.config(n, M), "train")
    print(f"{name} {n} GPUs {tokens}/M={M}: {time.perf_counter() - t:.1f} s to plan; replicas {plan.replicas}, jobs {len(plan.stages)}, "
          f"share {plan.optimizer_share}, est {plan.est_step_time:.3f} s, optimizer est {plan.optimizer_est_s}", flush=True)
    print("   ", str(plan).splitlines()[1])
