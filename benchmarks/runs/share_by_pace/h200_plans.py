"""Plans for H200s made here on CPU: Config.on_gpu forced, the budget the H200 plans printed (125.3 GiB)."""
import sys, time, torch
sys.path.insert(0, ".")   # (run from the repository root: python benchmarks/runs/share_by_pace/h200_plans.py MODEL)
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
for n, tokens, M in [(2, 65536, 4), (2, 32768, 2), (4, 65536, 4), (1, 65536, 4)]:
    rows = tokens // 2048
    c = capture_call(model, (), {"input_ids": ids[:rows], "labels": ids[:rows]}, dtype=torch.bfloat16, device="cpu") if rows != 32 else cap
    cfg = rpcompile.Config(devices=["cpu"] * n, num_microbatches=M, dtype=torch.bfloat16, optimizer_mode="delayed",
                           memory_budget=int(125.3 * 2**30))
    t = time.perf_counter()
    plan = compile_graph(c, cfg, "train")
    print(f"{name} {n} GPUs {tokens}/M={M}: {time.perf_counter() - t:.1f} s to plan; replicas {plan.replicas}, jobs {len(plan.stages)}, "
          f"share {plan.optimizer_share}, est {plan.est_step_time:.3f} s, optimizer est {plan.optimizer_est_s}", flush=True)
    print("   ", str(plan).splitlines()[1])
