"""Losses over a sum of the data on the GPU (Note [sums over a sum of the data], passes/normalize_loss.py), and the
refusals of the same session, through Inductor-compiled stages on one GPU, fp32, 2 microbatches, 3 SGD-momentum steps
against eager on the same GPU: the test models of tests/test_loss_terms.py (_Ratios: a masked mean written out, floored
beside a mean over rows, a sum cross-entropy over its counted labels, a sum weighed by the data's weights), a tiny
Qwen3 whose loss_fn writes its token mean out (labels ignored unevenly); a divisor the parameters compute, rows scaled
by a count over the rows and rows less their median must be refused before any step.
From the repository root: `PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks/runs/row_index_gpu_91 OUT=$OUT python
benchmarks/runs/row_index_gpu_91/gpu_ratios.py` (its step_both is gpu_rows.py's)."""
import copy, json, os
import torch, rpcompile, transformers
from test_loss_terms import _Ratios, _masked_token_mean, _uneven
from test_batching import _CountScaled, _TupleOverRows
from models import qwen3
from gpu_rows import DEV, step_both

out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "card": torch.cuda.get_device_name(0) if DEV != "cpu" else "CPU"}
cfg = rpcompile.Config(devices=[DEV], num_microbatches=2, dtype=torch.float32)


g = torch.Generator().manual_seed(1)
batches = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]
for kind in ("masked", "floored", "counted", "weighted"):
    torch.manual_seed(0)
    out[kind] = step_both(_Ratios(kind), batches, cfg, lambda m, b: m(**b))
    print(kind, json.dumps(out[kind]), flush=True)
torch.manual_seed(0)
lm = qwen3(layers=1)
lm_batches = [_uneven(s) for s in range(3)]
lm_cfg = rpcompile.Config(devices=[DEV], num_microbatches=2, dtype=torch.float32, loss_fn=_masked_token_mean)
out["qwen3_token_mean"] = step_both(lm, lm_batches, lm_cfg,
                                    lambda m, b: _masked_token_mean(m(input_ids=b["input_ids"]), b["labels"]),
                                    lambda cm, b: cm.train_step(input_ids=b["input_ids"], target=b["labels"]))
print("qwen3_token_mean", json.dumps(out["qwen3_token_mean"]), flush=True)
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
