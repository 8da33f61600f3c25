"""42nd session: every mode on 4 CPU devices (threads and processes, pipeline and replicas) against eager or the
2-device delayed run: all passed (a check before the next 4-GPU run, not a test of the suite)."""
import sys, time, torch, traceback
sys.path.insert(0, "tests"); sys.path.insert(0, ".")   # (from the repository root)
import rpcompile
from parity import train_both, delayed_run
from models import qwen3, lm_batch
batches = [lm_batch(seed=t) for t in range(3)]
ok = True
for workers in ("threads", "processes"):
    for dp in (False, True):
        for mode in ("exact", "overlapped"):
            t0 = time.time()
            try:
                cfg = rpcompile.Config(devices=["cpu"] * 4, num_microbatches=4, memory_budget="300KiB", workers=workers,
                                       data_parallel=dp, optimizer_mode=mode)
                if mode == "exact":
                    cm = train_both(qwen3(seed=3), batches, cfg, min_stages=0)
                else:
                    import copy
                    model = qwen3(seed=3); ref = copy.deepcopy(model)
                    cm = rpcompile.compile(model, cfg)
                    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
                    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
                    for b in batches:
                        l = cm.train_step(**b); lr_ = ref(**b).loss; lr_.backward(); opt.step(); opt.zero_grad()
                        assert torch.allclose(l.float(), lr_.float(), rtol=1e-5, atol=1e-6), (l, lr_)
                    cm.synchronize()
                    for p, q in zip(model.parameters(), ref.parameters()):
                        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), (p - q).abs().max()
                print(f"ok {workers} dp={dp} {mode} replicas={cm.plan.replicas} jobs={len(cm.plan.stages)} {time.time()-t0:.1f}s", flush=True)
            except Exception:
                ok = False
                print(f"FAIL {workers} dp={dp} {mode}", flush=True); traceback.print_exc()
for workers in ("threads", "processes"):
    for dp in (False, True):
        t0 = time.time()
        try:
            a = delayed_run(workers, devices=4, data_parallel=dp)
            b = delayed_run("threads", devices=2, data_parallel=False)
            for x, y in zip(a[0], b[0]): assert torch.allclose(x, y, rtol=1e-5), (x, y)
            for x, y in zip(a[1], b[1]): assert torch.allclose(x, y, rtol=1e-4, atol=1e-6), (x - y).abs().max()
            print(f"ok delayed {workers} dp={dp} {time.time()-t0:.1f}s", flush=True)
        except Exception:
            ok = False
            print(f"FAIL delayed {workers} dp={dp}", flush=True); traceback.print_exc()
print("ALL OK" if ok else "SOME FAILED")
