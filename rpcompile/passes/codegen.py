"""Codegen: from a plan's node ranges to per-stage FX graphs.

Every stage job gets
- `forward`: its compute graph, from the values it reads to the values later jobs need;
- `backward` (fused and backward jobs): recompute + backward as an FX graph, the compute
  called as a submodule and differentiated with `torch.autograd.grad`;
- `program`: the job's per-microbatch program, whose nodes are the runtime's transfer and
  synchronisation ops (`rpcompile.runtime.ops`) around the compute graph. Printing it shows
  exactly what the job does, in order.

Note [RNG replay]: a backward job recomputes its forward, so random ops (dropout) must draw
the same numbers twice although forward and backward jobs are cut at different places. Each
stretch between two consecutive cut positions of any kind draws from its own stream: the
compute graphs reseed the device's generator with (step key, position) before the first
random node of each stretch, so the forward and the recompute see the same masks.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..runtime import ops as rp
from .cut_points import view_bases
from .graph_utils import graph_module, mutated_values, output_node

_RANDOM_FUNCTIONS = {
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.bernoulli, torch.multinomial, torch.normal, torch.randperm,
}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}


def is_random(node: fx.Node) -> bool:
    """True for nodes that draw random numbers (dropout, rand*, SDPA with dropout)."""
    if node.op == "call_function":
        if node.target in _RANDOM_FUNCTIONS:
            return True
        if node.target in (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention):
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            return not (isinstance(p, (int, float)) and p == 0.0)
    return node.op == "call_method" and node.target in _RANDOM_METHODS


def _requires_grad(node: fx.Node) -> bool:
    if "rp_requires_grad" in node.meta:
        return node.meta["rp_requires_grad"]
    ev = node.meta.get("example_value")
    return isinstance(ev, torch.Tensor) and ev.is_floating_point() and ev.requires_grad


@dataclass
class Stage:
    """One stage job of a step: its node range, what it reads and writes, and its graphs."""

    index: int
    kind: str                     # "fwd", "fused" or "bwd"
    span: tuple                   # (a, b): positions in the body order
    inputs: list                  # names of the values the compute reads, in placeholder order
    outputs: list                 # names of the values it hands on (fwd) / produces (fused)
    graph_outputs: dict           # output name -> indices among the model graph's outputs
    params: list                  # indices of the captured params it reads
    buffers: list                 # indices of the captured buffers it reads
    grad_outputs: list = field(default_factory=list)   # outputs that receive a gradient
    grad_inputs: list = field(default_factory=list)    # activation/input names that get one
    grad_params: list = field(default_factory=list)    # param indices that get one
    random: bool = False
    forward: Optional[fx.GraphModule] = None
    backward: Optional[fx.GraphModule] = None
    programs: dict = field(default_factory=dict)       # role -> program GraphModule
    forward_parts: list = field(default_factory=list)  # fwd jobs: [(graph, input names, output names, random)]
    kinds: dict = field(default_factory=dict)          # input name -> rp_kind or "act"
    input_leaf: dict = field(default_factory=dict)     # input name -> rp_index (params, buffers, call leaves)
    handed_on: set = field(default_factory=set)        # outputs later jobs read
    fqn: dict = field(default_factory=dict)            # param/buffer input name -> its name in the model
    param_slices: dict = field(default_factory=dict)   # input name -> (param index, first row, end row)
    tensors: set = field(default_factory=set)          # input/output names whose values are tensors
    row_checks: dict = field(default_factory=dict)     # name -> fn(rows, syms): dim 0 a microbatch's value must have
    shapes: dict = field(default_factory=dict)         # fetched act / grad name -> (sizes, dtype): value_shapes

    @property
    def program(self) -> fx.GraphModule:
        return self.programs[self.kind]


def _compute_graph(gm, body, a, b, inputs, outputs, rng_positions, name):
    """The compute of body[a:b] as a GraphModule; reseeds RNG per stretch (Note [RNG replay])."""
    g = fx.Graph()
    env = {}
    written = written_values(body[a:b])
    for n in inputs:
        p = g.placeholder(n.name)
        p.meta = dict(n.meta)
        env[n] = p
        if n in written and n.meta.get("rp_kind") == "input":    # Note [inputs written in place]
            env[n] = g.call_method("clone", (p,))
            env[n].meta = dict(n.meta)
    has_random = any(is_random(n) for n in body[a:b])
    key = g.placeholder("rng_key") if has_random else None
    seeded = set()
    for pos in range(a, b):
        n = body[pos]
        if n in env:   # a node the stage takes as an input instead (a parameter's rows)
            continue
        if is_random(n):
            stretch = max(r for r in rng_positions if r <= pos)
            if stretch not in seeded:
                g.call_function(rp.reseed, (key, stretch))
                seeded.add(stretch)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    g.lint()
    return graph_module(gm, g, name), has_random


def _backward_graph(forward: fx.GraphModule, inputs, outputs, grad_outputs, grad_inputs, params, has_random, name):
    """Recompute + backward: (inputs, grads of outputs) -> (outputs, input grads, param grads)."""
    g = fx.Graph()
    root = torch.nn.Module()
    root.compute = forward
    ph = {n.name: g.placeholder(n.name) for n in inputs}
    key = g.placeholder("rng_key") if has_random else None
    seeds = [g.placeholder(f"grad_{o}") for o in grad_outputs]
    args = []
    for n in inputs:
        if n.name in grad_inputs or n.name in params:
            ph[n.name] = g.call_function(rp.grad_leaf, (ph[n.name],))
        args.append(ph[n.name])
    if key is not None:
        args.append(key)
    # compute.forward(...), not self.compute(...): see ops.compute (no FX traceback on stderr)
    res = g.call_method("forward", (g.get_attr("compute"), *args))
    outs = {o: g.call_function(operator.getitem, (res, i)) for i, o in enumerate(outputs)}
    wrt = tuple(ph[x] for x in grad_inputs) + tuple(ph[p] for p in params)
    grads = g.call_function(rp.vjp, (tuple(outs[o] for o in grad_outputs), wrt, tuple(seeds)))
    g.output((tuple(outs[o] for o in outputs), grads))
    g.lint()
    return graph_module(root, g, name)


# Note [inputs written in place]: a stage may write into a call input it is handed (transformers
# 5.17's MoE loss: `loss += coef * aux_loss`, the cross-entropy computed in the graph before a
# break; `x.mul_(2)` on a batched input). Each stage writes into a copy it makes
# (_compute_graph), so that:
# - a backward job, which recomputes from a leaf of the value, does not write into the leaf ("a
#   leaf Variable that requires grad is being used in an in-place operation": a StageError);
# - a call input passed whole to every microbatch (that loss, 0-d) is not written once per
#   microbatch, each adding to the last's (a loss 0.034 off eager's at 2 microbatches);
# - on CPU devices, where a job is given the caller's tensor itself, the backward job's recompute
#   does not write it a second time (`x.mul_(2)` doubled it in the forward job and again in the
#   recompute: the first layer's weight gradient twice eager's, silently; the GPU's jobs each
#   upload a copy).
# So the caller's tensor is not written, on any device; reads of it after the write are kept in
# the writing stage (cut_points._mutation_spans), where they read the copy. Eager PyTorch writes
# the caller's tensor, so a model compiled by rpcompile.compile whose graph writes a call input
# says so at its plan (passes.capture: code after the call that reads the argument would read it
# unwritten). Through a dynamo backend such an input is mostly the model's own value passed
# between graphs at a break (that loss), which the graph returns as written: nothing is said.
def written_values(nodes) -> set:
    """The values `nodes` write into in place, directly or through views (each view's bases)."""
    return {base for node in nodes for value in mutated_values(node) if isinstance(value, fx.Node)
            for base in view_bases(value)}


def written_inputs(gm: fx.GraphModule) -> list:
    """The call inputs (placeholders of rp_kind "input") the graph writes into in place."""
    written = written_values(gm.graph.nodes)
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("rp_kind") == "input" and n in written]


def _stage_reads(nodes, inside):
    """Values a stage reads from outside, in first-use order. A parameter the stage reads only
    through row slices (the LM head's shards, `rp_param_slice`) is replaced by those slices, so
    the job uploads, and takes gradients of, just its rows. Returns (reads, {slice: key})."""
    reads = []
    for n in nodes:
        for x in n.all_input_nodes:
            if x not in inside and x not in reads:
                reads.append(x)
    sliced = {}
    for p in [x for x in reads if x.meta.get("rp_kind") == "param"]:
        users = [u for u in p.users if u in inside]
        if users and all(u.meta.get("rp_param_slice", (None,))[0] == p.name for u in users):
            at = reads.index(p)
            reads[at:at + 1] = users
            for u in users:
                _, _, start, stop = u.meta["rp_param_slice"]
                sliced[u] = (p.meta["rp_index"], start, stop)
                u.meta["rp_param_slice_fqn"] = p.meta["rp_name"]
    return reads, sliced


# Note [forward parts]: a forward job hands its checkpoints (the inputs of the backward jobs
# that start inside it) to the host. Computed as one graph, all of them were live on the device
# at its end: Llama-3.1-8B at 65,536 tokens, a 14-layer forward job held 14 x 512 MiB of
# checkpoints beside two jobs' weights and ran out of memory under 24 GiB where it was planned
# at 20.1 GiB. So a forward job's compute is cut at its checkpoints into parts, called one
# after another, each part's checkpoints going down while the next part computes; the device
# frees each once its copy is done. The cuts are RNG stretch boundaries (every backward job's
# start is one: Note [RNG replay]), so a part reseeds exactly where the whole graph would.
def _forward_parts(gm, body, bounds, reads, outputs, rng_positions, name) -> list:
    """[(graph, input names, output names, random)] of body[bounds[p]:bounds[p + 1]]: each part
    reads the job's inputs and earlier parts' values, and returns the job's outputs it makes
    and the values later parts read."""
    job_inputs = set(reads)
    spans = [body[s:e] for s, e in zip(bounds, bounds[1:])]
    part_of = {n: p for p, nodes in enumerate(spans) for n in nodes if n not in job_inputs}
    parts = []
    for p, nodes in enumerate(spans):
        ins = []
        for n in nodes:
            for x in ([n] if n in job_inputs else n.all_input_nodes):
                if part_of.get(x) != p and x not in ins:
                    ins.append(x)
        outs = [n for n in nodes if part_of.get(n) == p
                and (n in outputs or any(part_of.get(u, -1) > p for u in n.users))]
        graph, random = _compute_graph(gm, body, bounds[p], bounds[p + 1], ins, outs, rng_positions,
                                       f"{name}_forward{p}")
        parts.append((graph, [n.name for n in ins], [n.name for n in outs], random))
    return parts


def build_stages(gm: fx.GraphModule, lv, jobs: list) -> list:
    """Stage jobs with their forward and backward graphs, for jobs [(kind, (a, b)), ...] in positions."""
    body, live = lv.body, lv.live
    L = len(body)
    out_vals = list(torch.utils._pytree.tree_leaves(output_node(gm.graph).args[0]))
    graph_out = {}
    for i, v in enumerate(out_vals):
        if isinstance(v, fx.Node):
            graph_out.setdefault(v.name, []).append(i)
    checkpoints = sorted({a for kind, (a, _) in jobs if kind != "fwd"})
    sizes = size_symbols(gm)
    rng_positions = sorted({a for _, (a, _) in jobs})

    stages = []
    for k, (kind, (a, b)) in enumerate(jobs):
        nodes = body[a:b]
        inside = set(nodes)
        reads, sliced = _stage_reads(nodes, inside)
        if kind == "fwd":
            ends = [q for q in checkpoints if a < q <= b] + [b]
            outputs = []
            for q in ends:
                for n in live[q]:
                    if n in inside and n not in outputs:
                        outputs.append(n)
        else:
            outputs = [n for n in nodes if n.name in graph_out or (b < L and n in live[b])]
        name = f"Stage{k}_{kind}"
        forward, has_random = _compute_graph(gm, body, a, b, reads, outputs, rng_positions, f"{name}_forward")
        st = Stage(index=k, kind=kind, span=(a, b), inputs=[n.name for n in reads],
                   outputs=[n.name for n in outputs],
                   graph_outputs={n.name: graph_out[n.name] for n in outputs if n.name in graph_out},
                   params=[n.meta["rp_index"] for n in reads if n.meta.get("rp_kind") == "param"],
                   buffers=[n.meta["rp_index"] for n in reads if n.meta.get("rp_kind") == "buffer"],
                   random=has_random, forward=forward,
                   kinds={n.name: "param_slice" if n in sliced else n.meta.get("rp_kind", "act") for n in reads},
                   input_leaf={n.name: n.meta["rp_index"] for n in reads if "rp_index" in n.meta},
                   param_slices={n.name: sliced[n] for n in reads if n in sliced},
                   handed_on={n.name for n in outputs} if kind == "fwd" else set(),
                   tensors={n.name for n in reads + outputs if isinstance(n.meta.get("example_value"), torch.Tensor)},
                   fqn={**{n.name: n.meta["rp_name"] for n in reads if "rp_name" in n.meta},
                        **{n.name: n.meta["rp_param_slice_fqn"] for n in sliced}})
        if kind == "fwd":
            cuts = sorted({q for q in checkpoints if a < q < b})
            if cuts:
                st.forward_parts = _forward_parts(gm, body, [a, *cuts, b], reads, outputs, rng_positions, name)
        if kind != "fwd":
            st.grad_outputs = [n.name for n in outputs if _requires_grad(n)]
            # a parameter's row slice is no activation: its gradient goes to the job's parameter
            # gradients (grad_params), not to the host for a job that reads none
            st.grad_inputs = [n.name for n in reads if _requires_grad(n) and n.meta.get("rp_kind") in (None, "input")
                              and n not in sliced]
            grad_param_nodes = [n for n in reads if (n.meta.get("rp_kind") == "param" or n in sliced)
                                and _requires_grad(n)]
            st.grad_params = [sliced[n] if n in sliced else n.meta["rp_index"] for n in grad_param_nodes]
            st.backward = _backward_graph(forward, reads, st.outputs, st.grad_outputs, st.grad_inputs,
                                          [n.name for n in grad_param_nodes], has_random, f"{name}_backward")
        st.shapes = value_shapes([n for n in reads if st.kinds[n.name] == "act"]
                                 + [n for n in outputs if n.name in st.grad_outputs], sizes)
        stages.append(st)
    return stages


def value_shapes(nodes, sizes: dict) -> dict:
    """{name: (sizes, dtype)} of the tensor values of `nodes` whose sizes are ints or sympy
    expressions over the graph's size placeholders (renamed to them: `sizes` maps each size
    symbol to its placeholder's name), so a worker process can size stand-in values for a
    microbatch from its size values alone (Note [dry runs] in runtime/dry_run.py). A value sized
    by anything else (a data-dependent size) is left out."""
    import sympy
    out = {}
    for n in nodes:
        ev = n.meta.get("example_value")
        if not isinstance(ev, torch.Tensor):
            continue
        dims = []
        for d in ev.shape:
            if not isinstance(d, torch.SymInt):
                dims.append(int(d))
                continue
            expr = d.node.expr
            if not expr.free_symbols <= sizes.keys():
                break
            dims.append(expr.xreplace({s: sympy.Symbol(sizes[s], integer=True, positive=True)
                                       for s in expr.free_symbols}))
        else:
            out[n.name] = (tuple(dims), ev.dtype)
    return out


def size_symbols(gm: fx.GraphModule) -> dict:
    """{size symbol: name of the placeholder that carries it} of a captured graph."""
    return {n.meta["example_value"].node.expr: n.name for n in gm.graph.nodes
            if n.op == "placeholder" and n.meta.get("rp_kind") == "sym"
            and isinstance(n.meta.get("example_value"), torch.SymInt)}


def build_program(st: Stage, role: str, loss: Optional[str] = None) -> fx.GraphModule:
    """The per-microbatch program of a stage job in `role` ("fwd", "fused" or "bwd"): the
    transfer and event ops (Note [program ops]) around the compute call, in the order they run.
    A fused job seeds the gradient of output `loss` (a call's other outputs get none: Note [the
    loss's backward ahead] in runner.py)."""
    g = _ProgramGraph()
    root = torch.nn.Module()
    if not (role == "fwd" and st.forward_parts):
        root.forward_graph = st.forward
    if st.backward is not None:
        root.backward_graph = st.backward
    job, mb = g.placeholder("job"), g.placeholder("mb")

    def op(tensor_op, value_op, name, *args):
        return g.call_function(tensor_op if name in st.tensors else value_op, args)

    g.call_function(rp.wait, (job, mb))
    vals = {}
    for name in st.inputs:
        kind = st.kinds[name]
        if kind == "act":
            vals[name] = op(rp.fetch, rp.fetch_value, name, job, mb, name)
        elif kind == "input":
            vals[name] = op(rp.upload_input, rp.input_value, name, job, mb, st.input_leaf[name])
        elif kind == "sym":
            vals[name] = g.call_function(rp.sym, (job, mb, name))
        elif kind == "loss_scale":
            vals[name] = g.call_function(rp.loss_scale, (job, mb, st.input_leaf[name]))
        elif kind == "param":
            vals[name] = g.call_function(rp.upload_weight, (job, st.fqn[name]))
        elif kind == "param_slice":
            _, start, stop = st.param_slices[name]
            vals[name] = g.call_function(rp.upload_weight_rows, (job, st.fqn[name], start, stop))
        elif kind == "buffer":
            vals[name] = g.call_function(rp.upload_buffer, (job, st.fqn[name]))
    g.call_function(rp.prefetch_next, (job, mb))
    args = [vals[name] for name in st.inputs]
    if st.random:
        args.append(g.call_function(rp.rng_key, (job, mb)))
    if role == "fwd":
        for p, (graph, *_) in enumerate(st.forward_parts):    # Note [forward parts]
            setattr(root, f"forward_part{p}", graph)
        parts = ([(f"forward_part{p}", ins, outs, r) for p, (_, ins, outs, r) in enumerate(st.forward_parts)]
                 or [("forward_graph", st.inputs, st.outputs, st.random)])
        key = args[-1] if st.random else None
        for attr, ins, outs, random in parts:
            part_args = [vals[name] for name in ins] + ([key] if random else [])
            res = g.call_function(rp.compute, (job, mb, g.get_attr(attr), *part_args))
            for i, name in enumerate(outs):
                v = vals[name] = g.call_function(operator.getitem, (res, i))
                if name in st.graph_outputs:
                    op(rp.download_output, rp.output_value, name, job, mb, name, v)
                if name in st.handed_on:
                    op(rp.offload, rp.offload_value, name, job, mb, name, v)
    elif st.grad_outputs:
        if role == "fused":
            seeds = [g.call_function(rp.loss_seed, (job, mb)) if name == loss else None for name in st.grad_outputs]
        else:
            seeds = [g.call_function(rp.fetch_grad, (job, mb, name)) for name in st.grad_outputs]
        res = g.call_function(rp.compute, (job, mb, g.get_attr("backward_graph"), *args, *seeds))
        outs = g.call_function(operator.getitem, (res, 0))
        grads = g.call_function(operator.getitem, (res, 1))
        if role == "fused":
            for i, name in enumerate(st.outputs):
                if name in st.graph_outputs:
                    op(rp.download_output, rp.output_value, name, job, mb, name,
                       g.call_function(operator.getitem, (outs, i)))
        for j, name in enumerate(st.grad_inputs):
            g.call_function(rp.offload_grad, (job, mb, name, g.call_function(operator.getitem, (grads, j))))
        n_in = len(st.grad_inputs)
        pgrads = [g.call_function(operator.getitem, (grads, n_in + k)) for k in range(len(st.grad_params))]
        g.call_function(rp.accumulate_grads, (job, pgrads))
    g.call_function(rp.done, (job, mb))
    g.output(None)
    order_transfers(g)
    g.lint()
    return graph_module(root, g, f"Stage{st.index}_{role}_program")


class _ProgramGraph(fx.Graph):
    """Names a program's nodes after their ops (`fetch`, not `fetch_default`)."""

    def call_function(self, the_function, args=None, kwargs=None, type_expr=None, name=None):
        if name is None and isinstance(the_function, torch._ops.OpOverload):
            name = the_function._opname
        return self.create_node("call_function", the_function, args, kwargs, name=name, type_expr=type_expr)


_ACTIVATION_UPLOADS = {rp.fetch, rp.fetch_value, rp.upload_input, rp.input_value, rp.sym}
_WEIGHT_UPLOADS = {rp.upload_weight, rp.upload_weight_rows, rp.upload_buffer}


def order_transfers(g: fx.Graph) -> None:
    """Order a program's uploads: after the wait, activations first (they are on the critical
    path), then weights, then the prefetch of the next job's weights (queued behind this job's
    on the weights stream, so it is issued as early as double buffering allows)."""
    nodes = list(g.nodes)
    waited = next(n for n in nodes if n.target is rp.wait)
    acts = [n for n in nodes if n.target in _ACTIVATION_UPLOADS]
    weights = [n for n in nodes if n.target in _WEIGHT_UPLOADS]
    prefetch = [n for n in nodes if n.target is rp.prefetch_next]
    anchor = waited
    for n in acts + weights + prefetch:
        anchor.append(n)
        anchor = n
