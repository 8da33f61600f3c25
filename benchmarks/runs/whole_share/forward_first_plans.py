"""CPU-made plans for four (and two) 125.3 GiB H200s (benchmarks/cpu_plans.py): a forward call's plan first (it
chooses the share by its room), then the train plan beside that share, as before Note [a call's share chosen
again] (compiled.py). Run from the repository root: python benchmarks/runs/whole_share/forward_first_plans.py llama3.1-8b"""
import sys
sys.path.insert(0, ".")
from benchmarks import cpu_plans
from rpcompile.passes import compile_graph
from rpcompile import PlanningError

cpu_plans.as_on_gpu()
name = sys.argv[1]
for n, tokens, M in [(4, 65536, 4), (2, 32768, 2)]:
    c = cpu_plans.capture(name, tokens // 2048)
    cfg = cpu_plans.config(n, M)
    call = compile_graph(c, cfg, "call", loss_output=0, on_devices=None)
    print(name, n, tokens, M, "call plan share", call.optimizer_share, "jobs", len(call.stages))
    try:
        train = compile_graph(c, cfg, "train", on_devices=call.optimizer_share)
        print("   train beside it:", train.replicas, len(train.stages), train.est_step_time, train.optimizer_share)
    except PlanningError as e:
        print("   train does not fit beside it:", str(e)[:200])
