"""Plans for 125.3 GiB H200s made here on CPU at several microbatch counts (as share_by_pace/h200_plans.py):
from the repository root, `python benchmarks/runs/microbatches/plans_by_m.py llama3.1-8b 1x4 1x8 4x4 4x16`
(GPUSxM; plans_by_m.txt)."""
import sys, torch
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
for arg in sys.argv[2:]:
    n, M = map(int, arg.split("x"))
    cfg = rpcompile.Config(devices=["cpu"] * n, num_microbatches=M, dtype=torch.bfloat16, optimizer_mode="delayed",
                           memory_budget=int(125.3 * 2**30))
    plan = compile_graph(cap, cfg, "train")
    jobs = [l.split()[1] + ":" + l.split()[2].rstrip(",") for l in str(plan).splitlines() if l[:1].isdigit()]
    print(f"{name} {n} GPUs M={M}: replicas {plan.replicas}, jobs {len(plan.stages)} {jobs}, share {plan.optimizer_share}, est {plan.est_step_time:.3f} s", flush=True)
