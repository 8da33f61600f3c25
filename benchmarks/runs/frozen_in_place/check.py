"""Frozen weights in their working dtype read where they lie, on CUDA (96th session): Note [frozen
weights in place] (rpcompile/runtime/weights.py), host_buffers.pinned_in_place.

1. pinned_in_place page-locks a host tensor without a copy (is_pinned), one handle per address,
   unpinned once the handle goes.
2. A LoRA run whose frozen base is bf16 (read in place, pinned) against the same run with the
   base fp32 that rounds to those bf16 values (copied to bf16, as before): the devices compute on
   the same bf16 weights, so losses and adapters after 4 SGD steps must agree (exact, overlapped,
   delayed in threads, and delayed and exact in worker processes, where the frozen base moves into
   their shared memory: 97th session; in exact mode at the plan's first step, a chunk a file, since
   the 98th). Prints the largest differences, the host's working-copy bytes each
   side holds, and whether the frozen bases are pinned in place (threads) or lie in the shared
   memory (processes: the workers pin it there).
From the repository root:

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/runs/frozen_in_place/check.py
"""
import json

import torch

import rpcompile
from rpcompile.runtime.host_buffers import pinned_in_place
from models import lm_batch

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"     # (cpu: a smoke run of part 2 here)


def pinning():
    t = torch.randn(1 << 20, dtype=torch.bfloat16)
    was = t.is_pinned()
    held = pinned_in_place(t)
    again = pinned_in_place(t)
    pinned = t.is_pinned()
    d = t.to("cuda:0", non_blocking=True)
    torch.cuda.synchronize()
    same = torch.equal(d.cpu(), t)
    one = held is again
    del held, again
    return {"pinned_before": was, "pinned_after": pinned, "one_handle": one, "upload_equal": same,
            "pinned_after_handle_gone": t.is_pinned()}


def lora_model(bf16_base: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                      tie_word_embeddings=False)
    base = Qwen3ForCausalLM(cfg)
    with torch.no_grad():                    # the same bf16 values either way
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    if bf16_base:
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    return model


def run(mode, workers, bf16_base):
    model = lora_model(bf16_base)
    cm = rpcompile.compile(model, rpcompile.Config(devices=[DEV, DEV], num_microbatches=2, dtype=torch.bfloat16,
                                                   optimizer_mode=mode, workers=workers))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.5, momentum=0.9)
    if mode != "exact":
        cm.attach_optimizer(opt)
    losses = []
    for s in range(4):
        losses.append(cm.train_step(**lm_batch(batch=6, seq=64, vocab=512, seed=s)))
        if mode == "exact":
            opt.step()
            opt.zero_grad()
    cm.synchronize()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    refs = [getattr(cm.runner.host_placement, "ref", lambda t: None)(p.detach()) for p in frozen]
    out = {"losses": [float(x) for x in losses], "adapters": [p.detach().clone() for p in trained],
           "working_copy_bytes": cm.host_buffer_bytes().get("working copies", 0),
           "frozen_pinned": sum(p.is_pinned() for p in frozen), "frozen": len(frozen),
           "frozen_shared": sum(ref is not None for ref in refs),
           "frozen_files": len({ref.file for ref in refs if ref is not None})}
    del cm, opt
    return out


if __name__ == "__main__":
    if DEV != "cpu":
        print("pinning", json.dumps(pinning()), flush=True)
    for mode, workers in (("exact", "threads"), ("overlapped", "threads"), ("delayed", "threads"),
                          ("delayed", "processes"), ("exact", "processes")):
        key = f"{mode}_{workers}"
        try:
            a, b = run(mode, workers, False), run(mode, workers, True)
            scale = max(p.abs().max().item() for p in a["adapters"])
            res = {"loss_abs_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
                   "adapter_diff_rel_largest": max((p - q).abs().max().item() for p, q in zip(a["adapters"], b["adapters"])) / scale,
                   "working_copy_bytes_fp32_base": a["working_copy_bytes"], "working_copy_bytes_bf16_base": b["working_copy_bytes"],
                   "frozen_pinned_bf16_base": f"{b['frozen_pinned']} of {b['frozen']}",
                   "frozen_shared_bf16_base": f"{b['frozen_shared']} of {b['frozen']} in {b['frozen_files']} files",
                   "losses": b["losses"]}
        except Exception as e:   # noqa: BLE001 - a check: say it and go on
            res = {"error": f"{type(e).__name__}: {e}"[:800]}
        print(key, json.dumps(res), flush=True)
