export PYTHONPATH=$PWD
python - <<'PY' 2>&1 | grep -v Warning | tail -40
import logging, sys, torch, traceback
logging.basicConfig(level=logging.WARNING)
logging.getLogger("rpcompile.capture").setLevel(logging.DEBUG)
sys.path.insert(0, "tests")
from rpcompile import layers_once
layers_once.MIN_REPEATS = 2
from models import qwen3, lm_batch
import inspect

print(inspect.signature(torch.compiler.nested_compile_region))
m = qwen3(layers=3)
from rpcompile.capture import capture_call
with layers_once.marked(m):
    pass
try:
    with layers_once.marked(m) as any_marked:
        print("marked", any_marked)
        got = {}
        def backend(gm, ex):
            got["gm"] = gm
            return gm.forward
        out = torch.compile(lambda **k: m(**k), backend=backend, fullgraph=True)(**lm_batch())
        print([str(n.target) for n in got["gm"].graph.nodes if "invoke" in str(n.target)][:3], len(got["gm"].graph.nodes))
        print(layers_once.inline_regions(got["gm"]))
except Exception:
    traceback.print_exc()
cap = capture_call(m, (), lm_batch(), dtype=torch.float32)
PY
