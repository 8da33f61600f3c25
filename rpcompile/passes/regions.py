"""Regional compilation: a stage's compute graph as a chain of pieces cut at repeated blocks.

Why: Inductor compiles a stage of up to 28 decoder layers as one graph in minutes, and again
for every (stage, device) pair. Cut at the layer boundaries and named canonically, identical
layers become identical pieces: one compiled function serves all identical pieces of a
program, and Inductor's FX graph and AOTAutograd caches serve the other programs (PyTorch's
"compile the repeated block" recipe, found from the graph instead of named by the user). A
Qwen3-1.7B-shaped model on an H200: first step 99 s -> 49 s as one stage of all 28 layers,
126 s -> 84 s as 12 stage jobs on 2 GPUs; steady-state steps unchanged.

A node's block is the first index on its module path (`node.meta["nn_module_stack"]`, which
dynamo fills and the stage graphs keep; Note [module path] in graph_utils.py), e.g.
`model.layers.3`; only the container most nodes belong to counts, and runs shorter than
MIN_BLOCK_NODES do not (a ModuleList of single Linears is not worth cutting: it would only lose
fusion). Where the memory rule set the LM head's shard count (passes/lm_head.py), each shard is
a block of its own too: the shards exist to bound the logits live at once, and in one compiled
graph Inductor scheduled them together (Note [one piece per shard]). What lies between blocks
(embedding, masks, final norm, loss, a layer cut short by the stage) forms its own pieces. A
graph without blocks stays whole. Every piece is a contiguous run of the topological order, so
the pieces called in order compute the graph; the backward chains through each compiled piece's
autograd function like through any other op.

Pieces and sequence lengths (Note [dynamic lengths] in lengths.py): one plan serves every length,
so its programs and pieces do too, and the runner compiles each piece symbolic in the length
from its first call (Note [length-dynamic pieces] in runtime/programs.py). Not `dynamic=True`: a
piece's weights are plain inputs, so every weight dim would be symbolic too and Inductor would
lose its static-shape kernels in every steady step. A plan made anew for a longer length
(plan_cache.py) reuses the pieces its device has compiled: only pieces it has not seen compile.
"""
from __future__ import annotations

import operator
import re
from collections import Counter
from typing import Optional

import torch.fx as fx

from .graph_utils import graph_module, module_path

# A run of one block shorter than this is not cut out (a decoder layer has ~50-100 nodes).
MIN_BLOCK_NODES = 8
# A graph is cut only when some block piece occurs this many times in it. 1: a piece is reused
# across the stage programs of a device as well (the `shared` dict of compile_regions), and
# long-sequence plans are mostly one-layer jobs: Qwen3-1.7B at 65,536 tokens under 24 GiB has
# 27 one-layer backward jobs, each compiled whole (its own names, no cache hit) with 2, one
# layer piece with 1. (With 2, measured on CPU before pieces were shared across programs, a plan
# of 17 stages of one or two partial layers compiled 2.3x slower when cut.)
MIN_REPEATS = 1

# The root of a module path is a dynamo source, `L['model']` or `L['args'][0]`; after it, the
# first integer component is the block index: `layers.3`, `layers[3]`, `layers['3']`.
_ROOT = re.compile(r"""^[A-Za-z_]+\[[^\]]*\](?:\[[^\]]*\])*""")
_INDEX = re.compile(r"""(.*?)(?:\.(\d+)(?=[.\[]|$)|\[['"]?(\d+)['"]?\])""")


def block_of(node: fx.Node) -> Optional[tuple]:
    """(container path, index) of the repeated block the node was traced in, or None."""
    path = module_path(node)
    if path is None:
        return None
    root = _ROOT.match(path)
    m = _INDEX.match(path, root.end() if root else 0)
    if m is None:
        return None
    return path[:m.end(1)], int(m.group(2) or m.group(3))


SHARD = "rp_lm_head"     # the block key of an LM-head shard's nodes: (SHARD, k)

# Note [one piece per shard]: the LM head is split into vocabulary shards so that one shard's
# logits (and their gradient) are live at a time. Compiled as one graph, Inductor undid that: on
# CPU its output code for a fused job's backward computed the logit gradients of all 8 shards in
# one fused kernel with 8 logit-sized outputs, and on an H100 a forward job of 14 Qwen3-1.7B
# shards at 65,536 tokens peaked at 12.5 GiB against the 5.75 GiB of its graph run op by op
# (the fused job after it ran out of a 24 GiB budget planned at 23.8). As pieces of their own,
# the shards run one after the other, forward and backward, as the memory model counts them.
# The cost: shards differ in their constant bounds, so each compiles on its own, and each piece
# call has its own overhead (CPU, a tiny Qwen3 of 8 shards: first step 60.0 s against 49.5 s,
# steady 65 ms against 49 ms). So only where the memory rule (Note [shards by memory]) set the
# shard count, that is where the logits are large against the budget; where the FLOPs rule set
# it (the 2,048-token benchmarks) the shards stay in one graph.


def block_keys(body: list) -> dict:
    """{node: block_of(node)}, a getitem of a multi-output node keyed as that node (it stays
    with it: no tuple crosses a cut). The nodes of LM-head shard k are block (SHARD, k) where
    the memory rule set the shard count (Note [one piece per shard])."""
    keys = {}
    for n in body:
        src = n.args[0] if n.target is operator.getitem and n.args else None
        shard = n.meta.get("rp_lm_head")
        keys[n] = (keys[src] if isinstance(src, fx.Node) and src in keys
                   else (SHARD, shard["k"]) if shard and shard.get("apart") else block_of(n))
    return keys


def _runs(body: list, handed: set = frozenset()) -> list:
    """Contiguous runs of body as [(block key or None, nodes)], blocks of the main container only,
    a block's run cut after the last node in handed inside it (Note [pieces at handed-out values])."""
    keys = block_keys(body)
    counts = Counter(k[0] for k in keys.values() if k is not None and k[0] != SHARD)
    container = counts.most_common(1)[0][0] if counts else None
    runs = []
    for n in body:
        k = keys[n] if keys[n] is not None and keys[n][0] in (container, SHARD) else None
        if runs and runs[-1][0] == k:
            runs[-1][1].append(n)
        else:
            runs.append((k, [n]))
    runs = _cut_at_handouts(runs, handed)
    # Short runs (a block cut by a stage boundary into a sliver) join the nodes between blocks.
    merged = []
    for k, nodes in runs:
        k = k if len(nodes) >= MIN_BLOCK_NODES else None
        if merged and merged[-1][0] is None and k is None:
            merged[-1][1].extend(nodes)
        else:
            merged.append((k, list(nodes)))
    return merged


# Note [shard bounds as inputs]: LM-head shards differ only in their vocabulary rows: the row
# count of their weight slice, and constants in the comparisons and the offset of the labels
# (passes/lm_head.py marks those args `rp_shard_bound`). A shard piece takes those ints as
# inputs, and the runner passes them as dynamic ints and the slice's rows as a dynamic dim
# (runtime/programs.py, LengthDynamic), so one compiled piece serves every shard after the
# first, of every shard count: compiled apart, the 25 shards of Qwen3-1.7B at 65,536 tokens
# compiled each once for the forward and once for the training call, and again at every plan
# with another shard count. The first shard (no running max and sum to take) is a piece of its
# own, its end an input as well: with its end a constant, every plan at a new length that
# changed the shard count compiled it again (a 6-layer Qwen3 on CPU, 7 shards at 512 tokens,
# 13 at 1,024).


def _piece(gm: fx.GraphModule, nodes: list, reads: list, outputs: list, name: str) -> tuple:
    """(nodes as a GraphModule of reads -> outputs, with names that depend only on the ops
    (`in_0`, `linear_1`, ...), so identical blocks give identical code; the ints it takes after
    reads: shard bounds made inputs, Note [shard bounds as inputs])."""
    g = fx.Graph()
    env = {}
    for i, x in enumerate(reads):
        env[x] = g.placeholder(f"in_{i}")
        env[x].meta = dict(x.meta)
    ints, lifted = [], {}       # the lifted ints' values; node -> its arg made of their placeholders

    def lift(v: int) -> fx.Node:
        ints.append(v)
        ph = g.placeholder(f"in_{len(reads) + len(ints) - 1}")
        ph.meta["rp_dynamic_int"] = True
        return ph
    for n in nodes:
        i = n.meta.get("rp_shard_bound")
        v = n.args[i] if i is not None else None
        if isinstance(v, int):
            lifted[n] = lift(v)
        elif isinstance(v, slice):      # a weight slice read whole inside the piece
            lifted[n] = slice(lift(v.start), lift(v.stop), v.step)
    for x in reads:       # a shard's weight (bias) slice: its rows (a piece without the bounds too)
        if x.meta.get("rp_param_slice") is not None and (x.meta.get("rp_lm_head") or {}).get("apart"):
            env[x].meta["rp_dynamic_dims"] = [x.meta["rp_param_slice"][1]]
    for n in nodes:
        args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
        if n in lifted:
            i = n.meta["rp_shard_bound"]
            args = (*args[:i], lifted[n], *args[i + 1:])
        env[n] = g.create_node(n.op, n.target, args, kwargs, type_expr=n.type)
        env[n].meta = dict(n.meta)
        env[n].meta.pop("stack_trace", None)   # layer-independent code, without source comments
    g.output(tuple(env[o] for o in outputs))
    g.lint()
    return graph_module(gm, g, name), ints


# Note [pieces at handed-out values]: a piece returns the values used outside it, and which those
# are depends on the stage job around it: a forward job also hands out the values its backward
# jobs start from, which lie inside a layer wherever a backward job begins inside one. With
# one more output there, the same decoder layer was a different piece in each plan, and a plan
# made for a longer length compiled its layers again (12 of its 12 new pieces on CPU, a 6-layer
# Qwen3). So a block's run is cut after the last value the graph hands out from inside it: the
# two parts are pieces whose code depends only on that position in the layer (their outputs are
# the values crossing it), shared by every layer and plan cut there, and every other layer stays
# the plain layer. An earlier cure, returning from every layer each value live at any legal cut,
# made the layers identical too but held ~16 extra token-sized values at each layer's end: a
# forward job of Qwen3-1.7B at 65,536 tokens measured 7.2 GiB on an H100 against 3.3 before it
# and 4.2 planned. An LM-head shard is not cut: what a job hands out from inside it is its
# running max and sum, which every shard piece returns anyway (for the next shard); cut there,
# the shard at a job's end became two new pieces in every plan whose jobs end at another shard.


def _cut_at_handouts(runs: list, handed: set) -> list:
    """runs with each block run cut after its last node in handed (not its own last node); an
    LM-head shard's run is not cut (Note [pieces at handed-out values])."""
    out = []
    for k, nodes in runs:
        cut = k is not None and k[0] != SHARD
        last = max((i for i, n in enumerate(nodes[:-1]) if n in handed), default=None) if cut else None
        if last is None:
            out.append((k, nodes))
        else:
            out += [(k, nodes[:last + 1]), (k, nodes[last + 1:])]
    return out


def split_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """gm as a graph that calls its pieces `region0`, `region1`, ... (children) in order, with
    gm's signature and outputs; `meta["rp_regions"]` names them. gm itself, unchanged, when no
    block piece occurs MIN_REPEATS times."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    pieces = []
    for i, (block, nodes) in enumerate(_runs(body, set(out.all_input_nodes))):
        inside = set(nodes)
        reads = {}
        for n in nodes:
            for x in n.all_input_nodes:
                if x not in inside:
                    reads.setdefault(x)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        piece, ints = _piece(gm, nodes, list(reads), outputs, f"{type(gm).__name__}_region{i}")
        pieces.append((block, piece, list(reads) + ints, outputs))
    piece_keys = [piece_key(p) for _, p, _, _ in pieces]
    keys = Counter(key for (block, _, _, _), key in zip(pieces, piece_keys) if block is not None)
    if not any(count >= MIN_REPEATS for key, count in keys.items() if key is not None):
        return gm
    top = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = top.node_copy(n)
    names = []
    for i, (_, _, reads, outputs) in enumerate(pieces):
        call = top.call_module(f"region{i}", tuple(env[x] if isinstance(x, fx.Node) else x for x in reads))
        for j, o in enumerate(outputs):
            env[o] = top.create_node("call_function", operator.getitem, (call, j), name=o.name)
        names.append(f"region{i}")
    top.output(fx.map_arg(out.args[0], env.__getitem__))
    top.lint()
    split = graph_module({name: p for name, (_, p, _, _) in zip(names, pieces)}, top, type(gm).__name__)
    split.meta = dict(getattr(gm, "meta", {}))
    split.meta["rp_regions"] = names
    split.meta["rp_region_keys"] = piece_keys     # their piece_key, for compile_regions
    return split


def piece_key(piece: fx.GraphModule) -> Optional[tuple]:
    """Equal keys: the pieces compute the same function of their inputs (same code, same
    objects named by it). None for pieces that read attributes (their values may differ)."""
    if any(n.op in ("get_attr", "call_module") for n in piece.graph.nodes):
        return None
    code = piece.graph.python_code("self")
    return code.src, tuple(sorted((k, id(v)) for k, v in code.globals.items()))


def compile_regions(gm: fx.GraphModule, compile_fn, shared: dict):
    """gm with each piece compiled by compile_fn; pieces with equal keys (identical layers)
    share one compiled function, memoised in `shared` (pass one dict per program, so the
    forward and the recompute share too). Without repeated blocks: compile_fn(gm), memoised too."""
    split = split_regions(gm)
    if split is gm:   # one piece: shared as well (a forward job's parts, Note [forward parts], repeat)
        key = piece_key(gm)
        if key is None:
            return compile_fn(gm)
        if key not in shared:
            shared[key] = compile_fn(gm)
        return shared[key]
    for name, key in zip(split.meta["rp_regions"], split.meta["rp_region_keys"]):
        piece = getattr(split, name)
        key = key or id(piece)
        if key not in shared:
            shared[key] = compile_fn(piece)
        setattr(split, name, shared[key])
    return split
