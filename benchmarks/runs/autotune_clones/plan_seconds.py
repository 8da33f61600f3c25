"""Seconds of the plan for 125.3 GiB devices made on this CPU (Config.on_gpu forced), three in a row, the
replay cache cleared before each: `python plan_seconds.py MODEL DEVICES TREE` from /tmp, TREE a checkout
(48th session: HEAD 53ab6f8 under /tmp/headtree against the working tree; RESULTS.md, 48th session)."""
import sys, time, torch
sys.path.insert(0, sys.argv[3])
from benchmarks.common import get_model, build_model, batch_ids
from rpcompile.capture import capture_call
from rpcompile.passes import compile_graph
import rpcompile
assert rpcompile.__file__.startswith(sys.argv[3]), rpcompile.__file__
rpcompile.Config.on_gpu = property(lambda self: True)
rpcompile.Config.repeats_a_gpu = property(lambda self: False)
spec = get_model(sys.argv[1]); N = int(sys.argv[2])
model = build_model(spec, init_device="meta", device="meta", max_positions=2048)
ids = batch_ids(spec.vocab, 32, 2048, step=0)
cap = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")
cfg = rpcompile.Config(devices=["cpu"] * N, num_microbatches=4, dtype=torch.bfloat16, optimizer_mode="delayed", memory_budget=int(125.3 * 2**30))
out = []
for i in range(3):
    try:
        from rpcompile.passes import partition; partition._replayed.cache_clear()
    except AttributeError:
        pass
    t = time.perf_counter(); plan = compile_graph(cap, cfg, "train"); out.append(time.perf_counter() - t)
print(sys.argv[1], N, sys.argv[3][-8:], "plan s", " ".join("%.2f" % x for x in out), plan.replicas, len(plan.stages), "%.6f" % plan.est_step_time, plan.optimizer_share)
