import time, sys, torch, contextlib
sys.path.insert(0, ".")
from benchmarks.common import get_model, build_model, batch_ids
from rpcompile.capture import capture_call
from rpcompile import layers_once
print("torch", torch.__version__)
real, real_inline = layers_once.marked, layers_once.inline_regions
counts = []
layers_once.inline_regions = lambda gm: counts.append(real_inline(gm)) or counts[-1]
for name in sys.argv[1:]:
    spec = get_model(name)
    model = build_model(spec, init_device="meta", device="meta", max_positions=2048)
    ids = batch_ids(spec.vocab, 8, 2048, step=0)
    for mode in ["once", "plain", "once", "plain"]:
        layers_once.marked = real if mode == "once" else (lambda m: contextlib.nullcontext(False))
        counts.clear()
        t = time.perf_counter()
        try:
            cap = capture_call(model, (), {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cuda:0")
            print(name, mode, round(time.perf_counter() - t, 2), "s", len(cap.gm.graph.nodes), "nodes, inlined", counts, flush=True)
        except Exception as e:
            print(name, mode, "failed", type(e).__name__, str(e)[:300], flush=True)
