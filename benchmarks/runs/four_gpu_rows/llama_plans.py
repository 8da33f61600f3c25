"""Llama-3.1-8B plans for H200s made here on CPU (as share_by_pace/h200_plans.py): from the repository
root, `M=4 python benchmarks/runs/four_gpu_rows/llama_plans.py llama3.1-8b 4 1` (llama_plans.txt: M=4 at
4 and 1 GPUs, then M=8 at 4)."""
import sys, time, torch
sys.path.insert(0, ".")
from benchmarks.common import get_model, build_model, batch_ids
from rpcompile.capture import capture_call
from rpcompile.passes import compile_graph
import rpcompile
rpcompile.Config.on_gpu = property(lambda self: True)
rpcompile.Config.repeats_a_gpu = property(lambda self: False)
name = sys.argv[1]
spec = get_model(name)
model = build_model(spec, init_device="meta", device="meta", max_positions=2048)
ids = batch_ids(spec.vocab, 32, 2048, step=0)
cap = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")
for n in [int(x) for x in sys.argv[2:]]:
    cfg = rpcompile.Config(devices=["cpu"] * n, num_microbatches=int(__import__("os").environ.get("M", "4")), dtype=torch.bfloat16, optimizer_mode="delayed",
                           memory_budget=int(125.3 * 2**30))
    t = time.perf_counter()
    plan = compile_graph(cap, cfg, "train")
    print(f"==== {name} {n} GPUs: {time.perf_counter() - t:.1f} s to plan; replicas {plan.replicas}, jobs {len(plan.stages)}, "
          f"share {plan.optimizer_share}, est {plan.est_step_time:.3f} s, optimizer est {plan.optimizer_est_s}", flush=True)
    print(plan, flush=True)
