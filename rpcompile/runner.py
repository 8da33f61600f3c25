"""Runs compiled plans: splits a call into microbatches, runs the stage jobs, gathers results.

Works on flat call leaves (what dynamo hands a backend, or the pytree leaves of a
`rpcompile.compile` call), so both ways in share it.
"""
from __future__ import annotations

import functools
import threading
import warnings

import torch

from .passes.graph_utils import retarget
from .passes.regions import compile_regions
from .runtime.device import resolve
from .runtime.executor import Executor
from .runtime.job import Microbatch, StepState
from .runtime.schedule import build_schedule
from .runtime.trace import Tracer
from .runtime.warmup import WarmupGuard
from .runtime.weights import DelayedWeights, HostWeights


class GraphRunner:
    """Executes the plans of one compiled model on the devices of its Config."""

    def __init__(self, config):
        self.config = config
        self.executor = Executor(config.devices, config.peer_transfers)
        self._programs: dict = {}
        self._counters: dict = {}
        self._warned_static = False
        self.host_weights = HostWeights()
        self.last_tracer = None
        self.overlapped = None          # runtime.optimizer.OverlappedOptimizer once attached
        self.delayed = None             # runtime.weights.DelayedWeights (delayed mode)
        self.delayed_steps = 0          # train steps since the optimizer was attached (delayed mode)
        self.next_prefetch = None       # (plan, device, key) of the next step's first upload
        # Overlapped mode: hand parameters to the optimizer while later jobs still run (_early_steps).
        # Off: its undo copies (12 bytes per parameter handed over early, taken every step) cost
        # more than the overlap gains: Qwen3-1.7B on 2 H200s, 34.2K tokens/s with it, 40.2K without.
        self.early_hand_over = False

    # --- programs per device ---------------------------------------------------------------
    def program_for(self, plan, stage, role, device):
        key = (id(plan), stage.index, role, device)
        prog = self._programs.get(key)
        if prog is None:
            src = plan.captured.capture_device
            prog = stage.programs[role]
            if src != device:
                prog = retarget(prog, {src.type: device})
            if self._use_inductor(stage):
                prog = self._compiled(prog, self.config.inductor_options)
            self._programs[key] = prog
        return prog

    def _use_inductor(self, stage) -> bool:
        on = self.config.compile_stages
        if on is None:
            on = self.config.on_gpu
        # Random stages stay eager: Inductor's own RNG would not replay our reseeded streams.
        return bool(on) and not stage.random

    @staticmethod
    def _compiled(prog, options=None):
        """The program with its compute graphs compiled by Inductor (AOTAutograd for backward),
        cut at repeated blocks such as decoder layers (passes/regions.py): identical layers of
        the program, forward and recompute alike, share one compiled piece."""
        prog = retarget(prog, {})   # a private copy whose children we may replace
        shared: dict = {}

        def inductor(gm):
            return torch.compile(gm, dynamic=None, options=options)

        if hasattr(prog, "forward_graph"):
            prog.forward_graph = WarmupGuard(compile_regions(prog.forward_graph, inductor, shared))
        if hasattr(prog, "backward_graph"):
            prog.backward_graph.compute = compile_regions(prog.backward_graph.compute, inductor, shared)
            prog.backward_graph = WarmupGuard(prog.backward_graph)
        return prog

    # --- microbatches ----------------------------------------------------------------------
    def split(self, plan, leaves) -> list:
        """Per microbatch: the leaves (batched ones sliced on dim 0) and the size symbols."""
        M = self.config.num_microbatches
        batched = [i for i in sorted(plan.split_leaves) if isinstance(leaves[i], torch.Tensor)]
        if not batched:
            if M > 1 and not self._warned_static:
                warnings.warn("rpcompile: the captured graph has a static batch size, so the batch is not split "
                              "into microbatches (num_microbatches=1 is used). Mark the batch dim dynamic "
                              "(torch.compile(..., dynamic=True) or torch._dynamo.mark_dynamic(x, 0)).")
                self._warned_static = True
            M = 1
        else:
            B = leaves[batched[0]].shape[0]
            for i in batched:
                if leaves[i].shape[0] != B:
                    raise ValueError(f"batched inputs disagree on the batch size: {B} vs {leaves[i].shape[0]} "
                                     f"(input leaf {i}); all batched inputs must have the same dim 0")
            M = max(1, min(M, B))
        chunks = {i: torch.tensor_split(leaves[i], M) for i in batched}
        micro = []
        for m in range(M):
            mleaves = [chunks[i][m] if i in chunks else leaf for i, leaf in enumerate(leaves)]
            syms = {}
            for name, src in plan.sym_sources.items():
                syms[name] = src if isinstance(src, int) else mleaves[src[0]].shape[src[1]]
            micro.append(Microbatch(mleaves, syms))
        return micro

    def _counter(self, plan):
        c = self._counters.get(id(plan))
        if c is None:
            c = retarget(plan.loss_scale.counter, {plan.captured.capture_device.type: torch.device("cpu")})
            self._counters[id(plan)] = c
        return c

    def loss_weights(self, plan, micro) -> list:
        """d(batch loss)/d(microbatch loss output) per microbatch (Note [whole-batch loss])."""
        scale = plan.loss_scale
        if scale is not None and scale.kind == "tokens":
            counter = self._counter(plan)
            names = [n for n in counter.graph.nodes if n.op == "placeholder"]
            counts = []
            for mbatch in micro:
                args = [mbatch.syms[n.name] if n.meta.get("rp_kind") == "sym" else mbatch.leaves[n.meta["rp_index"]]
                        for n in names]
                counts.append(int(counter(*args)))
            total = sum(counts)
            return [1.0 / total if total else float("nan")] * len(micro)
        return self._row_weights(plan, micro)

    @staticmethod
    def _rows(plan, mbatch) -> int:
        """Rows of a microbatch: dim 0 of its batched inputs (1 when nothing is split)."""
        return mbatch.leaves[min(plan.split_leaves)].shape[0] if plan.split_leaves else 1

    def _row_weights(self, plan, micro) -> list:
        """Each microbatch's share of the batch's rows: how a mean over rows combines."""
        sizes = [self._rows(plan, m) for m in micro]
        return [s / sum(sizes) for s in sizes]

    def _scalar_weights(self, plan, micro, i, loss_weights) -> list:
        """How scalar output i combines over microbatches: the loss by its weights, others by rows."""
        if plan.loss_scale is not None and plan.loss_scale.output == i:
            return loss_weights
        return self._row_weights(plan, micro)

    def new_step(self, plan, micro, host_weights=None) -> StepState:
        """The state of one step; host_weights: where its weights are read (delayed mode's
        copies), else the live parameters through the runner's pinned copies."""
        cap = plan.captured
        dtype = self._working_dtype(plan)
        rng_base = 0
        if any(st.random for st in plan.stages):
            rng_base = int(torch.randint(0, 2**62, (), generator=torch.default_generator))
        waits = self.overlapped is not None and host_weights is None
        return StepState(plan, cap.params, cap.buffers, micro, rng_base=rng_base, dtype=dtype,
                         host_weights=host_weights or self.host_weights,
                         gate=self.overlapped.wait_param if waits else None,
                         ready=self.overlapped.is_ready if waits else None,
                         param_index={n: i for i, n in enumerate(cap.param_names)},
                         buffer_index={n: i for i, n in enumerate(cap.buffer_names)})

    def _working_dtype(self, plan):
        """The devices' dtype for weights and inputs (None: as they are, for graphs captured
        on real tensors by the dynamo backend)."""
        return self.config.compute_dtype if plan.captured.capture_device.type == "meta" else None

    def _pinned_refresh(self, dtype):
        """refresh(p) for the optimizer thread: p's pinned working copy, rewritten after its step."""
        if not (self.config.on_gpu and dtype):
            return None
        return lambda p: self.host_weights.get(p, dtype)

    def _early_steps(self, plan, step, jobs) -> set:
        """Overlapped mode without clipping: hand a parameter to the optimizer as soon as the
        last job making its gradient has finished (Note [overlapped optimizer]); returns the
        set of parameter indices handed over, filled while the step runs."""
        producers: dict = {}
        for k, st, role in jobs:
            if role != "fwd":
                for key in st.grad_params:
                    producers.setdefault(_param_index(key), set()).add(k)
        params = plan.captured.params
        refresh = self._pinned_refresh(step.dtype)
        order = {i: n for n, i in enumerate(_use_order(plan))}
        handed: set = set()
        lock = threading.Lock()

        def on_job_done(job):
            if job == jobs[-1][0]:   # the last job's parameters go with the step's final submission
                return
            with lock:
                ready = []
                for i, waiting in producers.items():
                    if job in waiting:
                        waiting.discard(job)
                        if not waiting:
                            ready.append(i)
                handed.update(ready)
            if ready:
                ready.sort(key=order.get)
                self.overlapped.submit(
                    [(params[i], lambda i=i: self.param_grads(step, only={i})[i].to(params[i].dtype))
                     for i in ready], refresh, early=True)

        step.on_job_done = on_job_done
        return handed

    def _delayed_weights(self, plan) -> DelayedWeights:
        """The two copies of delayed mode, made from the parameters as they are when the first
        step (or a step with parameters the copies lack) starts."""
        params = plan.captured.params
        if self.delayed is None or not self.delayed.covers(params):
            self.overlapped.synchronize()
            self.delayed = DelayedWeights(params, self._working_dtype(plan), pin=self.config.on_gpu)
        return self.delayed

    def _upload_first_job(self, plan, t):
        """Delayed mode: step t's first job reads copy t % 2, final once optimizer step t - 2 is
        done, so its weights go up now (the uploader waits for that step), while the host ends
        step t - 1, rather than when step t starts."""
        dev = self.executor.next_device()
        params = [(i, plan.captured.params[i]) for i in plan.stages[0].params]
        opt, key = self.overlapped, ("next step", t)
        dev.prefetch(key, params, self._working_dtype(plan), self.delayed.view(t % 2),
                     before=lambda: opt.wait_completed(t - 1, raise_errors=False))
        self.next_prefetch = (plan, dev, key)

    def _adopt_first_upload(self, pending, plan, step, t):
        """Hand the upload _upload_first_job started to step t's first job, if it is the same job."""
        if pending is None:
            return
        was_plan, dev, key = pending
        future = dev.prefetched.pop(key, None)
        if future is not None and was_plan is plan and key == ("next step", t) and dev is self.executor.next_device():
            step.first_upload = (dev, future)

    def reset_delay(self):
        """A newly attached optimizer starts the delay again from the parameters as they are."""
        self.delayed, self.delayed_steps, self.next_prefetch = None, 0, None

    def run_jobs(self, plan, step, jobs):
        """Run [(job index, stage, role), ...] as a chain: its schedule is built first
        (runtime/schedule.py, continuing the rotation), then executed."""
        if step.tracer is None:
            step.tracer = Tracer(self.config.devices)
        self.last_tracer = step.tracer
        schedule = build_schedule(jobs, len(self.executor.workers), self.executor.offset)
        self.executor.run(step, schedule, lambda st, role, dev: self.program_for(plan, st, role, dev))

    def last_trace(self):
        """Spans of the last step (or call), with the device each job ran on."""
        return None if self.last_tracer is None else self.last_tracer.spans()

    @staticmethod
    def grad_indices(step, skip=()) -> set:
        """Indices of the parameters the step's jobs made gradients for (without waiting for them)."""
        return {_param_index(key) for grads in step.param_grads.values() for key in grads} - set(skip)

    @staticmethod
    def param_grads(step, only=None, skip=()) -> dict:
        """Host gradient per parameter index, summed over the jobs in job order (a job that
        took only rows of a parameter, keyed (index, start, stop), adds into those rows);
        only the indices in `only` (all if None), none of those in `skip`."""
        totals = {}
        for j in sorted(step.param_grads):
            for key, g in step.param_grads[j].items():
                index = _param_index(key)
                if (only is not None and index not in only) or index in skip:
                    continue
                g = resolve(g)
                if isinstance(key, tuple):
                    i, start, stop = key
                    if i not in totals:
                        totals[i] = torch.zeros(step.params[i].shape, dtype=g.dtype)
                    totals[i][start:stop] += g
                else:
                    totals[key] = g if key not in totals else totals[key] + g
        return totals

    # --- train step ------------------------------------------------------------------------
    def train_step(self, plan, leaves, grad_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over all microbatches; gradients added into param.grad."""
        micro = self.split(plan, leaves)
        weights = self.loss_weights(plan, micro)
        for mbatch, w in zip(micro, weights):
            mbatch.seed = w * grad_scale
        delayed = self.config.optimizer_mode == "delayed"
        if delayed:
            # Note [delayed optimizer]: step t reads copy t % 2, which optimizer step t - 2 wrote.
            t = self.delayed_steps
            first_upload, self.next_prefetch = self.next_prefetch, None
            self.overlapped.wait_completed(t - 1)
            step = self.new_step(plan, micro, host_weights=self._delayed_weights(plan).view(t % 2))
            self._adopt_first_upload(first_upload, plan, step, t)
        else:
            step = self.new_step(plan, micro)
        jobs = [(k, st, st.kind) for k, st in enumerate(plan.stages)]
        early = None
        if not delayed and self.early_hand_over and self.overlapped is not None and self.overlapped.splits_steps:
            early = self._early_steps(plan, step, jobs)
        # Buffers the step updates in place (running statistics) are restored if it fails.
        saved = {i: plan.captured.buffers[i].clone() for i in plan.mutated_buffers}
        try:
            self.run_jobs(plan, step, jobs)
        except BaseException:
            with torch.no_grad():
                for i, s in saved.items():
                    plan.captured.buffers[i].copy_(s)
            if early is not None:
                self.overlapped.rollback()
            raise
        finally:
            # on_job_done's submissions refer to the step: drop the cycle, or every step's host
            # gradients and activations live until the cyclic garbage collector runs.
            step.on_job_done = None
        if self.overlapped is not None:
            params = plan.captured.params
            order = _use_order(plan)
            have = self.grad_indices(step, skip=early or ())
            # The optimizer thread waits for the gradients' downloads, not this one: the next
            # step's jobs start while the last job's gradients are still coming down.
            grads = functools.cache(lambda: self.param_grads(step, skip=early or ()))
            others = ()
            if delayed:
                slot = self.delayed_steps % 2
                refresh = lambda p: self.delayed.write(p, slot)   # noqa: E731
                others = [p for i, p in enumerate(params) if i not in have and p.requires_grad]
                self.delayed_steps += 1
            else:
                refresh = self._pinned_refresh(step.dtype)
            self.overlapped.submit([(params[i], lambda i=i: grads()[i].to(params[i].dtype)) for i in order if i in have],
                                   refresh, others)
            if delayed:
                self._upload_first_job(plan, self.delayed_steps)
        else:
            grads = self.param_grads(step, skip=early or ())
            with torch.no_grad():
                for i, g in grads.items():
                    p = plan.captured.params[i]
                    g = g.to(p.dtype)
                    p.grad = g if p.grad is None else p.grad.add_(g)
        loss_name = plan.graph_outputs[0]
        for m in micro:
            m.outputs = resolve(m.outputs)
        total = sum(w * m.outputs[loss_name].double() for w, m in zip(weights, micro))
        return total.to(micro[0].outputs[loss_name].dtype)

    # --- differentiable call ---------------------------------------------------------------
    def call(self, plan, leaves) -> list:
        """The graph outputs of a call: through autograd when a gradient can flow, else plain."""
        params = plan.captured.params
        tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if torch.is_grad_enabled() and (any(p.requires_grad for p in params)
                                        or any(t.requires_grad for t in tensor_leaves)):
            return list(PipelineCall.apply(self, plan, leaves, len(params), *params, *tensor_leaves))
        outputs, _ = self.call_forward(plan, leaves, keep_for_backward=False)
        return outputs

    def call_forward(self, plan, leaves, keep_for_backward: bool):
        micro = self.split(plan, leaves)
        weights = self.loss_weights(plan, micro) if plan.loss_scale is not None else None
        step = self.new_step(plan, micro)
        jobs = [(k, st, "fwd") for k, st in enumerate(plan.stages) if st.kind != "bwd"]
        self.run_jobs(plan, step, jobs)
        outputs = []
        for i, name in enumerate(plan.graph_outputs):
            outputs.append(self._gather_output(plan, micro, i, name, weights))
        step.loss_weights = weights
        return outputs, (step if keep_for_backward else None)

    def _gather_output(self, plan, micro, i, name, weights):
        vals = [resolve(m.outputs.get(name)) for m in micro]
        if any(v is None for v in vals):
            node = next(n for n in plan.gm.graph.nodes if n.name == name)
            if node.op == "placeholder" and node.meta.get("rp_kind") == "input":
                vals = [m.leaves[node.meta["rp_index"]] for m in micro]
            else:
                raise RuntimeError(f"output {name} was not produced by any stage")
        if plan.output_batched[i]:
            return torch.cat(vals, 0)
        if isinstance(vals[0], torch.Tensor) and vals[0].dim() == 0:
            w = self._scalar_weights(plan, micro, i, weights)
            return sum(wi * v.double() for wi, v in zip(w, vals)).to(vals[0].dtype)
        return vals[0]

    def call_backward(self, plan, step, grads_of_outputs) -> tuple:
        """Seed the outputs' gradients per microbatch, run the backward jobs; returns
        (host grad per param index, host grad per input leaf index)."""
        micro = step.micro
        sizes = [self._rows(plan, m) for m in micro]
        for i, (name, g) in enumerate(zip(plan.graph_outputs, grads_of_outputs)):
            if g is None or name is None:
                continue
            if plan.output_batched[i]:
                parts = torch.split(g, sizes, 0)
            elif g.dim() == 0:
                parts = [g * wi for wi in self._scalar_weights(plan, micro, i, step.loss_weights)]
            else:
                parts = [g] + [None] * (len(micro) - 1)
            for m, part in zip(micro, parts):
                if part is not None:
                    m.grads[name] = part if name not in m.grads else m.grads[name] + part
        step.done_events.clear()
        step.param_grads.clear()
        jobs = [(k, st, "bwd") for k, st in enumerate(plan.stages) if st.kind != "fwd"]
        self.run_jobs(plan, step, jobs)
        input_grads = {}
        for n in plan.gm.graph.nodes:
            if n.op == "placeholder" and n.meta.get("rp_kind") == "input":
                parts = [resolve(m.grads.get(n.name)) for m in micro]
                if all(p is not None for p in parts):
                    i = n.meta["rp_index"]
                    input_grads[i] = torch.cat(parts, 0) if i in plan.split_leaves else sum(parts)
        return self.param_grads(step), input_grads


def _param_index(key) -> int:
    """The parameter a gradient key names: an index, or (index, start, stop) for rows of it."""
    return key[0] if isinstance(key, tuple) else key


def _use_order(plan) -> list:
    """Parameter indices in the order the forward reads them (stage order, then graph order)."""
    order, seen = [], set()
    for st in plan.stages:
        for i in list(st.params) + [key[0] for key in st.param_slices.values()]:
            if i not in seen:
                seen.add(i)
                order.append(i)
    return order


class PipelineCall(torch.autograd.Function):
    """Autograd view of a pipelined call: parameters and input tensors in, model outputs out."""

    @staticmethod
    def forward(ctx, runner, plan, leaves, n_params, *tensors):
        outputs, step = runner.call_forward(plan, leaves, keep_for_backward=True)
        ctx.runner, ctx.plan, ctx.step, ctx.n_params = runner, plan, step, n_params
        ctx.leaf_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        pgrads, igrads = ctx.runner.call_backward(ctx.plan, ctx.step, list(grads))
        ctx.step = None
        params = ctx.plan.captured.params
        param_out = [pgrads[i].to(params[i].dtype) if i in pgrads else None for i in range(ctx.n_params)]
        leaf_out = [igrads.get(i) for i in ctx.leaf_positions]
        return (None, None, None, None, *param_out, *leaf_out)
