"""Train a tiny Qwen3 with rpcompile on two CPU "devices" and compare with eager PyTorch.

    python examples/train_tiny_qwen3.py            # CPU threads
    python examples/train_tiny_qwen3.py --gpus 2   # two GPUs, bf16
"""
import argparse
import copy

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import rpcompile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(cfg)
    eager = copy.deepcopy(model)
    devices = [f"cuda:{i}" for i in range(args.gpus)] or ["cpu", "cpu"]
    cm = rpcompile.compile(model, rpcompile.Config(devices=devices, num_microbatches=3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (6, 32))
    for step in range(args.steps):
        loss = cm.train_step(input_ids=ids, labels=ids)
        opt.step(), opt.zero_grad()
        ref = eager(input_ids=ids, labels=ids).loss
        ref.backward()
        opt_eager.step(), opt_eager.zero_grad()
        print(f"step {step}: rpcompile {loss.item():.5f}  eager {ref.item():.5f}")
    print(cm.plan)
    print(cm.stages[0].program.code)


if __name__ == "__main__":
    main()
