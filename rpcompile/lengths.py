"""Which input dims are sequence lengths: marked dynamic at capture, so one capture serves all.

Note [dynamic lengths]: batches of text vary in length, and a capture, plan and compiled stage
programs per length cost a first step each time (42-70 s per new length for Qwen3-1.7B on an
H200). So the capture makes the length dims symbolic, and one capture, one plan and one set of
stage programs serve every length. The rule, predictable from the call alone:

- The sequence length L is dim 1 of the first tensor argument, when it has at least 2 dims
  (as the batch size is its dim 0, Note [batched inputs] in passes/batch.py).
- Every dim of a tensor argument whose size is L gets `torch._dynamo.maybe_mark_dynamic`
  (`input_ids`, `attention_mask`, `labels`, `position_ids`, a (B, L, L) mask's two last dims),
  except dim 0 of a batched input (that is the batch). "maybe": where the model needs the size
  fixed (a reshape to a constant, a channel count that meets a weight) dynamo keeps it static,
  and the plan then fixes that size.
- Nothing is marked when L <= 1 (dynamo fixes sizes 0 and 1 anyway) or L equals the batch
  size (a dim of size L could then be the batch or the length; the capture stays static in
  it, and a later length captures again).
- `Config(dynamic_lengths=False)` marks nothing: every new length captures and plans anew.

Why mark at the first capture rather than capture static and re-capture once a second length
shows up (torch.compile's automatic dynamic): the issue's bar is that every step after the
first costs little at a new length, and a re-capture is a full first step (capture, plan and,
on GPUs, every Inductor piece); dynamo keeps static what must be static, so marking costs
nothing where a dim is not a length.

A cached capture is never trusted blindly: before a call uses it, every dim of every input is
checked against the capture's symbolic shape and dynamo's guards (shapes.py); a call that
disagrees (two dims equal at capture and not now, a size a guard excludes) is captured again.
"""
from __future__ import annotations

from typing import Optional

import torch


def sequence_length(leaves) -> Optional[int]:
    """L: dim 1 of the first tensor argument (None when it has fewer than 2 dims)."""
    first = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return first.shape[1] if first is not None and first.dim() >= 2 else None


def length_dims(leaves, batch: Optional[int], batched) -> dict:
    """{leaf index: [dims]} to mark dynamic (Note [dynamic lengths]); batched(i) says whether
    leaf i is split on dim 0."""
    L = sequence_length(leaves)
    if L is None or L <= 1 or L == batch:
        return {}
    marks = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            dims = [d for d, size in enumerate(leaf.shape) if size == L and not (d == 0 and batched(i))]
            if dims:
                marks[i] = dims
    return marks


def tensor_inputs(gm) -> list:
    """The graph's placeholders of tensor call arguments, in call order (rp_index)."""
    return sorted((n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("rp_kind") == "input"
                   and isinstance(n.meta.get("example_value"), torch.Tensor)), key=lambda n: n.meta["rp_index"])


def length_symbols(gm, bindings: dict, batch_names) -> tuple:
    """(L, names): the sequence length a plan is costed at and the names of the size symbols that
    stand for it, or (None, ()) when it is not symbolic (static shapes, L <= 1, L equal to the
    batch size). L is dim 1 of the first tensor input of the graph; each length dim is a symbol
    of its own (input_ids' and labels' are two), so the names are every plain symbol of an input
    dim, other than a batch symbol, that is bound to L."""
    inputs = tensor_inputs(gm)
    if not inputs or inputs[0].meta["example_value"].dim() < 2:
        return None, ()
    size = inputs[0].meta["example_value"].shape[1]
    if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
        return None, ()
    name = size.node.expr.name
    if name in batch_names or name not in bindings:
        return None, ()
    L = int(bindings[name])
    names = set()
    for n in inputs:
        for s in n.meta["example_value"].shape:
            if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                sym = s.node.expr.name
                if sym not in batch_names and bindings.get(sym) == L:
                    names.add(sym)
    return L, tuple(sorted(names))
