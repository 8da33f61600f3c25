"""The cost model's figures for the probe's sides and for the 4-GPU Llama-3.1-8B plan they stand in
for, planned on the CPU for 125.3 GiB H200s (benchmarks/cpu_plans.py), from the repository root:
`python benchmarks/runs/two_row_microbatches/plans.py` (plans.txt). Per plan: its step estimate and
each job's (kind, first module, estimated seconds a step, and a microbatch's share of them)."""
import sys
sys.path.insert(0, ".")
from benchmarks import cpu_plans
from rpcompile.passes import compile_graph

cpu_plans.as_on_gpu()
for name, rows, n, M, share in (("llama3.1-8b-16l", 8, 1, 4, 1.0), ("llama3.1-8b-16l", 8, 1, 2, 1.0),
                                ("llama3.1-8b", 32, 4, 16, None)):
    cap = cpu_plans.capture(name, rows=rows)
    plan = compile_graph(cap, cpu_plans.config(n, M, optimizer_on_devices=share, split_microbatches=False), "train")
    per_copy = plan.num_microbatches // plan.replicas
    jobs = [(r["kind"], r["modules"].split(",")[0], round(float(r["est_time_s"]), 3),
             round(float(r["est_time_s"]) / per_copy, 4)) for r in plan.stage_rows()]
    print(f"{name} {rows * 2048} tokens, {n} GPUs, M={M} ({per_copy} a copy of {plan.replicas}): share "
          f"{plan.optimizer_share}, est step {plan.est_step_time:.3f} s, jobs {jobs}", flush=True)
