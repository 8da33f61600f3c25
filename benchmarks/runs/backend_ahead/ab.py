"""Note [the loss's backward ahead through the backend] (rpcompile/backend.py), timed: a model
trained through `torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)` with
`loss.backward(); opt.step(); opt.zero_grad()`, each call running its loss's job ahead (the tree)
and, on a second copy of the same model in the same process, with the ahead off (GraphRunner.call
given ahead=False, as before). Warm-up steps, then timed steps; prints one JSON line per side.

    python benchmarks/runs/backend_ahead/ab.py --model qwen3-1.7b --device cuda:0 --seq-len 2048 \
        --tokens 32768 --microbatches 4 --warmup 2 --steps 8
"""
import argparse
import json
import statistics
import time

import torch

import rpcompile
from benchmarks.common import batch_ids, build_model, get_model
from rpcompile.runner import GraphRunner


def side(name, spec, args, ahead: bool):
    torch._dynamo.reset()
    real = GraphRunner.call
    if not ahead:
        GraphRunner.call = lambda self, plan, leaves, ahead=False: real(self, plan, leaves, False)
    try:
        on_gpu = args.device.startswith("cuda")
        model = build_model(spec, init_device=args.device if on_gpu else None)
        cfg = rpcompile.Config(devices=[args.device], num_microbatches=args.microbatches,
                               dtype=torch.bfloat16 if on_gpu else torch.float32)
        compiled = torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=on_gpu)
        rows = args.tokens // args.seq_len
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            ids = batch_ids(spec.vocab, rows, args.seq_len, step)
            t0 = time.perf_counter()
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        timed = times[args.warmup:]
        med = statistics.median(timed)
        return {"side": name, "ahead": ahead, "tokens_per_s": round(args.tokens / med), "median_step_s": round(med, 3),
                "timed_step_s": [round(t, 3) for t in timed], "first_step_s": round(times[0], 1),
                "losses": [round(v, 4) for v in losses]}
    finally:
        GraphRunner.call = real


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--order", default="before,tree")
    args = ap.parse_args()
    spec = get_model(args.model)
    card = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    for name in args.order.split(","):
        out = side(name, spec, args, ahead=(name == "tree"))
        print(json.dumps({"card": card, "model": args.model, "torch": torch.__version__, **vars(args), **out}), flush=True)


if __name__ == "__main__":
    main()
