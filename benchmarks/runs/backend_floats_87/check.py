"""The backend path (torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)) on one GPU:
graph breaks while compiling stage pieces, stage jobs taken as random, and step times, for the
tree on PYTHONPATH (run once per side of an A/B). Qwen3 shape: --layers layers of width 2048."""
import argparse, json, time

import torch
from torch._dynamo.utils import counters
from transformers import Qwen3Config, Qwen3ForCausalLM

import rpcompile

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=8)
p.add_argument("--rows", type=int, default=8)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--steps", type=int, default=8)
a = p.parse_args()
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=a.layers,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
model = Qwen3ForCausalLM(cfg)
be = rpcompile.backend(rpcompile.Config(devices=["cuda:0"], num_microbatches=a.microbatches, dtype=torch.bfloat16))
compiled = torch.compile(model, backend=be, dynamic=True)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
times, losses = [], []
for s in range(a.steps + 2):
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, cfg.vocab_size, (a.rows, a.seq), generator=g)
    t = time.perf_counter()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
    print(f"step {s}: {times[-1]:.3f} s loss {losses[-1]:.4f}", flush=True)
timed = sorted(times[2:])
out = {"rpcompile": rpcompile.__file__, "card": torch.cuda.get_device_name(0), "layers": a.layers,
       "tokens_per_step": a.rows * a.seq, "microbatches": a.microbatches, "plans": len(be.plans),
       "stage_jobs": [len(pl.stages) for pl in be.plans],
       "random_stage_jobs": [sum(st.random for st in pl.stages) for pl in be.plans],
       "graph_breaks": sum(counters["graph_break"].values()),
       "graph_break_reasons": [k[:120] for k in counters["graph_break"]],
       "first_two_steps_s": times[:2], "timed_median_s": timed[len(timed) // 2], "timed_s": times[2:],
       "tokens_per_s": a.rows * a.seq / timed[len(timed) // 2], "losses": losses}
print("RESULT", json.dumps(out), flush=True)
