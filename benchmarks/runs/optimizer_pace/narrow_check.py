"""41st session: Note [one microbatch a copy] on 2 GPUs: tiny Qwen3, bf16 delayed mode, replicas of one
microbatch each; fp32 accumulators (threads, rule patched) against bf16 ones (threads; worker processes, NCCL)."""
import sys, torch
sys.path.insert(0, "tests")
import rpcompile
from models import qwen3, lm_batch
from rpcompile.runtime import job


def run(workers, wide, share=1.0):
    if wide:
        job.accumulator_dtype = lambda step, copies: torch.float32
    else:
        from rpcompile.runtime.grads import accumulator_dtype
        job.accumulator_dtype = accumulator_dtype
    model = qwen3(seed=3)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0", "cuda:1"], num_microbatches=2, memory_budget="4MiB",
                                                   optimizer_mode="delayed", workers=workers, dtype=torch.bfloat16,
                                                   data_parallel=True, compile_stages=False,
                                                   optimizer_on_devices=share))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    losses = [cm.train_step(**lm_batch(seed=t)).item() for t in range(3)]
    cm.synchronize()
    assert cm.plan.replicas == 2
    return losses, [p.detach().clone() for p in model.parameters()]


ref = run("threads", True)
for workers in ("threads", "processes"):
    got = run(workers, False)
    d = max((a - b).abs().max().item() for a, b in zip(got[1], ref[1]))
    scale = max(p.abs().max().item() for p in ref[1])
    print(f"narrow {workers} vs wide threads: losses {got[0]} vs {ref[0]}; params max abs diff {d:.3g} (largest param {scale:.3g}); "
          f"bit-equal {all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))}", flush=True)
host = run("threads", False, share=0.0)
d = max((a - b).abs().max().item() for a, b in zip(host[1], ref[1]))
print(f"optimizer on the host vs on the devices: losses {host[0]} vs {ref[0]}; params max abs diff {d:.3g}", flush=True)
