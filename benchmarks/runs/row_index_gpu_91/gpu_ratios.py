"""Losses over a sum of the data on the GPU (Note [sums over a sum of the data], passes/normalize_loss.py), and the
refusals of the same session, through Inductor-compiled stages on one GPU, fp32, 2 microbatches, 3 SGD-momentum steps
against eager on the same GPU: the test models of tests/test_loss_terms.py (_Ratios: a masked mean written out, floored
beside a mean over rows, a sum cross-entropy over its counted labels, a sum weighed by the data's weights), a tiny
Qwen3 whose loss_fn writes its token mean out (labels ignored unevenly); a divisor the parameters compute, rows scaled
by a count over the rows and rows less their median must be refused before any step.
From the repository root: `PYTHONPATH=$PWD:$PWD/tests OUT=$OUT python benchmarks/runs/row_index_gpu_91/gpu_ratios.py`."""
import copy, json, os
import torch, rpcompile, transformers
from test_loss_terms import _Ratios, _masked_token_mean, _uneven
from test_batching import _CountScaled, _TupleOverRows
from models import qwen3

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "card": torch.cuda.get_device_name(0) if DEV != "cpu" else "CPU"}
cfg = rpcompile.Config(devices=[DEV], num_microbatches=2, dtype=torch.float32)


def step_both(model, batches, loss_of, call):
    ref = copy.deepcopy(model).to(DEV)
    cm = rpcompile.compile(model, cfg)
    opt, opt_r = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    rec = {"losses": [], "ref": []}
    for step, b in enumerate(batches):
        loss = call(cm, b)
        lr_ = loss_of(ref, {k: v.to(DEV) for k, v in b.items()})
        lr_.backward()
        if step == 0:
            gmax = max(q.grad.abs().max().item() for q in ref.parameters())
            rec["grad_rel"] = max((p.grad.to(DEV) - q.grad).abs().max().item()
                                  for p, q in zip(model.parameters(), ref.parameters())) / gmax
        rec["losses"].append(loss.item()); rec["ref"].append(lr_.item())
        opt.step(); opt.zero_grad(); opt_r.step(); opt_r.zero_grad()
    pmax = max(q.abs().max().item() for q in ref.parameters())
    rec["param_rel"] = max((p.to(DEV) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) / pmax
    rec["loss_diff"] = max(abs(a - b) for a, b in zip(rec["losses"], rec["ref"]))
    rec["jobs"] = len(cm.stages)
    return rec


g = torch.Generator().manual_seed(1)
batches = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]
for kind in ("masked", "floored", "counted", "weighted"):
    torch.manual_seed(0)
    out[kind] = step_both(_Ratios(kind), batches, lambda m, b: m(**b), lambda cm, b: cm.train_step(**b))
    print(kind, json.dumps(out[kind]), flush=True)
torch.manual_seed(0)
lm = qwen3(layers=1)
lm_batches = [_uneven(s) for s in range(3)]
lm_cfg = cfg
cfg = rpcompile.Config(devices=[DEV], num_microbatches=2, dtype=torch.float32, loss_fn=_masked_token_mean)
out["qwen3_token_mean"] = step_both(lm, lm_batches, lambda m, b: _masked_token_mean(m(input_ids=b["input_ids"]), b["labels"]),
                                    lambda cm, b: cm.train_step(input_ids=b["input_ids"], target=b["labels"]))
print("qwen3_token_mean", json.dumps(out["qwen3_token_mean"]), flush=True)
cfg = lm_cfg
for name, make in (("learned_divisor", lambda: _Ratios("learned")), ("count_scaled", _CountScaled),
                   ("median", lambda: _TupleOverRows("median"))):
    torch.manual_seed(0)
    model = make()
    before = copy.deepcopy(model.state_dict())
    try:
        rpcompile.compile(model, cfg).train_step(**batches[0])
        out[name] = {"refused": False}
    except rpcompile.InputError as e:
        out[name] = {"refused": True, "message": str(e)[:300],
                     "unchanged": all(torch.equal(p, before[n]) for n, p in model.state_dict().items())}
    print(name, json.dumps(out[name]), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ratios_gpu.json"), "w"), indent=1)
