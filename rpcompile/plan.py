"""Plan: the compiled stages of one captured graph, with the numbers behind them."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx

from .passes.cost import evaluate


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
    sym_sources: dict = field(default_factory=dict)    # sym name -> (leaf index, dim) or int
    graph_outputs: list = field(default_factory=list)  # per graph output: node name or None
    output_batched: list = field(default_factory=list)  # per graph output: concatenated over microbatches
    lm_head: Any = None
    mutated_buffers: list = field(default_factory=list)  # buffer indices the graph updates in place
    batch: Any = None                                    # passes.batch.BatchInfo: what is split, by which symbols
    host_memory: Any = None                              # passes.host_memory.HostMemory

    @property
    def est_step_time(self) -> float:
        return self.stage_plan.est_time

    def param_numel(self, key) -> int:
        """Elements of parameter `key`, or of its rows when key is (index, start, stop)."""
        params = self.captured.params
        if isinstance(key, tuple):
            i, start, stop = key
            return (stop - start) * params[i][0].numel()
        return params[key].numel()

    def stage_rows(self):
        """One dict per stage job: what `print(plan)` shows and `plan.json` holds."""
        rows = []
        body = [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "output")]
        params = self.captured.params
        itemsize = {n.meta["rp_index"]: n.meta["example_value"].element_size() for n in self.gm.graph.nodes
                    if n.op == "placeholder" and n.meta.get("rp_kind") == "param"}
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
            shards = sorted({n.meta["rp_lm_head"]["k"] for n in nodes if isinstance(n.meta.get("rp_lm_head"), dict)})
            rows.append({
                "stage": st.index, "kind": st.kind, "positions": [a, b],
                "first": nodes[0].name if nodes else "", "last": nodes[-1].name if nodes else "",
                "nodes": len(nodes), "params": n_params, "param_bytes": pbytes,
                "flops_per_microbatch": flops, "est_time_s": t, "planned_memory": mem,
                "lm_head_shards": shards,
            })
        return rows

    def host_link_bytes(self, rows=None) -> dict:
        """Bytes a step moves over the host link for weights (up) and fp32 gradients (down)."""
        rows = rows or self.stage_rows()
        up = sum(r["param_bytes"] for r in rows)
        down = sum(4 * self.param_numel(key) for st in self.stages for key in st.grad_params)
        return {"weights_up": up, "grads_down": down}

    def __str__(self) -> str:
        rows = self.stage_rows()
        link = self.host_link_bytes(rows)
        head = (f"rpcompile plan ({self.mode}): {len(self.stages)} stage jobs on {self.num_devices} device(s), "
                f"{self.num_microbatches} microbatch(es), costed at {self.bindings or 'static shapes'}; "
                f"estimated step {self.est_step_time * 1e3:.2f} ms; memory budget "
                f"{_fmt_bytes(self.memory_budget) if self.memory_budget else 'unlimited'}; per step "
                f"{_fmt_bytes(link['weights_up'])} of weights up, {_fmt_bytes(link['grads_down'])} of gradients down")
        cols = ["stage", "kind", "nodes (first .. last)", "params", "param bytes", "FLOPs/mb", "est time", "memory"]
        lines = []
        for r in rows:
            rng = f"{r['positions'][0]}-{r['positions'][1]} ({r['first']} .. {r['last']})"
            if r["lm_head_shards"]:
                rng += f" [lm_head shards {','.join(map(str, r['lm_head_shards']))}]"
            lines.append([str(r["stage"]), r["kind"], rng, f"{r['params']:,}", _fmt_bytes(r["param_bytes"]),
                          _fmt_flops(r["flops_per_microbatch"]), f"{r['est_time_s'] * 1e3:.3f} ms",
                          _fmt_bytes(r["planned_memory"])])
        widths = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [head, fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*l) for l in lines]
        if self.host_memory is not None:
            out.append(self.host_memory.summary())
        return "\n".join(out)

    __repr__ = __str__

    def to_json(self) -> dict:
        rows = self.stage_rows()
        return {"mode": self.mode, "num_devices": self.num_devices, "num_microbatches": self.num_microbatches,
                "memory_budget": self.memory_budget, "bindings": {k: int(v) for k, v in self.bindings.items()},
                "est_step_time_s": self.est_step_time, "cuts": list(self.cuts),
                "param_names": list(self.captured.param_names), "host_link_bytes": self.host_link_bytes(rows),
                "host_memory": None if self.host_memory is None else dict(self.host_memory.rows()),
                "stages": rows}

    def dump(self, path: str) -> None:
        """Write plan.json and every stage's forward, backward and program graphs as .py files."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "plan.json"), "w") as f:
            json.dump(self.to_json(), f, indent=1)
        with open(os.path.join(path, "plan.txt"), "w") as f:
            f.write(str(self) + "\n")
        for st in self.stages:
            graphs = {"forward": st.forward, "backward": st.backward, **{f"program_{r}": g for r, g in st.programs.items()}}
            for name, g in graphs.items():
                if g is not None:
                    with open(os.path.join(path, f"stage{st.index:02d}_{st.kind}_{name}.py"), "w") as f:
                        f.write(g.print_readable(print_output=False))

