"""Issue #16: the host bytes per parameter of delayed-mode AdamW training. Counted from the
objects, not from RSS: every host tensor a compiled model holds (found by walking everything
reachable from it), less the user's own (parameters, their gradients, the optimizer's state),
is the host buffers `cm.plan` states, to the byte, and `print(cm.plan)` shows those bytes."""
import gc
import os
import types

import pytest
import torch

import rpcompile
from rpcompile.plan import _fmt_bytes

from models import lm_batch

VOCAB = 512


def _model(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg)


_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType,
         types.MethodType, str, bytes, int, float, bool, type(None))


def _host_tensors(root) -> dict:
    """{storage address: bytes} of the real (not fake) host tensors reachable from root."""
    from torch._subclasses.fake_tensor import is_fake
    found, seen, stack = {}, set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not is_fake(obj) and obj.device.type == "cpu" and obj.layout == torch.strided:
                storage = obj.untyped_storage()
                if storage.data_ptr():
                    found[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(gc.get_referents(obj))
    return found


def _users(model, opt) -> set:
    """Storages of what the user holds: parameters, buffers, gradients, optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("tied,workers", [(True, "threads"), (False, "threads"), (True, "processes")])
def test_host_bytes_of_delayed_adamw_are_what_the_plan_says(tied, workers):
    model = _model(tied)
    model.model.layers[0].mlp.requires_grad_(False)       # frozen parameters: one working copy
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, dtype=torch.bfloat16,
                                                   lm_head_shards=2, optimizer_mode="delayed", workers=workers))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cm.attach_optimizer(opt)
    for t in range(3):                 # step 1 writes the second gradient set
        cm.train_step(**lm_batch(batch=4, seq=16, vocab=VOCAB, seed=t))
    cm.synchronize()
    gc.collect()

    planned = cm.plan.host_memory
    n = sum(p.numel() for p in model.parameters())
    theirs = _users(model, opt)
    if workers == "processes":
        # the worker processes' activation slots, mapped here to read a step's outputs from: a
        # step's activations (shared files the workers made), not buffers kept across steps
        memory = cm.runner.executor.memory
        theirs |= {base.untyped_storage().data_ptr() for name, base in memory._files.items()
                   if not name.startswith(f"{os.getpid()}-")}
        # ... and they are the plan's activations: one slot set per step alive, shared by the
        # workers (Note [slot sets]; a third where a step's last landing is heard after the next
        # step was issued); a chunk is at least 256 KiB
        assert planned.steps_alive == 2 and cm.runner.executor.slot_sets.made in (2, 3)
        slots = [os.path.getsize(os.path.join(memory.directory, f)) for f in os.listdir(memory.directory)
                 if not f.startswith(f"{os.getpid()}-") and not f.endswith(".sock")]
        jobs, sets = len(cm.plan.stages), cm.runner.executor.slot_sets.made
        per_step = planned.activations // planned.steps_alive
        assert sum(slots) <= sets * (per_step + jobs * (256 << 10)), (sum(slots), planned.activations)
    own = {ptr: b for ptr, b in _host_tensors(cm).items() if ptr not in theirs}
    allocated = cm.host_buffer_bytes()
    # the bytes the plan states are allocated: the working copies (two bf16 copies of trainable
    # parameters, one of frozen ones), the one gradient set (Note [one gradient set]; bf16, Note
    # [working-dtype gradients]) and the fp32 buffer the optimizer widens its slices into,
    # nothing rounded up
    carried = {"gradient rows carried to a later chunk": planned.carried_rows} if planned.carried_rows else {}
    assert allocated == {"working copies": planned.working_copies, "gradients": planned.grads, **carried,
                         "gradient slices widened for the optimizer": planned.widened}
    assert cm.runner.host_grads.flat.dtype == torch.bfloat16 and planned.widened > 0
    assert planned.carried_rows > 0    # rows a later chunk sums: the tied embedding's, the other head shard's
    t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert planned.working_copies == 2 * (2 * t + (n - t))
    # and they are all the compiled model holds (beyond a step's inputs and a few scalars)
    planned_own = planned.working_copies + planned.grads + planned.carried_rows + planned.widened
    assert planned_own <= sum(own.values()) <= planned_own + 4096, sorted(own.values())[-8:]
    assert sum(own.values()) / n <= planned.total / n
    # the user's: masters and AdamW's two moments (and its step counters)
    assert planned.masters == 4 * n and planned.optimizer_state == 8 * t
    # print(cm.plan) shows them
    line = next(s for s in str(cm.plan).splitlines() if s.startswith("host memory"))
    assert f"({planned.total / n:.1f} B/param)" in line
    for name, kind in [("working copies for upload", "working copies"), ("gradients", "gradients")]:
        assert f"{name} {_fmt_bytes(allocated[kind])}" in line
    assert f"master weights {_fmt_bytes(4 * n)}" in line and f"optimizer state (AdamW assumed) {_fmt_bytes(8 * t)}" in line
