"""CPU-made plans for four (and two) 125.3 GiB H200s: a forward call's plan first (it chooses the share by its
room), then the train plan beside that share, as before Note [a call's share chosen again] (compiled.py).
Run from the repository root: python benchmarks/runs/whole_share/forward_first_plans.py llama3.1-8b"""
import sys, torch
sys.path.insert(0, ".")
from benchmarks.common import get_model, build_model, batch_ids
from rpcompile.capture import capture_call
from rpcompile.passes import compile_graph
from rpcompile import PlanningError
import rpcompile
rpcompile.Config.on_gpu = property(lambda self: True)
rpcompile.Config.repeats_a_gpu = property(lambda self: False)
name = sys.argv[1]
spec = get_model(name)
model = build_model(spec, init_device="meta", device="meta", max_positions=2048)
for n, tokens, M in [(4, 65536, 4), (2, 32768, 2)]:
    rows = tokens // 2048
    ids = batch_ids(spec.vocab, rows, 2048, step=0)
    c = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")
    cfg = rpcompile.Config(devices=["cpu"] * n, num_microbatches=M, dtype=torch.bfloat16, optimizer_mode="delayed",
                           memory_budget=int(125.3 * 2**30))
    call = compile_graph(c, cfg, "call", loss_output=0, on_devices=None)
    print(name, n, tokens, M, "call plan share", call.optimizer_share, "jobs", len(call.stages))
    try:
        train = compile_graph(c, cfg, "train", on_devices=call.optimizer_share)
        print("   train beside it:", train.replicas, len(train.stages), train.est_step_time, train.optimizer_share)
    except PlanningError as e:
        print("   train does not fit beside it:", str(e)[:200])
