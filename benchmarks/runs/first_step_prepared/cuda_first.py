"""FlatStepper on cuda devices against the user's optimizer on the host: max relative diffs."""
import sys, time, torch
sys.path.insert(0, "tests")
from rpcompile.runtime.flat import FlatMasters, FlatStepper
from test_flat_optimizer import OPTIMIZERS, _grads
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
FlatMasters.BLOCK = 3000
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40))
worst = 0.0
for name, make in list(OPTIMIZERS.items()) + [("sgd-plain", lambda ps: torch.optim.SGD(ps, lr=1e-1))]:
    for share, prep in ((0.5, False), (1.0, False), (0.5, True), (1.0, True)):
        m, r = model(), model()
        ps, rs = list(m.parameters()), list(r.parameters())
        opt, ref = make(ps), make(rs)
        masters = FlatMasters([dev, dev], share); masters.flatten(ps)
        st = FlatStepper(opt, masters); st.PIECE = 2000
        on_dev = [p for p in ps if masters.device_range(*masters.where[id(p)])]
        if prep:
            st.prepare(ps)
        t = time.time()
        for step in range(3):
            gs = _grads(ps, step)
            st.step(ps, gs)
            for p, g in zip(rs, gs):
                p.grad = g.clone()
            ref.step(); ref.zero_grad(set_to_none=True)
        d = max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(ps, rs))
        sd, rd = opt.state_dict()["state"], ref.state_dict()["state"]
        ds = max([float((sd[i][k].cpu().float() - v.float()).abs().max() / max(v.float().abs().max(), 1e-12))
                 for i in rd for k, v in rd[i].items()], default=0.0)
        synced = all(st._device_view(p) is not None and torch.equal(st._device_view(p).cpu(), p) for p in on_dev)
        worst = max(worst, d, ds)
        print(f"{name:14s} share {share} prepared {prep} uploads {st.master_uploads}: on device {len(on_dev)}/{len(ps)}, params rel {d:.2e}, state rel {ds:.2e}, "
              f"device masters synced {synced}, state on {sorted({str(v.device) for i in sd for v in sd[i].values() if v.dim()})}, {time.time() - t:.2f} s")
print("worst", f"{worst:.2e}", "OK" if worst < 1e-5 else "CHECK")
