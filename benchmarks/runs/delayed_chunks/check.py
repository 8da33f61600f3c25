"""Note [chunks within a piece] and Note [masters kept on the devices] on a GPU: a tiny Qwen3 (tied
and not) in delayed mode on one GPU (fp32 compute), a share of the update there (0.5: host and
device parameters in one piece; 1.0), pieces cut into chunks of SUBCHUNK elements (small: several a
piece; the default: one), against the same delayed steps on a CPU device with every update on the
host: the losses of 4 SGD-with-momentum steps, `model.state_dict()` read after step 2 without
`cm.synchronize()` (its pre-hook brings the kept masters down), a forward call's logits after
step 3, and the parameters at the end.

    PYTHONPATH=$PWD python benchmarks/runs/delayed_chunks/check.py [--out FILE]
"""
import argparse
import json
import sys

import torch

sys.path.insert(0, "tests")
import rpcompile  # noqa: E402
from models import lm_batch, qwen3  # noqa: E402
from rpcompile.runtime import submission  # noqa: E402
from rpcompile.runtime.flat import FlatMasters  # noqa: E402


def run(tied, share, subchunk, device):
    FlatMasters.BLOCK = 1000          # blocks that split this small model
    submission.SUBCHUNK = subchunk
    model = qwen3(tied=tied, layers=1)
    cm = rpcompile.compile(model, rpcompile.Config(devices=[device], num_microbatches=2, optimizer_mode="delayed",
                                                   optimizer_on_devices=share, lm_head_shards=2,
                                                   compile_stages=False, dtype=torch.float32))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses, away = [], []
    for step in range(4):
        losses.append(float(cm.train_step(**lm_batch(seed=step))))
        if step == 2:
            cm.runner.settle()
            cm.runner.overlapped.drain()
            away.append(cm.runner.overlapped.masters_away)
            state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        if step == 3:
            with torch.no_grad():
                logits = cm(**lm_batch(seed=9)).logits.float().cpu()
    cm.synchronize()
    keys = {s: [k for k, _, _ in ks] for s, ks in cm.plan.host_memory.grad_layout.keys.items()}
    chunks = len(submission.submission_chunks(cm.plan, keys).lengths)
    return {"losses": losses, "state": state, "logits": logits, "chunks": chunks, "away": away,
            "params": [p.detach().clone().cpu() for p in model.parameters()]}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    out, ok = [], True
    for tied in (True, False):
        ref = run(tied, 0.0, 1 << 28, "cpu")
        for share, subchunk in [(1.0, 3000), (0.5, 3000), (1.0, 1 << 28)]:
            r = run(tied, share, subchunk, args.device)
            row = {"tied": tied, "share": share, "subchunk": subchunk, "chunks": r["chunks"], "ref_chunks": ref["chunks"],
                   "masters_away_after_step_2": r["away"],
                   "max_rel_loss_err": max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])),
                   "max_rel_state_err_step_2": max(rel(r["state"][k], ref["state"][k]) for k in ref["state"]),
                   "max_rel_logits_err_step_3": rel(r["logits"], ref["logits"]),
                   "max_rel_param_err_end": max(rel(a, b) for a, b in zip(r["params"], ref["params"]))}
            row["ok"] = (all(v < 1e-5 for k, v in row.items() if k.startswith("max_rel"))
                         and row["masters_away_after_step_2"] == [True])
            ok &= row["ok"]
            out.append(row)
    text = json.dumps({"ok": ok, "runs": out}, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
