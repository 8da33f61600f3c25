"""CPU-made plans for 125.3 GiB H200s of larger models (Qwen3-14B and -32B shapes): the share the pace rule
chooses, and each candidate's estimated jobs and update (the whole vs the share that keeps up)."""
# run from the repository root: python benchmarks/runs/whole_share/larger_models_plans.py qwen3-32b [SHARE ...]
import sys, time, torch
sys.path.insert(0, ".")
from benchmarks.common import ModelSpec, build_model, batch_ids
from rpcompile.capture import capture_call
from rpcompile.passes import compile_graph
import rpcompile
rpcompile.Config.on_gpu = property(lambda self: True)
rpcompile.Config.repeats_a_gpu = property(lambda self: False)
specs = {"qwen3-14b": ModelSpec("qwen3-14b", "qwen3", hidden=5120, layers=40, heads=40, kv_heads=8, head_dim=128,
                                intermediate=17408, vocab=151936, tied=False),
         "qwen3-32b": ModelSpec("qwen3-32b", "qwen3", hidden=5120, layers=64, heads=64, kv_heads=8, head_dim=128,
                                intermediate=25600, vocab=151936, tied=False)}
spec = specs[sys.argv[1]]
model = build_model(spec, init_device="meta", device="meta", max_positions=2048)
n, tokens, M = 4, 65536, 4
ids = batch_ids(spec.vocab, tokens // 2048, 2048, step=0)
c = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")
cfg = rpcompile.Config(devices=["cpu"] * n, num_microbatches=M, dtype=torch.bfloat16, optimizer_mode="delayed",
                       memory_budget=int(125.3 * 2**30))
for share in [None] + [float(s) for s in sys.argv[2:]]:
    t = time.perf_counter()
    try:
        plan = compile_graph(c, cfg, "train", on_devices=share)
        print(spec.name, "share", share, "->", plan.optimizer_share, f"replicas {plan.replicas} jobs {len(plan.stages)} est {plan.est_step_time:.2f} s",
              f"opt est {plan.optimizer_est_s}", f"({time.perf_counter() - t:.0f} s)", flush=True)
    except Exception as e:
        print(spec.name, "share", share, "does not fit:", str(e)[:150], flush=True)
