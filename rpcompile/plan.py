"""Plan: the compiled stages of one captured graph, with the numbers behind them."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .passes.cost import _tensor_bytes, evaluate
from .passes.graph_utils import module_path
from .passes.host_memory import host_values


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _fmt_flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.3g}{unit}"
        n /= 1000


def _fmt_count(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000 or unit == "B":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000


def _fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


# A module path as dynamo records it in nn_module_stack: a root source (`L['model']`,
# `L['self']`, `L['args'][0]`), then attributes and indices (`.layers.3`, `.layers[3]`).
_ROOT = re.compile(r"""^[A-Za-z_]+\[[^\]]*\](?:\[[^\]]*\])*\.?""")
_INDEX = re.compile(r"""\[\s*['"]?([^\]'"]+)['"]?\s*\]""")


def _clean_path(path: str) -> str:
    """`L['args'][0]._modules['model']._modules['layers']._modules['3']` -> `model.layers.3`;
    `L['model'].__dict__['_modules']['base_model'].model` -> `base_model.model`."""
    path = _ROOT.sub("", path, count=1)
    path = re.sub(r"""(?:^|\.)__dict__\[['"]_(?:modules|parameters|buffers)['"]\]""", "", path)   # peft wrappers
    path = re.sub(r"(?:^|\.)_(?:modules|parameters|buffers)\[", "[", path)
    return ".".join(s for s in _INDEX.sub(r".\1", path).split(".") if s)


def _module_path(node) -> str:
    """The innermost module a node was traced in, as the model names it (`model.layers.3.mlp`)."""
    path = module_path(node)
    return "" if path is None else _clean_path(path)


class _ModuleNames:
    """Says which modules a run of graph nodes computes, in the model's own words:
    `model.embed_tokens, model.layers.0-6, model.layers.7 (self_attn)`, `lm_head shards 2-3/5`."""

    def __init__(self, body, param_names):
        names = [_clean_path(name) for name in param_names]
        self.owners = {name.rsplit(".", 1)[0] for name in names if "." in name}   # own parameters
        # a module reading a parameter it does not own (an LM head tied to the embedding) counts too
        self.owners.update(_module_path(n) for n in body if isinstance(n.meta.get("rp_lm_head"), dict)
                           or any(x.op == "placeholder" and x.meta.get("rp_kind") == "param"
                                  for x in n.all_input_nodes))
        self.owners.discard("")
        self.unit_of = {n: self._unit(_module_path(n)) for n in body}
        self.sizes: dict = {}
        for u in self.unit_of.values():
            if u is not None:
                self.sizes[u[:2]] = self.sizes.get(u[:2], 0) + 1

    def _unit(self, path):
        """(container, index, part) inside a numbered container, (path, None, None) for another
        module with parameters, None for glue (masks, position ids, the model's own code)."""
        segs = path.split(".") if path else []
        for i, seg in enumerate(segs):
            if seg.isdigit() and i > 0:
                return (".".join(segs[:i]), int(seg), segs[i + 1] if i + 1 < len(segs) else None)
        if path and path in self.owners:
            return (path, None, None)
        return None

    def describe(self, nodes, loss: bool = False) -> str:
        items: list = []    # [container, first, last, None] for whole blocks; [path, None, None, parts] else
        seen = {}
        for n in nodes:
            u = self.unit_of.get(n)
            if u is not None:
                entry = seen.setdefault(u[:2], {"count": 0, "parts": [], "order": len(seen)})
                entry["count"] += 1
                if u[2] is not None and u[2] not in entry["parts"]:
                    entry["parts"].append(u[2])
        for (path, index), e in sorted(seen.items(), key=lambda kv: kv[1]["order"]):
            whole = e["count"] >= self.sizes.get((path, index), 0)
            if index is None:
                items.append([path, None, None, None if whole else "part"])
            elif whole and items and items[-1][0] == path and items[-1][3] is None and items[-1][2] == index - 1:
                items[-1][2] = index
            elif whole:
                items.append([path, index, index, None])
            else:
                parts = e["parts"]
                part = parts[0] if len(parts) == 1 else f"{parts[0]}..{parts[-1]}" if parts else "part"
                items.append([f"{path}.{index}", None, None, part])
        heads = [n.meta["rp_lm_head"] for n in nodes if isinstance(n.meta.get("rp_lm_head"), dict)]
        out = []
        for path, first, last, part in items:
            text = path if first is None else f"{path}.{first}" if first == last else f"{path}.{first}-{last}"
            if heads and first is None and heads[0]["K"] > 1 and self._is_head(path, nodes):
                ks = sorted({h["k"] + 1 for h in heads})   # which of the head's K vocabulary shards
                K = heads[0]["K"]
                text += f" shard {ks[0]}/{K}" if len(ks) == 1 else f" shards {ks[0]}-{ks[-1]}/{K}"
            elif part is not None:
                text += f" ({part})"
            out.append(text)
        if loss:
            out.append("loss")
        if not out:   # only glue: name the graph nodes
            return f"{nodes[0].name} .. {nodes[-1].name}" if nodes else "(nothing)"
        return ", ".join(out)

    def _is_head(self, path, nodes) -> bool:
        return any(_module_path(n) == path for n in nodes if isinstance(n.meta.get("rp_lm_head"), dict))



def key_numel(shape, key) -> int:
    """Elements of a parameter of `shape`, or of its rows when key is (index, start, stop)."""
    if isinstance(key, tuple):
        _, start, stop = key
        return (stop - start) * math.prod(shape[1:])
    return math.prod(shape)

@dataclass
class Plan:
    """Stages of one captured graph for one mode ("train": loss only, "call": all outputs)."""

    mode: str
    gm: fx.GraphModule              # the graph after all passes
    captured: Any                   # capture.Captured
    stages: list                    # codegen.Stage, in execution order
    stage_plan: Any                 # partition.StagePlan (segment indices)
    cuts: list                      # legal cut positions (segment i = cuts[i]..cuts[i+1])
    bindings: dict                  # symbol name -> value the plan was costed at
    num_devices: int
    num_microbatches: int
    memory_budget: Optional[int]
    loss_scale: Any = None          # normalize_loss.LossScale (how microbatch losses combine)
    split_leaves: set = field(default_factory=set)     # call leaves split on dim 0
    sym_sources: dict = field(default_factory=dict)    # sym name -> (leaf index, dim), (leaf index, None): the leaf, or int
    graph_outputs: list = field(default_factory=list)  # per graph output: node name or None
    output_batched: list = field(default_factory=list)  # per graph output: concatenated over microbatches
                                                        # (dim 0 is its rows, not in blocks: BatchInfo.whole_rows, rows_in_blocks)
    output_kinds: dict = field(default_factory=dict)    # output index -> "sum", "mean", "max" or "min" over rows
                                                        # (Note [outputs over rows]; a 0-d output not here: a mean)
    output_differentiable: list = field(default_factory=list)   # per graph output: it requires grad where traced
    lm_head: Any = None
    mutated_buffers: list = field(default_factory=list)  # buffer indices the graph updates in place
    # of those, the ones a backward job's recompute reads (Note [buffer values a recompute starts from])
    buffers_at_start: list = field(default_factory=list)
    steps_overlap: bool = False                          # delayed mode's train steps may overlap (passes._steps_overlap)
    early_first_upload: bool = True                      # the next step's first job may go up at the loss (Note [resident weights])
    prefetch_bytes: tuple = ()                           # per job, the most bytes of the next job's weights it prefetches; () no limit
    optimizer_share: float = 0.0                         # the optimizer's share on the devices it planned beside (Note [optimizer share by room])
    optimizer_est_s: Optional[float] = None              # the update's estimated seconds a step, where the plan chose the share (Note [optimizer share by pace])
    replicas: int = 1                                    # copies of the stage jobs, one per device (Note [replicas])
    host_share: float = 0.0                              # the least optimizer share on the devices the host's memory needed (Note [host room])
    upload_wait_s: float = 0.0                           # a step's wait for weights beyond the jobs' times (Note [uploads behind the job before])
    finer: list = field(default_factory=list)            # (microbatches, est. step s, recomputes) weighed by the first train plan (Note [finer microbatches])
    batch: Any = None                                    # passes.batch.BatchInfo: what is split, by which symbols
    host_memory: Any = None                              # passes.host_memory.HostMemory
    device_budget: Optional[int] = None                  # each device's budget, the optimizer's share in it (Note [device budget measured once] in passes/budgets.py)
    passes: list = field(default_factory=list)           # (pass name, printer, text): the state after each pass (passes.PassTexts)
    served: list = field(default_factory=list)           # {symbol: size} of the non-batch sizes calls ran it at
    compile_seconds: dict = field(default_factory=dict)  # seconds: "dynamo_capture" (a capture's first plan) and each pass

    @property
    def est_step_time(self) -> float:
        return self.stage_plan.est_time

    def param_numel(self, key) -> int:
        """Elements of parameter `key`, or of its rows when key is (index, start, stop)."""
        return key_numel(self.captured.params[key[0] if isinstance(key, tuple) else key].shape, key)

    def _upload_wait(self) -> str:
        """What the jobs wait for their weights beyond their estimates (Note [uploads behind the job
        before] in passes/uploads.py), where they do."""
        return f" + {_fmt_seconds(self.upload_wait_s)} waiting for weights" if self.upload_wait_s > 0 else ""

    def _finer_line(self) -> list:
        """Where the first train plan split the batch finer than asked: a line saying so."""
        if not self.finer or self.finer[0][0] == self.num_microbatches:
            return []
        weighed = ", ".join(f"{m}: {_fmt_seconds(s)}" for m, s, _ in self.finer)
        again = next((a for m, _, a in self.finer if m == self.num_microbatches), False)
        return [f"  {self.num_microbatches} microbatches: Config.num_microbatches={self.finer[0][0]} split finer, where "
                f"the jobs recompute {'less' if again else 'nothing'} (estimated steps by microbatches {weighed}; "
                "Config(split_microbatches=False) keeps the count)"]

    def stage_rows(self):
        """One dict per stage job: what `print(plan)` shows and `plan.json` holds."""
        rows = []
        body = [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "output")]
        by_name = {n.name: n for n in self.gm.graph.nodes}
        params = self.captured.params
        itemsize = {n.meta["rp_index"]: n.meta["example_value"].element_size() for n in self.gm.graph.nodes
                    if n.op == "placeholder" and n.meta.get("rp_kind") == "param"}
        names = _ModuleNames(body, getattr(self.captured, "param_names", None) or [])
        loss_node = None   # the node computing the loss (train mode: the only output)
        if self.mode == "train" or self.loss_scale is not None:
            i = self.loss_scale.output if self.loss_scale is not None else 0
            loss_node = self.graph_outputs[i] if i < len(self.graph_outputs) else None
        for st, t, mem in zip(self.stages, self.stage_plan.job_times, self.stage_plan.job_memory):
            a, b = st.span
            nodes = body[a:b]
            fwd = sum(evaluate(n.meta["rp_cost"].fwd_flops, self.bindings) for n in nodes if "rp_cost" in n.meta)
            bwd = sum(evaluate(n.meta["rp_cost"].bwd_flops, self.bindings) for n in nodes if "rp_cost" in n.meta)
            flops = fwd if st.kind == "fwd" else fwd + bwd + (fwd if st.kind == "bwd" else 0.0)
            rows_of = [(key[0], self.param_numel(key)) for key in st.param_slices.values()]
            n_params = sum(params[i].numel() for i in st.params) + sum(n for _, n in rows_of)
            pbytes = (sum(params[i].numel() * itemsize[i] for i in st.params)
                      + sum(n * itemsize[i] for i, n in rows_of))
            heads = [n.meta["rp_lm_head"] for n in nodes if isinstance(n.meta.get("rp_lm_head"), dict)]
            shards = sorted({h["k"] for h in heads})
            # activations (fwd) or their gradients (fused, bwd) the job writes to host memory in
            # a step: every microbatch's, at the planned microbatch size
            host_act = self.num_microbatches * sum(self.value_bytes(by_name.get(x)) for x in host_values(st))
            rows.append({
                "stage": st.index, "kind": st.kind, "positions": [a, b],
                "first": nodes[0].name if nodes else "", "last": nodes[-1].name if nodes else "",
                "modules": names.describe(nodes, loss=loss_node is not None and loss_node in {n.name for n in nodes}),
                "nodes": len(nodes), "params": n_params, "param_bytes": pbytes,
                "grad_bytes": self._grad_itemsize() * sum(self.param_numel(key) for key in getattr(st, "grad_params", [])),
                "host_activation_bytes": int(host_act),
                "flops_per_microbatch": flops, "est_time_s": t, "planned_memory": mem,
                "lm_head_shards": shards, "lm_head_num_shards": heads[0]["K"] if heads else 0,
            })
        return rows

    def value_bytes(self, node, bindings=None) -> float:
        """Bytes of a graph value at the plan's bindings, or at `bindings` (0 for non-tensors or
        unbound sizes)."""
        ev = node.meta.get("example_value") if node is not None else None
        if not isinstance(ev, torch.Tensor):
            return 0.0
        try:
            return evaluate(_tensor_bytes(ev), self.bindings if bindings is None else bindings)
        except (ValueError, TypeError):
            return 0.0

    def host_link_bytes(self, rows=None) -> dict:
        """Bytes a step moves over the host link for weights (up) and gradients (down, in the
        host gradient set's dtype: Note [working-dtype gradients])."""
        rows = rows or self.stage_rows()
        up = self.replicas * sum(r["param_bytes"] for r in rows)    # (each copy uploads its weights)
        down = sum(self._grad_itemsize() * self.param_numel(key) for st in self.stages for key in st.grad_params)
        return {"weights_up": up, "grads_down": down}

    def symbol_legend(self) -> list:
        """(symbol, value costed at, what it is) for every size symbol the plan was costed at."""
        batch = {str(s) for s in self.batch.symbols} if self.batch is not None else set()
        out = []
        for name, value in sorted(self.bindings.items()):
            dims: dict = {}
            placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder" and n.meta.get("rp_kind") == "input"]
            for n in sorted(placeholders, key=lambda n: n.meta["rp_index"]):
                ev = n.meta.get("example_value")
                if not isinstance(ev, torch.Tensor):
                    continue
                for d, size in enumerate(ev.shape):
                    if isinstance(size, torch.SymInt) and str(size.node.expr) == name:
                        leaf = n.meta.get("rp_leaf_name", n.name)
                        dims.setdefault(d, []).append(leaf)
            where = "; ".join(f"dim {d} of {', '.join(v)}" for d, v in sorted(dims.items())) or "a size of the inputs"
            if name in batch:
                what = f"rows per microbatch ({where})"
            else:
                what = f"a dynamic size: {where}"
            out.append((name, int(value), what))
        return out

    def __str__(self) -> str:
        rows = self.stage_rows()
        link = self.host_link_bytes(rows)
        n_dev, M = self.num_devices, self.num_microbatches
        legend = self.symbol_legend()
        at = ", ".join(f"{s} = {v}" for s, v, _ in legend)
        masters = sum(p.numel() * p.element_size() for p in self.captured.params)
        if self.replicas > 1:
            share = math.ceil(M / self.replicas)
            how = (f"{len(rows)} stage job{'s' * (len(rows) != 1)} per step on each of {self.replicas} devices "
                   f"(replicas: a copy of the jobs each, over up to {share} of the {M} microbatches, the gradients "
                   "summed between the devices)")
        else:
            how = (f"{len(rows)} stage job{'s' * (len(rows) != 1)} per step, handed round-robin to {n_dev} "
                   f"device{'s' * (n_dev != 1)}; {M} microbatch{'es' * (M != 1)} per job")
        head = [
            f"rpcompile plan ({self.mode}): {how}" + (f" (costed at {at})" if at else ""),
            *self._finer_line(),
            f"  estimated step {_fmt_seconds(self.est_step_time)}{self._upload_wait()} (cost model{self._optimizer_beside()}); "
            "device memory budget "
            f"{_fmt_bytes(self.memory_budget) + ' per device' if self.memory_budget else 'unlimited'}",
            f"  host: {_fmt_bytes(masters)} of parameters (masters, {self._master_dtype()}); per step "
            f"{_fmt_bytes(link['weights_up'])} of weights go up to the devices and {_fmt_bytes(link['grads_down'])} "
            f"of {self.host_memory.grad_label if self.host_memory is not None else 'fp32'} gradients come down",
        ]
        cols = ["job", "kind", "modules", "params", "weights", "FLOPs/mb", "est time", "device mem", "host act"]
        lines = []
        for r in rows:
            lines.append([str(r["stage"]), r["kind"], r["modules"], _fmt_count(r["params"]), _fmt_bytes(r["param_bytes"]),
                          _fmt_flops(r["flops_per_microbatch"]), _fmt_seconds(r["est_time_s"]),
                          _fmt_bytes(r["planned_memory"]), _fmt_bytes(r["host_activation_bytes"])])
        widths = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = head + [fmt.format(*cols).rstrip(), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*l).rstrip() for l in lines]
        if self.host_memory is not None:
            out.append(self.host_memory.summary())
        out.append("legend:")
        out.append("  fwd: forward only (its input is kept on the host for the backward's recompute); fused: the last "
                   "stage, forward + loss + backward in one job; bwd: recompute + backward, in reverse order (cut "
                   "separately from the forward stages, so their module ranges differ)")
        if self.replicas > 1:
            out.append(f"  copy r of the jobs runs on device r over its share of the {M} microbatches, each job with "
                       "its weights uploaded once; est time: per copy")
        else:
            out.append(f"  job k of a step runs on device (offset + k) mod {n_dev}, the offset carrying over from step "
                       f"to step; each job runs {'its one microbatch' if M == 1 else f'all {M} microbatches'} with its "
                       "weights uploaded once")
        out.append("  weights: the job's parameter bytes uploaded per step; FLOPs/mb: per microbatch (G = 10^9); "
                   "device mem: planned peak on the device while the job runs; host act: activations (fwd) or "
                   "their gradients (fused, bwd) the job writes to host memory per step")
        for s, v, what in legend:
            ran = [d[s] for d in self.served if s in d]
            # one capture serves every length (Note [plans per length]): say which ones it ran at
            shown = ", ".join(map(str, ran[:8])) + (f", ... ({len(ran)} sizes)" if len(ran) > 8 else "")
            runs = f"; ran at {s} = {shown}" if ran and ran != [v] else ""
            out.append(f"  {s} = {what}; costed at {v}{runs}")
        return "\n".join(out)

    __repr__ = __str__

    def _grad_itemsize(self) -> int:
        return self.host_memory.grad_itemsize if self.host_memory is not None else 4

    def _optimizer_beside(self) -> str:
        """The optimizer's estimated update beside the step, where the plan chose its share."""
        if self.optimizer_est_s is None:
            return ""
        return (f"; the optimizer's update {_fmt_seconds(self.optimizer_est_s)} beside it, a share of "
                f"{self.optimizer_share:g} on the devices")

    def _master_dtype(self) -> str:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in self.captured.params})
        return ", ".join(dtypes) or "none"

    def to_json(self) -> dict:
        rows = self.stage_rows()
        return {"mode": self.mode, "num_devices": self.num_devices, "num_microbatches": self.num_microbatches,
                "memory_budget": self.memory_budget, "optimizer_share": self.optimizer_share,
                "optimizer_est_s": self.optimizer_est_s, "replicas": self.replicas,
                "bindings": {k: int(v) for k, v in self.bindings.items()},
                "symbols": {s: {"value": v, "meaning": what} for s, v, what in self.symbol_legend()},
                "est_step_time_s": self.est_step_time, "cuts": list(self.cuts),
                "param_names": list(self.captured.param_names), "host_link_bytes": self.host_link_bytes(rows),
                "host_memory": None if self.host_memory is None else dict(self.host_memory.rows()),
                "compile_seconds": dict(self.compile_seconds), "stages": rows}

    def dump(self, path: str) -> None:
        """Write plan.json and every stage's forward, backward and program graphs as .py files."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "plan.json"), "w") as f:
            json.dump(self.to_json(), f, indent=1)
        with open(os.path.join(path, "plan.txt"), "w") as f:
            f.write(str(self) + "\n")
        if self.passes:
            os.makedirs(os.path.join(path, "passes"), exist_ok=True)
            for i, (name, show, text) in enumerate(self.passes):
                ext = "py" if show in ("graph", "costs", "stages", "programs") else "txt"
                with open(os.path.join(path, "passes", f"{i:02d}_{name}.{ext}"), "w") as f:
                    f.write(text)
        for st in self.stages:
            graphs = {"forward": st.forward, "backward": st.backward, **{f"program_{r}": g for r, g in st.programs.items()}}
            for name, g in graphs.items():
                if g is not None:
                    with open(os.path.join(path, f"stage{st.index:02d}_{st.kind}_{name}.py"), "w") as f:
                        f.write(g.print_readable(print_output=False))

