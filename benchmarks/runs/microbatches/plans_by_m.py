"""Plans for 125.3 GiB H200s made on the CPU at several microbatch counts (benchmarks/cpu_plans.py), from the
repository root: `python benchmarks/runs/microbatches/plans_by_m.py llama3.1-8b 1x4 1x8 4x4 4x16` (GPUSxM, 65,536
tokens a step; plans_by_m.txt); `--full` prints each plan whole (../four_gpu_rows/llama_plans.txt)."""
import sys
sys.path.insert(0, ".")
from benchmarks import cpu_plans
from rpcompile.passes import compile_graph

cpu_plans.as_on_gpu()
full = "--full" in sys.argv
name, *shapes = [a for a in sys.argv[1:] if a != "--full"]
cap = cpu_plans.capture(name)
for shape in shapes:
    n, M = map(int, shape.split("x"))
    plan = compile_graph(cap, cpu_plans.config(n, M), "train")
    jobs = [f"{r['kind']}:{r['modules'].split(',')[0]}" for r in plan.stage_rows()]
    print(f"{name} {n} GPUs M={M}: replicas {plan.replicas}, jobs {len(plan.stages)} {jobs}, "
          f"share {plan.optimizer_share}, est {plan.est_step_time:.3f} s", flush=True)
    if full:
        print(plan, flush=True)
