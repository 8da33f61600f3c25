"""JetMoE (transformers, tiny, fp32) through rpcompile's Inductor-compiled stages on one GPU against eager on the
same GPU: its experts' tokens grouped by counts read off the router (sizes the data decides, e5e8d40), 3
microbatches, at the default budget (one fused job) and at 1.15x the smallest (5 jobs), 3 SGD-momentum steps.
From the repository root: `PYTHONPATH=$PWD:$PWD/tests OUT=$OUT python benchmarks/runs/jetmoe_gpu_90/gpu_jet.py`
(90th session, one H100: jet_gpu.json)."""
import copy, json, os, time
import torch, rpcompile, transformers
from transformers import JetMoeConfig, JetMoeForCausalLM
from parity import tight_budget
DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "card": torch.cuda.get_device_name(0) if DEV != "cpu" else "CPU"}
torch.manual_seed(0)
cfg = JetMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64, output_router_logits=False, use_cache=False)
model = JetMoeForCausalLM(cfg)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.05)
ref = copy.deepcopy(model).to(DEV)
g = torch.Generator().manual_seed(1)
batches = []
for _ in range(3):
    ids = torch.randint(0, 128, (6, 32), generator=g); lab = ids.clone(); lab[0, :7] = -100
    batches.append({"input_ids": ids, "labels": lab})
for budget in ("default", "tight"):
    m = copy.deepcopy(model); r = copy.deepcopy(ref)
    cm = rpcompile.compile(m, rpcompile.Config(devices=[DEV], num_microbatches=3, dtype=torch.float32))
    if budget == "tight":
        cm.config.memory_budget = tight_budget(cm, batches[0], lambda c, b: c.train_step(**b))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9); opt_r = torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9)
    rec = {"losses": [], "ref": []}
    t0 = time.time()
    for step, b in enumerate(batches):
        loss = cm.train_step(**b)
        lr_ = r(**{k: v.to(DEV) for k, v in b.items()}).loss; lr_.backward()
        if step == 0:
            gmax = max(q.grad.abs().max().item() for q in r.parameters())
            rec["grad_rel"] = max((p.grad.to(DEV) - q.grad).abs().max().item() for p, q in zip(m.parameters(), r.parameters())) / gmax
        rec["losses"].append(loss.item()); rec["ref"].append(lr_.item())
        opt.step(); opt.zero_grad(); opt_r.step(); opt_r.zero_grad()
    pmax = max(q.abs().max().item() for q in r.parameters())
    rec["param_rel"] = max((p.to(DEV) - q).abs().max().item() for p, q in zip(m.parameters(), r.parameters())) / pmax
    rec["jobs"] = len(cm.stages); rec["microbatches"] = cm.plan.num_microbatches; rec["s"] = round(time.time() - t0, 1)
    rec["compiled"] = cm.config.compile_stages
    out[budget] = rec
    print(budget, json.dumps(rec), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "jet_gpu.json"), "w"), indent=1)
