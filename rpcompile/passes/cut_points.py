"""Where the graph may be cut into stages, and the cost table of the pieces between cuts.

A *position* p in 0..L is the gap before the p-th compute node (placeholders and the output
are not compute nodes). The values *live* at p are those made before p and read at or after
p: what a stage ending at p must hand to the next one. A position is a legal cut when its live
activations are few and small: at most MAX_LIVE values and at most CUT_SLACK times the median
live bytes of the interior gaps (layer boundaries in a decoder carry the residual stream plus
small rotary tables and masks; the gaps inside attention carry q, k and v as well).
"""
from __future__ import annotations

import bisect
import dataclasses

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .cost import Hardware, NodeCost, evaluate, node_seconds, storage_key
from .graph_utils import FUNCTORCH_ENTER, FUNCTORCH_LEAVE, grad_off_positions, mutated_values
from .partition import Segment
from .regions import block_keys

# A gap whose live activations are at most this many times the median gap's is a cut.
CUT_SLACK = 1.0
MAX_LIVE = 12


def body_nodes(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def value_bytes(value, bindings) -> int:
    """Bytes of a node's value (tensors inside tuples counted), at the given symbol values."""
    total = 0
    for v in torch.utils._pytree.tree_leaves(value):
        if isinstance(v, torch.Tensor):
            n = v.element_size()
            for s in v.shape:
                n *= int(evaluate(s.node.expr, bindings)) if isinstance(s, torch.SymInt) else s
            total += n
    return total


@dataclass
class Liveness:
    """Per position: the activation nodes live across it (placeholders excluded)."""

    body: list
    live: list          # live[p]: list of nodes, for p in 0..L
    index: dict         # node -> position of the node in body
    _blocked: Optional[set] = field(default=None, repr=False)

    def blocked(self) -> set:
        """Positions no stage may end at, whatever the sizes (see legal_cuts); computed once."""
        if self._blocked is None:
            L = len(self.body)
            live = dict.fromkeys(n for nodes in self.live for n in nodes)    # each node once (live at many positions)
            unsendable = {n for n in live if _data_dependent(n) or _tensor_tuple(n) or _of_a_parameter(n)}
            self._blocked = (_mutation_spans(self) | _buffer_spans(self) | _functorch_regions(self)
                             | _grad_off_regions(self)
                             | {p for p in range(L + 1) if any(n in unsendable for n in self.live[p])})
        return self._blocked

    def node_bytes(self, bindings, positions=None) -> dict:
        """{node: bytes of its value at bindings} for every node live at `positions` (default: any)."""
        out = {}
        for p in range(len(self.live)) if positions is None else positions:
            for n in self.live[p]:
                if n not in out:
                    out[n] = value_bytes(n.meta.get("example_value"), bindings)
        return out


def liveness(gm: fx.GraphModule) -> Liveness:
    """Live activation sets at every gap of the topological order (one sweep)."""
    body = body_nodes(gm)
    index = {n: i for i, n in enumerate(body)}
    L = len(body)
    last_use = {}
    for n in body:
        last = -1
        for u in n.users:
            last = max(last, L if u.op == "output" else index[u])
        last_use[n] = last
    # A value is live at p when it is made before p and its last reader is at or after p.
    starts = [[] for _ in range(L + 1)]
    for n in body:
        if last_use[n] > index[n]:
            starts[index[n] + 1].append(n)
    live, current = [], []
    for p in range(L + 1):
        current = [n for n in current if last_use[n] >= p] + starts[p]
        live.append(current)
    return Liveness(body, live, index)


def legal_cuts(gm: fx.GraphModule, lv: Liveness, bindings, within_blocks: bool = True) -> list[int]:
    """Positions where a stage may end: 0, L and the gaps whose live bytes are near the minimum;
    with within_blocks=False none inside a repeated block (Note [cuts between blocks])."""
    L = len(lv.body)
    # Never handed between stages: a value of data-dependent size (Note [data-dependent sizes]),
    # or a tuple of tensors (topk's (values, indices)): stages hand over tensors and their
    # gradients, and a tuple's tensors would reach the next stage without a way back for theirs.
    blocked = lv.blocked()
    nbytes = lv.node_bytes(bindings, [p for p in range(L + 1) if p not in blocked])
    live_bytes = [0 if p in blocked else sum(nbytes[n] for n in nodes) for p, nodes in enumerate(lv.live)]
    interior = [b for b in live_bytes[1:L] if b > 0]
    # The median is the model's: the split LM head adds many gaps carrying a few small vectors
    # (a classifier's head over 3 classes: tens of bytes), which would put every gap of the
    # model's body above the limit.
    body = [b for p, b in enumerate(live_bytes[1:L], start=1) if b > 0 and "rp_lm_head_part" not in lv.body[p].meta]
    interior = body or interior
    if not interior:
        return [0, L]
    limit = CUT_SLACK * sorted(interior)[len(interior) // 2]
    cuts = [p for p in range(1, L) if 0 < live_bytes[p] <= limit and len(lv.live[p]) <= MAX_LIVE
            and p not in blocked]
    if not within_blocks:
        inside = _inside_blocks(lv)
        cuts = [p for p in cuts if p not in inside]
    # Of two neighbouring cuts with only a free node (view, cast) between them keep the later:
    # the pieces between cuts stay few without losing any choice worth having.
    thinned = []
    for p in cuts:
        if thinned and thinned[-1] == p - 1 and _is_free(lv.body[p - 1], bindings):
            thinned[-1] = p
        else:
            thinned.append(p)
    return [0] + thinned + [L]


def _inside_blocks(lv: Liveness) -> set:
    """Positions with the same repeated block (a decoder layer) on both sides."""
    keys = block_keys(lv.body)
    return {p for p in range(1, len(lv.body))
            if keys[lv.body[p]] is not None and keys[lv.body[p - 1]] == keys[lv.body[p]]}


def _mutation_spans(lv: Liveness) -> set:
    """Positions that would separate an in-place update (`x[i] = v`, `x.add_(y)`) from the
    value it writes into, or from a value that value is a view of: the next stage would update
    its own copy, and the stages holding the other copy would never see the update."""
    blocked = set()
    for _, first, last in _write_spans(lv):
        blocked.update(range(first + 1, last + 1))
    return blocked


def placeholder_write_spans(lv: Liveness) -> dict:
    """{placeholder: [(the position of a write into it, of its last read after that write)]}
    for the writes with a read after them. A call input: each job is given it as the caller
    passed it and its stage writes a copy (Note [inputs written in place] in codegen.py), so the
    reads after the write share the writing stage (_mutation_spans blocks these spans)."""
    spans: dict = {}
    for value, q, last in _write_spans(lv):
        if value.op == "placeholder":
            spans.setdefault(value, []).append((q, last))
    return spans


def _write_spans(lv: Liveness):
    """(value, first, last) for every in-place write into a value or a value it is a view of:
    the body positions the write ties together, cuts first + 1 .. last. A body value: from its
    node to the write. A placeholder (never in the body): from the write to its last read after
    it, where one reads it later."""
    for q, node in enumerate(lv.body):
        for target in mutated_values(node):
            for alias in view_bases(target):
                i = lv.index.get(alias)
                if i is not None:
                    yield alias, i, q
                elif alias.op == "placeholder":
                    last = max((lv.index[u] for u in alias.users if lv.index.get(u, -1) > q), default=None)
                    if last is not None:
                        yield alias, q, last


# Note [a buffer updated in place stays in one stage]: every read of a buffer the graph
# updates in place (an EMA normaliser, spectral_norm's u; Plan.mutated_buffers) is in the stage
# that updates it. A forward job updates its device copy microbatch after microbatch and writes
# it back only when it ends (Note [buffers written back], runtime/job.py), so a stage reading it
# elsewhere would read the value before the step (or, on a CPU device, whatever the updating job
# had reached) instead of this microbatch's: a read two layers after the update had losses 0.056
# off eager's. A backward job's recompute starts from the value its microbatch started from
# (Note [buffer values a recompute starts from]), which only the updating stage records.
def buffer_spans(lv: Liveness) -> dict:
    """{buffer index: (first, last)}: the positions of the first and the last node reading or
    writing a buffer (or a view of it) that some node updates in place."""
    buffers, index = {}, {}
    for node in lv.body:
        for a in node.all_input_nodes:
            v = a.meta.get("example_value")
            if a.op == "placeholder" and a.meta.get("rp_kind") == "buffer" and isinstance(v, torch.Tensor):
                buffers[storage_key(v)], index[storage_key(v)] = [], a.meta.get("rp_index")
    if not buffers:
        return {}
    mutated = set()
    for q, node in enumerate(lv.body):
        values = [node, *node.all_input_nodes]
        keys = {storage_key(v) for v in (n.meta.get("example_value") for n in values) if isinstance(v, torch.Tensor)}
        for key in keys & buffers.keys():
            buffers[key].append(q)
        for target in mutated_values(node):
            v = target.meta.get("example_value")
            if isinstance(v, torch.Tensor) and storage_key(v) in buffers:
                mutated.add(storage_key(v))
    return {index[key]: (min(buffers[key]), max(buffers[key])) for key in mutated}


def _buffer_spans(lv: Liveness) -> set:
    return {p for first, last in buffer_spans(lv).values() for p in range(first + 1, last + 1)}


def _functorch_regions(lv: Liveness) -> set:
    """Positions inside a torch.vmap (or jvp) region (Note [functorch regions])."""
    blocked, depth = set(), 0
    for p, node in enumerate(lv.body):
        if depth > 0:
            blocked.add(p)
        if node.op == "call_function" and node.target in FUNCTORCH_ENTER:
            depth += 1
        elif node.op == "call_function" and node.target in FUNCTORCH_LEAVE:
            depth = max(0, depth - 1)
    return blocked


def _grad_off_regions(lv: Liveness) -> set:
    """Positions inside a torch.no_grad() region of the forward (Note [grad-mode regions])."""
    return grad_off_positions(lv.body)


def _data_dependent(node: fx.Node) -> bool:
    """The node's value has a size that depends on the data (an unbacked symbol)."""
    return bool(free_unbacked_symbols(node.meta.get("example_value")))


def _tensor_tuple(node: fx.Node) -> bool:
    ev = node.meta.get("example_value")
    return not isinstance(ev, torch.Tensor) and any(isinstance(v, torch.Tensor)
                                                     for v in torch.utils._pytree.tree_leaves(ev))


def _of_a_parameter(node: fx.Node) -> bool:
    """Whether node's value is a parameter's, or rows of one (an LM head shard's weight): no
    activation. Each stage reads its parameters itself (uploaded, their gradients summed into
    the parameter's); handed over at a cut, a backward job that recomputes from the cut found
    no such value to start from (KeyError 'lm_head_weight_20': a 60-shard head's backward jobs
    cut between a shard's weight rows and its logits)."""
    base = view_bases(node)[-1]
    return "rp_param_slice" in base.meta or base.meta.get("rp_kind") == "param"


def view_bases(node: fx.Node) -> list:
    """node and the values it is a view of (through ops the cost pass marked as views)."""
    chain = [node]
    while True:
        cost = chain[-1].meta.get("rp_cost")
        srcs = [a for a in chain[-1].all_input_nodes if isinstance(a.meta.get("example_value"), torch.Tensor)]
        if cost is None or not cost.is_view or not srcs:
            return chain
        chain.append(srcs[0])


def _is_free(node: fx.Node, bindings) -> bool:
    cost: NodeCost = node.meta.get("rp_cost")
    return cost is None or (evaluate(cost.fwd_flops, bindings) == 0 and evaluate(cost.param_bytes, bindings) == 0)


def params_read(node: fx.Node) -> list:
    """(key, device bytes, elements, requires grad) of the parameters a node reads; a row slice
    of a parameter (rp_param_slice, the LM head's shards) counts its rows only."""
    if "rp_param_slice" in node.meta:
        name, _, start, stop = node.meta["rp_param_slice"]
        ev = node.meta["example_value"]
        return [((name, start, stop), ev.numel() * ev.element_size(), ev.numel(), ev.requires_grad)]
    out = []
    for a in node.all_input_nodes:
        if a.meta.get("rp_kind") == "param":
            ev = a.meta["example_value"]
            out.append((a.name, ev.numel() * ev.element_size(), ev.numel(), ev.requires_grad))
    return out


# Note [saved values once]: a backward stage holds what its ops saved for backward (S in the
# partition's memory model, passes/partition.py). Summing each op's saved bytes counts a value
# once per op that saves it: a norm's output read by the q, k and v projections three times,
# the MLP's input by gate and up twice. On a Qwen3-1.7B-shaped layer at 512 tokens that sum was
# 79.6 MiB against 55.3 MiB of storages eager autograd saves (+44%), about 3 GiB of a one-layer
# backward job's 12.95 GiB plan at 65,536 tokens (which measured 6.96). So the cost pass names
# the saved tensors that are values of the graph (NodeCost.saved_values: an op's inputs and
# outputs), and a segment counts each such value once, in the segment of its producer (its view
# base): additive over segments, as the partition DP needs. A job whose segments do not hold
# the producer has the value as an input, counted in its boundary bytes. A value made outside
# the body (a graph input) counts once in each segment that saves it.
def _saved_once(cost: NodeCost, bindings, by_name, index, cuts, kept_values, local) -> int:
    """Note [saved values once]: the bytes a node saves for backward that are its own (neither
    its inputs' nor its outputs' values), returned, and its saved values, each added once: into
    kept_values at the segment of the value's producer (its view base), or, for a value made
    outside the body (an input), into `local`, once per segment."""
    values = 0
    for (name, j), nbytes in cost.saved_values:
        b = int(evaluate(nbytes, bindings))
        values += b
        node = by_name.get(name)
        if node is None:
            local[(name, j)] = max(local.get((name, j), 0), b)
            continue
        base = view_bases(node)[-1]
        key = (base.name, j if base is node else 0)
        if base in index:
            seg = bisect.bisect_right(cuts, index[base]) - 1
            into = kept_values.setdefault(seg, {})
        else:
            into = local
        into[key] = max(into.get(key, 0), b)
    return int(evaluate(cost.saved_bytes, bindings)) - values


# Note [gradients added per microbatch]: a job with gradients adds each microbatch's into its fp32
# accumulator on the device (JobContext.accumulate_grads, runtime/job.py) after the microbatch's
# compute: it reads the gradient (the working dtype) and reads and writes the accumulator, about
# 10 B a bf16 parameter. The segments' backward seconds include it, so a finer split of the
# microbatches pays it once more per microbatch. Unpriced, Llama-3.1-8B's one-GPU plan within a
# 107 GiB host budget took 32 one-row microbatches (estimated 4.76 s a step) and ran 6.7-6.9 s:
# each microbatch's compute, 0.163 s, was followed by 33 ms of the device adding 8.0 B gradients
# (benchmarks/runs/host_room/, 62nd session). Priced, that plan is estimated 5.61 s and still
# taken; the rest is the one-row products' lower efficiency (0.163 s against 0.149 s estimated)
# and the first microbatch waiting 0.42 s for the weights. The bar's plans (Qwen3-1.7B and
# Llama-3.1-8B at 1, 2 and 4 H200s, planned on the CPU) are unchanged, estimated 2-9% longer.
# The trace shows the additions as "add_gradients" spans on the compute stream (before, outside
# any span, a device's compute busy missed them: 79% reported for that run).
def segment_table(gm: fx.GraphModule, lv: Liveness, cuts: list[int], bindings, hw: Hardware):
    """Segments between consecutive cuts with their times and bytes, and the live bytes at each cut."""
    segments = []
    # bytes of each node's value; views 0: they share their base's memory
    out = {n: 0 if n.meta.get("rp_cost") is None or n.meta["rp_cost"].is_view
           else int(evaluate(n.meta["rp_cost"].out_bytes, bindings)) for n in lv.body}
    by_name = {n.name: n for n in lv.body}
    kept_values: dict = {}        # segment index -> {saved value: bytes}, at its producer's segment
    saved_by_segment = []
    for a, b in zip(cuts, cuts[1:]):
        fwd = bwd = 0.0
        saved, local = 0, {}
        params = {}
        for n in lv.body[a:b]:
            cost = n.meta.get("rp_cost")
            if cost is not None:
                f, fb = node_seconds(cost, bindings, peak_flops=hw.peak_flops, mem_bw=hw.mem_bw)
                fwd, bwd = fwd + f, bwd + fb
                saved += _saved_once(cost, bindings, by_name, lv.index, cuts, kept_values, local)
            for key, nbytes, numel, grad in params_read(n):
                params[key] = (nbytes, numel, grad)
        saved_by_segment.append(saved + sum(local.values()))
        pbytes = sum(v[0] for v in params.values())
        gbytes = sum(4 * v[1] for v in params.values() if v[2])
        # Note [gradients added per microbatch]: the gradients read, the fp32 accumulator read and written
        bwd += (sum(v[0] for v in params.values() if v[2]) + 2 * gbytes) / hw.mem_bw
        # Note [working bytes]: the values made inside the segment that live at once in its forward
        work = max((out[lv.body[p]] + sum(out[m] for m in lv.live[p] if lv.index[m] >= a) for p in range(a, b)),
                   default=0)
        segments.append(Segment(fwd_s=fwd, bwd_s=bwd, param_bytes=pbytes, grad_bytes=gbytes, saved_bytes=0,
                                peak_bytes=max((out[n] for n in lv.body[a:b]), default=0), work_bytes=work))
    segments = [dataclasses.replace(seg, saved_bytes=saved_by_segment[s] + sum(kept_values.get(s, {}).values()))
                for s, seg in enumerate(segments)]
    nbytes = lv.node_bytes(bindings, cuts)
    cut_bytes = [sum(nbytes[n] for n in lv.live[p]) for p in cuts]
    return segments, cut_bytes
