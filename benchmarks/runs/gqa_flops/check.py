"""Note [grouped-query attention FLOPs] (rpcompile/passes/cost.py) on a device's torch: the FLOPs
the plan gives a GQA model's attention (Qwen3 shape: 8 query heads, 2 key/value heads), with the
formulas of the tree, or (OLD=1) with torch's own SDPA formulas as before. Prints one line."""
import os
import sys
import warnings

import torch
from torch.utils import flop_counter as fc

import rpcompile
from rpcompile.passes import cost

if os.environ.get("OLD"):
    aten = torch.ops.aten
    cost.EXTRA_FLOP_FORMULAS.clear()
    cost.EXTRA_FLOP_FORMULAS.update({aten._scaled_dot_product_flash_attention_for_cpu: fc.sdpa_flop.__wrapped__,
                                     aten._scaled_dot_product_flash_attention_for_cpu_backward:
                                         fc.sdpa_backward_flop.__wrapped__})
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32)
torch.manual_seed(0)
model = Qwen3ForCausalLM(cfg)
ids = torch.randint(0, 1024, (4, 512))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cm = rpcompile.compile(model, rpcompile.Config(devices=[device], num_microbatches=2))
    loss = cm.train_step(input_ids=ids, labels=ids)
nodes = [n for n in cm.plan.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
costs = [(str(n.meta["rp_cost"].fwd_flops), str(n.meta["rp_cost"].bwd_flops)) for n in nodes if "rp_cost" in n.meta]
bad = sorted({str(w.message)[:160] for w in caught if "could not measure" in str(w.message)})
print(f"torch {torch.__version__} {'old formulas' if os.environ.get('OLD') else 'tree'} on {device}: "
      f"loss {float(loss):.4f}; attention nodes (fwd, bwd FLOPs): {costs}; could not measure: {bad}")
