"""Note [gradients stay on the device] on a GPU: a tiny Qwen3 (tied and not) in overlapped mode
on one GPU (fp32 compute), a share of the update there (0.5: host and device parameters in one job, with
clipping, whose norm then spans both; 1.0), fp32, against eager PyTorch on the CPU: losses and
parameters after 4 SGD-with-momentum steps, and which parts of the host gradient set the step
wrote (the parameters stepped on the GPU: none).

    PYTHONPATH=$PWD python benchmarks/runs/grads_stay/check.py [--out FILE]
"""
import argparse
import copy
import json
import math
import sys

import torch

sys.path.insert(0, "tests")
import rpcompile  # noqa: E402
from models import lm_batch, qwen3  # noqa: E402
from rpcompile.runtime.flat import FlatMasters  # noqa: E402


def run(tied, share, max_grad_norm, device):
    FlatMasters.BLOCK = 1000          # blocks that split this small model
    model = qwen3(tied=tied, layers=1)
    ref = copy.deepcopy(model)
    cm = rpcompile.compile(model, rpcompile.Config(devices=[device], num_microbatches=2, optimizer_mode="overlapped",
                                                   optimizer_on_devices=share, lm_head_shards=2,
                                                   compile_stages=False, dtype=torch.float32))
    cm.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_grad_norm=max_grad_norm)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        batch = lm_batch(seed=step)
        loss = float(cm.train_step(**batch))
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        opt_ref.step(), opt_ref.zero_grad()
        losses.append((loss, float(loss_ref)))
        cm.synchronize()
        if step == 0:
            cm.runner.host_grads.flat.fill_(float("nan"))
    layout, dg = cm.plan.host_memory.grad_layout, cm.runner.mode.device_grads
    masters, flat = cm.runner.overlapped.masters, cm.runner.host_grads.flat
    wrong_parts = []
    for key, off, shape in layout.keys[0]:
        i = key[0] if isinstance(key, tuple) else key
        stays = masters.place_of(cm.plan.captured.params[i])[1] is not None
        if bool(flat[off:off + math.prod(shape)].isnan().all()) != stays:
            wrong_parts.append(str(key))
    err = max(float((p.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12))
              for p, q in zip(model.parameters(), ref.parameters()))
    return {"tied": tied, "share": share, "max_grad_norm": max_grad_norm, "device_grads": dg is not None,
            "params_on_device": len(dg.params) if dg else 0, "params": len(cm.plan.captured.params),
            "losses": losses, "max_rel_param_err_step4": err, "host_set_parts_wrong": wrong_parts}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    out = [run(tied, share, clip, args.device) for tied, share, clip in
           [(True, 1.0, None), (False, 1.0, 0.05), (True, 0.5, 0.05), (False, 0.5, None)]]
    ok = all(r["device_grads"] and not r["host_set_parts_wrong"] and r["max_rel_param_err_step4"] < 1e-5
             and all(abs(a - b) <= 1e-5 * abs(b) for a, b in r["losses"]) for r in out)
    text = json.dumps({"ok": ok, "runs": out}, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
