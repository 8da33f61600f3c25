"""Runs compiled plans: splits a call into microbatches, runs the stage jobs, gathers results.

Works on flat call leaves (what dynamo hands a backend, or the pytree leaves of a
`rpcompile.compile` call), so both ways in share it.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from .capture import EMPTY_BATCH
from .errors import InputError, add_note
from .passes.graph_utils import retarget, scalar_outputs
from .passes.host_memory import host_grad_dtype
from .runtime.device import Pending, resolve
from .runtime.executor import Executor
from .runtime.processes import ProcessExecutor
from .runtime.grads import HostGrads
from .runtime.job import Microbatch, StepState
from .runtime.schedule import build_schedule
from .runtime.programs import ProgramCache
from .runtime import timeline
from .runtime.trace import Tracer
from .runtime.modes import ExactMode, mode_for, sum_param_grads
from .runtime.outputs import CallOutputs, concatenated, release as release_call_outputs
from .runtime.weights import HostWeights


def _counter_arg(plan, mbatch, node):
    """A loss counter's argument: a size, a call leaf, or a host weight (class weights)."""
    kind = node.meta.get("rp_kind")
    if kind == "sym":
        return mbatch.syms[node.name]
    if kind in ("param", "buffer"):
        host = plan.captured.params if kind == "param" else plan.captured.buffers
        return host[node.meta["rp_index"]].detach()
    return mbatch.leaves[node.meta["rp_index"]]


class GraphRunner:
    """Executes the plans of one compiled model on the devices of its Config."""

    def __init__(self, config):
        self.config = config
        if config.workers == "processes":
            self.executor = ProcessExecutor(config)
            self.host_placement = self.executor.memory    # Note [shared host memory]
        else:
            self.executor = Executor(config.devices, config.peer_transfers)
            self.host_placement = config.on_gpu            # pinned on GPUs
        self.programs = ProgramCache(config.compile_stages, config.on_gpu, config.inductor_options)
        self._counters: dict = {}
        self._finalizers: dict = {}      # id(plan) -> what lets go of the programs and counters kept for it
        self._warned_static = False
        self.host_weights = HostWeights(pin=self.host_placement)
        self._placed = weakref.WeakValueDictionary()     # id(plan) -> the plans host_weights.place has seen
        self.host_grads = HostGrads(pin=self.host_placement, drop=getattr(self.executor, "forget_shared", None))
        self.last_tracer = None
        self.recent_tracers: list = []   # the last steps' tracers (recent_traces)
        self.pending = None              # _PendingStep: a step whose backward jobs may still run
        self.mode = ExactMode()         # runtime/modes.py: what a step reads and what its gradients become
        # the share of an attached optimizer placed on the devices: what the plans reserve there;
        # None until the model's first plan chooses it (CompiledModel._compile; Note [optimizer
        # share by room] in passes/host_memory.py)
        self.optimizer_share = config.optimizer_on_devices
        self.share_of_a_call = False     # chosen by a forward call's plan: the first train plan chooses again
        self.host_share = 0.0            # the least of it the host's memory needs (Note [host room]): it stays
        self.num_microbatches = None     # what the first train plan splits a batch into (Note [finer microbatches])

    def prestart(self, modules=()) -> None:
        """Start what the first run needs while the call is captured and planned (worker
        processes, told the model's `modules`: Note [early workers] in runtime/processes.py)."""
        start = getattr(self.executor, "prestart", None)
        if start is not None:
            start(modules)

    def release_call_copies(self) -> None:
        """Let the HostWeights copies go (delayed mode's copies take over: Note [calls read the
        newest copies] in runtime/modes.py), and with worker processes the files they are in."""
        self.forget_shared(self.host_weights.release())

    def forget_shared(self, tensors) -> None:
        """With worker processes: host tensors let go, whose shared files the workers map."""
        forget = getattr(self.executor, "forget_shared", None)
        if forget is not None:
            forget(tensors)

    def release_call_buffers(self) -> None:
        """At a train step: what calls before it kept for the next call and nobody holds (their
        outputs' and gradient sets' memory: Notes [a call's outputs] and [call gradient sets]) goes;
        no plan counts it, so it is not kept into the training."""
        release_call_outputs()
        self.host_grads.calls.release()

    @property
    def overlapped(self):
        """The attached optimizer's thread (runtime.optimizer.OverlappedOptimizer), or None."""
        return self.mode.optimizer

    def attach(self, optimizer) -> None:
        """Overlapped and delayed modes: step `optimizer` (an OverlappedOptimizer) after each
        train_step; a newly attached one starts the delay again from the parameters as they are."""
        self.settle()
        self.mode.release(self)
        self.mode = mode_for(self.config, optimizer)
        if optimizer is not None:     # (worker processes' gradient files: Note [gradients page-locked in the main process])
            optimizer.stepper.page_lock = getattr(self.host_placement, "page_lock", None)

    # --- programs per device ---------------------------------------------------------------
    def program_for(self, plan, stage, role, device):
        self._kept_for(plan)
        return self.programs.get(id(plan), id(plan.captured), plan.captured.capture_device, stage, role, device)

    def _kept_for(self, plan) -> None:
        """What this runner keeps for `plan` by its id (programs, loss counters) goes when the
        plan dies, or earlier, when it is dropped with its capture (release_plans): a later plan
        may get its id (Note [captures kept] in plan_cache.py)."""
        if id(plan) not in self._finalizers:
            let_go = weakref.finalize(plan, _let_go, self.programs, self._counters, self._finalizers, id(plan),
                                      id(plan.captured))
            let_go.atexit = False       # (nothing to let go of at exit)
            self._finalizers[id(plan)] = let_go

    def release_plans(self, plans) -> None:
        """Let go of everything kept for `plans`, dropped with their capture (Note [captures
        kept]); their steps have ended (a new capture settles them first)."""
        for plan in plans:
            let_go = self._finalizers.get(id(plan))
            if let_go is not None:
                let_go()
            self.mode.forget_plan(plan)
        forget = getattr(self.executor, "forget_plans", None)     # worker processes' copies
        if forget is not None:
            forget(plans)

    @property
    def _programs(self) -> dict:
        return self.programs._programs

    # --- microbatches ----------------------------------------------------------------------
    def split(self, plan, leaves) -> list:
        """Per microbatch: the leaves (batched ones sliced on dim 0, every tensor contiguous) and
        the size symbols (Note [batched inputs])."""
        M = plan.num_microbatches
        batched = [i for i in sorted(plan.split_leaves) if isinstance(leaves[i], torch.Tensor)]
        leaves = [leaf.contiguous() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        if not batched:
            # (a graph with no batch, as longrope's frequency update, is not told; where the graph
            # fixed the batch, planning said why)
            if M > 1 and not self._warned_static and plan.batch.static:
                warnings.warn("rpcompile: the captured graph has a static batch size, so the batch is not split "
                              "into microbatches (num_microbatches=1 is used). Mark the batch dim dynamic "
                              "(torch.compile(..., dynamic=True) or torch._dynamo.mark_dynamic(x, 0)).")
                self._warned_static = True
            M, B = 1, None
        else:
            B = leaves[batched[0]].shape[0]
            if B == 0:
                raise InputError(EMPTY_BATCH)
            for i in batched:
                if leaves[i].shape[0] != B:
                    raise InputError(f"batched inputs disagree on the batch size: {B} vs {leaves[i].shape[0]} "
                                     f"(input leaf {i}); all batched inputs must have the same dim 0, or name the "
                                     "ones that are not batched in Config(unbatched_inputs=[...])")
            M = max(1, min(M, B))
        chunks = {i: torch.tensor_split(leaves[i], M) for i in batched}   # slices of contiguous leaves
        micro = []
        for m in range(M):
            mleaves = [chunks[i][m] if i in chunks else leaf for i, leaf in enumerate(leaves)]
            syms = {}
            for name, src in plan.sym_sources.items():
                syms[name] = (src if isinstance(src, int) else mleaves[src[0]] if src[1] is None
                              else mleaves[src[0]].shape[src[1]])
            rows = mleaves[batched[0]].shape[0] if batched else None
            micro.append(Microbatch(mleaves, syms, rows=rows))
        return micro

    def _counted(self, plan, counter, micro) -> float:
        """The counted targets of a loss counter over the whole batch (Note [whole-batch loss])."""
        c = self._counters.get((id(plan), id(counter)))
        if c is None:
            self._kept_for(plan)
            c = retarget(counter, {plan.captured.capture_device.type: torch.device("cpu")})
            self._counters[id(plan), id(counter)] = c
        names = [n for n in c.graph.nodes if n.op == "placeholder"]
        total = 0.0
        for mbatch in micro:
            try:
                total += float(c.forward(*[_counter_arg(plan, mbatch, n) for n in names]))
            except RuntimeError as e:   # a target out of bounds: said before any job runs
                raise InputError(str(e).strip()) from None
        return total

    def loss_weights(self, plan, micro) -> list:
        """d(batch loss)/d(microbatch loss output) per microbatch (Note [whole-batch loss]); each
        microbatch's scales of a loss's cross-entropy terms are set here too (Note
        [cross-entropy terms] in passes/normalize_loss.py)."""
        scale = plan.loss_scale
        if scale is not None and scale.kind == "sum":
            return [1.0] * len(micro)
        if scale is not None and scale.kind == "tokens":
            total = self._counted(plan, scale.counter, micro)
            return [1.0 / total if total else float("nan")] * len(micro)
        weights = self._row_weights(plan, micro)
        if scale is not None and scale.terms:
            totals = [1.0 if counter is None else self._counted(plan, counter, micro) for counter in scale.terms]
            totals = [t if f is None else float(f(torch.tensor(t, dtype=torch.float64)))
                      for t, f in zip(totals, scale.finishes or (None,) * len(totals))]
            for mbatch, w in zip(micro, weights):
                mbatch.scales = tuple(1.0 / (total * w) if total else float("nan") for total in totals)
        return weights

    @staticmethod
    def _rows(plan, mbatch) -> int:
        """Rows of a microbatch: dim 0 of its batched inputs (1 when nothing is split)."""
        return mbatch.leaves[min(plan.split_leaves)].shape[0] if plan.split_leaves else 1

    def _row_weights(self, plan, micro) -> list:
        """Each microbatch's share of the batch's rows: how a mean over rows combines."""
        sizes = [self._rows(plan, m) for m in micro]
        return [s / sum(sizes) for s in sizes]

    def _microbatch_weights(self, plan, micro, i, loss_weights) -> list:
        """The weight of each microbatch's value of output i, one that is not batch-first, in the
        call's value (Note [outputs over rows]): the loss by its weights, a sum over rows adds up,
        others are means over rows."""
        if plan.loss_scale is not None and plan.loss_scale.output == i:
            return loss_weights
        if plan.output_kinds.get(i) == "sum":
            return [1.0] * len(micro)
        return self._row_weights(plan, micro)

    def new_step(self, plan, micro, host_weights=None, gate=None, ready=None, shared_grads=True,
                 backward=True) -> StepState:
        """The state of one step; host_weights: where its weights are read (delayed mode's
        copies), else the live parameters through the runner's pinned copies; gate(p) waits
        for p's pending optimizer step, ready(p) says whether it has none (overlapped mode;
        a call in delayed mode reads the live parameters, so it waits for them too);
        shared_grads: download into the host gradient buffer kept across steps (False: a set
        of its own, Note [host gradient buffers]); backward=False: no backward job will run (a
        call without autograd), so no gradient set at all."""
        cap = plan.captured
        dtype = self.working_dtype(plan)
        if host_weights is None and gate is None:       # a call (Note [calls read the newest copies])
            host_weights = self.mode.call_weights(self, plan)
        if host_weights is None and self._placed.get(id(plan)) is not plan:
            self._placed[id(plan)] = plan
            self.host_weights.place(cap.params, dtype)      # (once a plan: 1.9 ms over 700 parameters)
        rng_base = 0
        if any(st.random for st in plan.stages):
            rng_base = int(torch.randint(0, 2**62, (), generator=torch.default_generator))
        if host_weights is None and gate is None and self.overlapped is not None:
            if self.overlapped.masters_away:      # kept on the devices (Note [masters kept on the devices])
                self.overlapped.synchronize()
            gate, ready = self.overlapped.wait_param, self.overlapped.is_ready
        layout = plan.host_memory.grad_layout
        if shared_grads and self.overlapped is not None and self.host_grads.switches(layout):
            # the plans share their gradient buffers (runtime/grads.py): another plan's step last
            # wrote this one, and the optimizer may still read its gradients
            self.overlapped.synchronize()
        if not backward:
            grads = None
        elif shared_grads:
            grads = self.host_grads.set_for(layout, self.grad_dtype(plan))
        else:
            grads = self.host_grads.fresh(layout)
        return StepState(plan, cap.params, cap.buffers, micro, rng_base=rng_base, dtype=dtype, grads=grads,
                         host_weights=host_weights or self.host_weights, gate=gate, ready=ready,
                         param_index={n: i for i, n in enumerate(cap.param_names)},
                         buffer_index={n: i for i, n in enumerate(cap.buffer_names)})

    def host_buffer_bytes(self) -> dict:
        """Bytes of the host buffers this runner holds across steps, by the kind `cm.plan` names
        them (passes/host_memory.py): working copies, gradient sets, carried gradient rows and the
        optimizer's widening buffer, each buffer once."""
        out: dict = {}
        seen = set()

        def add(kind, t):
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
        copies = getattr(self.mode, "copies", None)
        for t in (copies._flats if copies is not None else []):
            add("working copies", t)
        for entry in self.host_weights._copies.values():
            if entry[4] is None:    # (not a parameter that is its own copy: Note [frozen weights in place])
                add("working copies", entry[1])
        grads = self.host_grads
        add("gradients", grads.flat)
        for t in grads._sums.values():
            add("gradients", t)
        for t in getattr(self.mode, "carried", {}).values():
            add("gradient rows carried to a later chunk", t)
        if self.overlapped is not None:
            add("gradient slices widened for the optimizer", self.overlapped.stepper._wide)
        return out

    def working_dtype(self, plan):
        """The devices' dtype for weights and inputs (None: as they are, for graphs captured
        on real tensors by the dynamo backend)."""
        return self.config.compute_dtype if plan.captured.on_copies else None

    def grad_dtype(self, plan):
        """The dtype of the host gradient set a train step writes (the plan's: host_grad_dtype)."""
        return host_grad_dtype(self.working_dtype(plan), self.overlapped is not None)

    def pinned_refresh(self, dtype):
        """refresh(params) for the optimizer thread: their pinned working copies, rewritten
        after their step (one call for a chunk: Note [few calls per step])."""
        if not (self.config.on_gpu and dtype):
            return None
        return lambda params: self.host_weights.refresh_many(params, dtype, self.overlapped.stepper.copy_down)

    def run_jobs(self, plan, step, jobs, then=()):
        """Run [(job index, stage, role), ...] as a chain: its schedule is built first
        (runtime/schedule.py, continuing the rotation), then executed. `then`: the jobs a later
        run of the step will run (what they read goes to the host)."""
        self.issue_jobs(plan, step, jobs, then).wait()

    def issue_jobs(self, plan, step, jobs, then=()):
        """Hand the chain to the devices; the returned run waits for its jobs (or some)."""
        if step.tracer is None:
            # (worker processes trace their own devices: the main process touches no GPU)
            step.tracer = Tracer(self.config.devices if self.config.workers == "threads" else [])
        self.last_tracer = step.tracer
        self.recent_tracers = (self.recent_tracers + [step.tracer])[-3:]
        return self.executor.issue(step, self._schedule(plan, jobs, len(step.micro), then),
                                   lambda st, role, dev: self.program_for(plan, st, role, dev))

    def _schedule(self, plan, jobs, num_microbatches: int, then=()):
        """The schedule the next run of `jobs` gets (its first job on the executor's offset)."""
        return build_schedule(jobs, len(self.executor.workers), self.executor.offset, plan.replicas,
                              num_microbatches, then)

    def last_trace(self):
        """Spans of the last step (or call), with the device each job ran on."""
        self.settle()
        return None if self.last_tracer is None else self.last_tracer.spans()

    def recent_traces(self) -> list:
        """Spans of the last (up to) three steps on one clock (seconds from the first's start),
        each span with its "step" (0 = the oldest of them): overlapped steps share the devices
        (Note [overlapped steps]), so a device's busy time is read over them together; and the
        optimizer's spans on the devices since the first began (no "step": Note [optimizer spans])."""
        self.settle()
        if not self.recent_tracers:
            return []
        t0 = self.recent_tracers[0].t0
        out = []
        for k, tracer in enumerate(self.recent_tracers):
            for sp in tracer.spans():
                sp.update(step=k, start_s=sp["start_s"] + tracer.t0 - t0, end_s=sp["end_s"] + tracer.t0 - t0)
                out.append(sp)
        # the update's work on the devices beside them (Note [optimizer spans]), under the worker
        # whose device it is, from the first step's start on
        worker = {sp["device"]: sp.get("worker") for sp in out if sp.get("worker") is not None}
        for opt_t0, spans in getattr(self.overlapped, "device_spans", ()):
            for sp in spans:
                start, end = sp["start_s"] + opt_t0 - t0, sp["end_s"] + opt_t0 - t0
                if end >= 0:
                    out.append({**sp, "start_s": start, "end_s": end, "worker": worker.get(sp["device"], 0)})
        return sorted(out, key=lambda r: (r["start_s"], r["end_s"]))

    # --- train step ------------------------------------------------------------------------
    def train_step(self, plan, leaves, grad_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over all microbatches; gradients added into param.grad (exact
        mode) or handed to the attached optimizer. In delayed mode train_step returns once the
        loss is known, while the step's backward jobs still run (Note [overlapped steps])."""
        self.release_call_buffers()
        micro = self.split(plan, leaves)
        weights = self.loss_weights(plan, micro)
        for mbatch, w in zip(micro, weights):
            mbatch.seed = w * grad_scale
        overlap = self.mode.overlaps(plan)
        if self.pending is not None and not (overlap and self.pending.plan is plan):
            self.settle()
        jobs = [(k, st, st.kind) for k, st in enumerate(plan.stages)]
        warm = getattr(self.executor, "warm", None)
        if warm is not None:    # Note [first programs compiled beside the setup] (runtime/dry_run.py)
            # (the schedule and dtype made only where the workers start: warm does nothing after)
            warm(plan, lambda: (self._schedule(plan, jobs, len(micro)), self.working_dtype(plan)), micro)
        step = self.mode.start(self, plan, micro)
        if overlap:
            self._overlapped_step(plan, step, jobs)
        else:
            self._step(plan, step, jobs)
        loss_name = plan.graph_outputs[0]
        for m in micro:
            m.outputs = resolve(m.outputs)
        total = sum(w * m.outputs[loss_name].double() for w, m in zip(weights, micro))
        timeline.mark_early("step", "train_step returned")
        return total.to(micro[0].outputs[loss_name].dtype)

    def _step(self, plan, step, jobs):
        # Buffers the step updates in place (running statistics) are restored if it fails.
        saved = {i: plan.captured.buffers[i].clone() for i in plan.mutated_buffers}
        try:
            run = self.issue_jobs(plan, step, jobs)
            self.mode.issued(self, plan)
            run.wait()
        except BaseException:
            with torch.no_grad():
                for i, s in saved.items():
                    plan.captured.buffers[i].copy_(s)
            self.mode.abandon(step)
            raise
        finally:
            _drop_activations(step)
        self.mode.finish(self, plan, step, run)

    def _overlapped_step(self, plan, step, jobs):
        """Note [overlapped steps]: issue this step, end the one before (its backward jobs ran
        beside this step's first jobs), then wait for this step's forward jobs (the loss)."""
        try:
            run = self.issue_jobs(plan, step, jobs)
            self.mode.issued(self, plan)
        except BaseException:
            self.mode.abandon(step)
            self.settle()
            raise
        try:
            self.settle()
        except BaseException:      # the step before failed: this one read weights that assumed it
            _discard(run)
            _drop_activations(step)
            self.mode.abandon(step)
            raise
        try:
            run.wait([k for k, st, role in jobs if role != "bwd"])
        except BaseException:      # (the run has ended: a failure waits for all its jobs)
            _drop_activations(step)
            self.mode.abandon(step)
            raise
        self.pending = _PendingStep(plan, step, run)
        self.mode.submit_early(self, plan, step, run)

    def settle(self) -> None:
        """End the step whose backward jobs may still run (Note [overlapped steps]): wait for
        them and hand its gradients to the optimizer; raise its failure here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.run.wait()
        except BaseException as exc:
            note = self.mode.abandon(pending.step)
            if note:
                add_note(exc, note)     # (Note [notes on Python 3.10], errors.py)
            raise
        finally:
            _drop_activations(pending.step)
        self.mode.finish(self, pending.plan, pending.step, pending.run)

    # --- differentiable call ---------------------------------------------------------------
    def call(self, plan, leaves, ahead: bool = False) -> list:
        """The graph outputs of a call: through autograd when a gradient can flow, else plain;
        `ahead`: the loss's backward may run in the forward run (Note [the loss's backward ahead])."""
        self.settle()    # a call reads the parameters as the steps before it left them
        params = plan.captured.params
        tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if torch.is_grad_enabled() and (any(p.requires_grad for p in params)
                                        or any(t.requires_grad for t in tensor_leaves)):
            return list(PipelineCall.apply(self, plan, leaves, len(params), ahead, *params, *tensor_leaves))
        outputs, _ = self.call_forward(plan, leaves, keep_for_backward=False)
        return outputs

    def call_forward(self, plan, leaves, keep_for_backward: bool, ahead: bool = False):
        micro = self.split(plan, leaves)
        weights = self.loss_weights(plan, micro) if plan.loss_scale is not None else None
        # (a set of its own: autograd may keep what it is handed)
        step = self.new_step(plan, micro, shared_grads=False, backward=keep_for_backward)
        step.loss_ahead = _loss_job(plan, step.dtype) if keep_for_backward and ahead else None
        if step.loss_ahead is not None:     # seeded as a train step's (Note [the loss's backward ahead])
            for m, w in zip(micro, weights):
                m.seed = w
        if self.config.workers == "threads":     # (worker processes download into their slots)
            step.call_outputs = CallOutputs([self._rows(plan, m) for m in micro],
                                            [n for n, b in zip(plan.graph_outputs, plan.output_batched) if b],
                                            pin=self.config.on_gpu)
        jobs = [(k, st, "fused" if k == step.loss_ahead else "fwd") for k, st in enumerate(plan.stages)
                if st.kind != "bwd"]
        self.run_jobs(plan, step, jobs, then=_call_backward_jobs(plan, step.loss_ahead) if keep_for_backward else ())
        if step.grads is not None:     # (its backward may never come: the set may serve the next call)
            step.grads.settle(True)
        outputs = []
        for i, name in enumerate(plan.graph_outputs):
            outputs.append(self._gather_output(plan, step, i, name, weights))
        # The step lets go of what it returns: autograd gives the outputs a node whose context
        # holds the step, and a cycle through that node is one the collector cannot see (a call
        # never differentiated kept its step, activations and all, for good).
        step.call_outputs = None
        for m in step.micro:
            m.outputs.clear()
        step.loss_weights = weights
        return outputs, (step if keep_for_backward else None)

    def _gather_output(self, plan, step, i, name, weights):
        micro = step.micro
        batched = plan.output_batched[i]
        # (a batched output's parts are copied once, into its whole, before the step's slots go)
        vals = [v.landed() if batched and isinstance(v, Pending) else resolve(v)
                for v in (m.outputs.get(name) for m in micro)]
        if any(v is None for v in vals):
            node = next(n for n in plan.gm.graph.nodes if n.name == name)
            if node.op == "placeholder" and node.meta.get("rp_kind") == "input":
                vals = [m.leaves[node.meta["rp_index"]] for m in micro]
            else:
                raise RuntimeError(f"output {name} was not produced by any stage")
        if batched:
            whole = step.call_outputs and step.call_outputs.gather(name)
            return concatenated(vals) if whole is None else whole
        kind = plan.output_kinds.get(i)
        if kind in ("max", "min"):      # (each microbatch where it is reached shares the gradient)
            stacked = torch.stack(vals)
            whole = stacked.amax(0) if kind == "max" else stacked.amin(0)
            reached = (stacked == whole).to(stacked.dtype)
            step.output_shares[i] = list(reached / reached.sum(0))
            return whole
        if isinstance(vals[0], torch.Tensor) and (vals[0].dim() == 0 or kind is not None):
            w = self._microbatch_weights(plan, micro, i, weights)
            return sum(wi * v.double() for wi, v in zip(w, vals)).to(vals[0].dtype)
        return vals[0]

    def call_backward(self, plan, step, grads_of_outputs) -> tuple:
        """Seed the outputs' gradients per microbatch, run the backward jobs; returns
        (host grad per param index, host grad per input leaf index)."""
        micro = step.micro
        ahead, scale = step.loss_ahead, 1.0
        if ahead is not None:
            loss = plan.loss_scale.output
            g = grads_of_outputs[loss]
            if (isinstance(g, torch.Tensor) and g.dim() == 0
                    and all(x is None for i, x in enumerate(grads_of_outputs) if i != loss)):
                scale, grads_of_outputs = float(g), [None] * len(grads_of_outputs)
            else:
                # another gradient: the job runs again, as a backward job, from what autograd gave;
                # what it left for the next jobs is dropped (None: no gradient), its parameters'
                # gradients are written again
                for m in micro:
                    m.grads.update(dict.fromkeys(plan.stages[ahead].grad_inputs))
                ahead = None
        sizes = [self._rows(plan, m) for m in micro]
        for i, (name, g) in enumerate(zip(plan.graph_outputs, grads_of_outputs)):
            if g is None or name is None:
                continue
            if plan.output_batched[i]:      # (dim 0 is rows, or rows times a factor: Plan.output_batched)
                factor = g.shape[0] // sum(sizes)
                parts = torch.split(g, [s * factor for s in sizes], 0)
            elif i in step.output_shares:
                parts = [g * share.to(g.device) for share in step.output_shares[i]]
            elif g.dim() == 0 or i in plan.output_kinds:
                parts = [g * wi for wi in self._microbatch_weights(plan, micro, i, step.loss_weights)]
            else:
                parts = [g] + [None] * (len(micro) - 1)
            for m, part in zip(micro, parts):
                if part is not None:
                    m.grads[name] = part if m.grads.get(name) is None else m.grads[name] + part
        step.done_events.clear()
        kept = {ahead: step.param_grads[ahead]} if ahead in step.param_grads else {}
        step.param_grads.clear()
        step.param_grads.update(kept)
        step.grads.settle(False)
        jobs = _call_backward_jobs(plan, ahead)
        if jobs:
            self.run_jobs(plan, step, jobs)
        input_grads = {}
        for n in plan.gm.graph.nodes:
            if n.op == "placeholder" and n.meta.get("rp_kind") == "input":
                parts = [resolve(m.grads.get(n.name)) for m in micro]
                if all(p is not None for p in parts):
                    i = n.meta["rp_index"]
                    input_grads[i] = torch.cat(parts, 0) if i in plan.split_leaves else sum(parts)
        param_grads = sum_param_grads(step.param_grads, step.grads.row_sums)
        step.grads.settle(True)
        if scale != 1.0:      # (the step's own buffers: Note [host gradient buffers])
            torch._foreach_mul_(list(param_grads.values()), scale)
            input_grads = {i: g * scale for i, g in input_grads.items()}
        return param_grads, input_grads


def _let_go(programs, counters, finalizers, plan_key, capture_key) -> None:
    """A plan's finalizer (GraphRunner._kept_for): holds no runner, so keeps none alive."""
    programs.release(plan_key, capture_key)
    for key in [k for k in list(counters) if k[0] == plan_key]:
        counters.pop(key, None)
    finalizers.pop(plan_key, None)


def _call_backward_jobs(plan, ahead=None) -> list:
    """The jobs a differentiable call's backward runs (the forward's schedule counts their reads),
    but job `ahead`, whose backward ran in the forward run (Note [the loss's backward ahead])."""
    return [(k, st, "bwd") for k, st in enumerate(plan.stages) if st.kind != "fwd" and k != ahead]


# Note [the loss's backward ahead]: a differentiable call ran its fused job (the loss's stage)
# forward only, and `loss.backward()` ran it again, recompute and backward: the largest job of
# a one-device plan (all of a small model's) computed its forward twice and uploaded its weights
# twice, and `cm(...).loss.backward(); opt.step()`, what a PyTorch loop writes, trained slower
# than `cm.train_step` (CPU, one device, tiny model: 1.26x its seconds a step). Nearly always
# the loss alone is differentiated, its gradient a number g: 1, 1/accumulation steps, a
# GradScaler's scale. So a call in training mode (`model.training`, with autograd) runs that
# job as a train step's fused job, seeded as `train_step` seeds it (d loss / d its microbatch's
# loss), and keeps its parameters' gradients and the gradients it hands the backward jobs. A
# backward that brings only the loss's gradient runs the other backward jobs from them and
# multiplies the result by g (gradients are linear in the seed: exact for g = 1 and powers of
# two, a rounding apart otherwise). A backward that brings any other gradient (logits in a loss
# of one's own, a hidden state) drops what the job left for the next jobs and runs it again as
# a backward job, as before: the forward's backward was wasted, the result as eager's. Not
# where the devices compute in float16, whose gradients need the scale inside (GradScaler's
# reason to be): there a seed of 1 underflows what g would keep. A call in training mode that
# is never differentiated computes that job's backward for nothing: evaluate under
# torch.no_grad() (or model.eval()). In worker processes the job, the forward run's last, hands
# the backward run its gradients through the main process (Note [values a later run reads] in
# runtime/worker.py).
def _loss_job(plan, dtype):
    """The job of the fused stage that computes the loss, whose backward a call can run ahead
    (Note [the loss's backward ahead]), or None."""
    scale = plan.loss_scale
    if (scale is None or dtype == torch.float16 or not plan.output_differentiable[scale.output]
            or plan.output_kinds.get(scale.output) in ("max", "min") or scale.output not in scalar_outputs(plan.gm.graph)):
        return None
    name = plan.graph_outputs[scale.output]
    return next((k for k, st in enumerate(plan.stages) if st.kind == "fused" and name in st.grad_outputs), None)


class _PendingStep:
    def __init__(self, plan, step, run):
        self.plan, self.step, self.run = plan, step, run


def _drop_activations(step):
    """A step's activations are dead once its jobs ended: their pinned blocks go back to the
    caching host allocator now, for the next step, not when the optimizer is done with the
    step's gradients (on 4 GPUs the next step's downloads otherwise waited 100-300 ms each for
    fresh pinned memory while the optimizer ran)."""
    for m in step.micro:
        m.acts.clear()
        m.grads.clear()


def _discard(run):
    """Wait for every job of a run whose results are not wanted (its failure included)."""
    try:
        run.wait()
    except Exception:  # noqa: BLE001 - the caller raises the failure that made it unwanted
        pass


class PipelineCall(torch.autograd.Function):
    """Autograd view of a pipelined call: parameters and input tensors in, model outputs out."""

    @staticmethod
    def forward(ctx, runner, plan, leaves, n_params, ahead, *tensors):
        outputs, step = runner.call_forward(plan, leaves, keep_for_backward=True, ahead=ahead)
        ctx.runner, ctx.plan, ctx.step, ctx.n_params = runner, plan, step, n_params
        ctx.leaf_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        # (an output that needs no gradient, a buffer's value: given a grad_fn, a backward reaching
        # it again through a later call, as a buffer the forward assigns it to, met a spent step)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, plan.output_differentiable) if not d])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        pgrads, igrads = ctx.runner.call_backward(ctx.plan, ctx.step, list(grads))
        ctx.step = None
        params = ctx.plan.captured.params
        param_out = [pgrads[i].to(params[i].dtype) if i in pgrads else None for i in range(ctx.n_params)]
        leaf_out = [igrads.get(i) for i in ctx.leaf_positions]
        return (None, None, None, None, None, *param_out, *leaf_out)
