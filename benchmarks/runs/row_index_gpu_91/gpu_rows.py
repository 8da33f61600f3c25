"""Rows picked by an index on the GPU (Note [rows picked by an index], passes/batch_index.py): forwards captured
with their indices made on cuda (`torch.arange(B, device=x.device)`), 2 microbatches on one GPU, fp32, through
Inductor-compiled stages. The ones that pick other rows (reversed, shifted, a random permutation, a fixed row, rows
written by index into a row per class, positions read from a batched argument) must be refused with the InputError
before any step, parameters unchanged; the one that picks each row's own (arange, the last entry of a (B * 2) value, a
sequence classifier's `h[arange(B), last]`, a concatenation's first block) and a tiny Qwen3 sequence classifier over a
right-padded batch must train as eager on the same GPU (3 SGD-momentum steps).
From the repository root: `PYTHONPATH=$PWD:$PWD/tests OUT=$OUT python benchmarks/runs/row_index_gpu_91/gpu_rows.py`."""
import copy, json, os
import torch, torch.nn as nn, torch.nn.functional as F, rpcompile, transformers

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "card": torch.cuda.get_device_name(0) if DEV != "cpu" else "CPU"}


class Picked(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, y, partner=None):
        h, rows, d = self.b(torch.tanh(self.a(x))), x.shape[0], x.device
        k = self.kind
        if k == "reversed":
            other = h[torch.arange(rows - 1, -1, -1, device=d)]
        elif k == "shifted":
            other = h.index_select(0, (torch.arange(rows, device=d) + 1) % rows)
        elif k == "randperm":
            other = h[torch.randperm(rows, device=d)]
        elif k == "fixed":
            other = torch.gather(h, 0, torch.zeros(1, 4, dtype=torch.long, device=d))
        elif k == "written":
            labels = (x[:, 0] > 0).long()
            last = h.new_zeros(2, 4)
            last[labels] = h
            other = last[labels]
        elif k == "partner":
            other = h[partner]
        else:
            a = torch.arange(rows, device=d)
            other = (h[a] + h.repeat_interleave(2, 0)[a * 2 + 1] + h.view(rows, 2, 2)[a, (x[:, 0] > 0).long()].repeat(1, 2)
                     + torch.cat([h, 2 * h])[a])
        return F.mse_loss(h - 0.25 * other, y)


def step_both(model, batches, cfg, loss_of, call=lambda cm, b: cm.train_step(**b)):
    """3 SGD-momentum steps of the compiled model (`call`) and of an eager copy on DEV (`loss_of`): the losses,
    the gradients of step 1 and the parameters after the steps against eager's (gpu_ratios.py uses it too)."""
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
    rec["jobs"], rec["compiled"] = len(cm.stages), cm.config.compile_stages
    return rec


def main():
    cfg = rpcompile.Config(devices=[DEV], num_microbatches=2, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    for kind in ("reversed", "shifted", "randperm", "fixed", "written", "partner"):
        torch.manual_seed(0)
        model = Picked(kind)
        before = copy.deepcopy(model.state_dict())
        batch = {"x": x, "y": y, **({"partner": torch.tensor([1, 0, 2, 3, 3, 2, 1, 0])} if kind == "partner" else {})}
        try:
            rpcompile.compile(model, cfg).train_step(**batch)
            out[kind] = {"refused": False}
        except rpcompile.InputError as e:
            out[kind] = {"refused": True, "message": str(e)[:400],
                         "unchanged": all(torch.equal(p, before[n]) for n, p in model.state_dict().items())}
        print(kind, json.dumps(out[kind]), flush=True)

    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]
    out["own"] = step_both(Picked("own"), batches, cfg, lambda m, b: m(**b))
    print("own", json.dumps(out["own"]), flush=True)

    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    torch.manual_seed(0)
    clf = Qwen3ForSequenceClassification(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                     head_dim=16, num_labels=3, pad_token_id=0))
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 128, (6, 16), generator=g)
        mask = torch.ones_like(ids)
        for r, n in enumerate((16, 9, 12, 5, 16, 7)):
            ids[r, n:], mask[r, n:] = 0, 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (6,), generator=g)})
    out["seq_classifier"] = step_both(clf, batches, cfg, lambda m, b: m(**b).loss)
    print("seq_classifier", json.dumps(out["seq_classifier"]), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "rows_gpu.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
