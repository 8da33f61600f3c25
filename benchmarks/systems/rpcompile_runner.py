"""rpcompile: weights, gradients and AdamW state on the host; stage jobs rotate over the GPUs.

    cm = rpcompile.compile(model, config=rpcompile.Config(devices=[...], num_microbatches=M,
                                                          dtype=torch.bfloat16))
    loss = cm.train_step(input_ids=ids, labels=ids); opt.step(); opt.zero_grad()

The host masters are the model's fp32 parameters; AdamW(fused=True) steps them on the CPU.
With `--option lora=R` the base is fp32 too; `--option lora_base=bf16` makes the frozen base bf16.
Options (harness --option KEY=VALUE, or a system of SYSTEMS that sets them) become Config fields:
  rpcompile_overlapped=1  Config(optimizer_mode="overlapped") and cm.attach_optimizer(opt):
                          rpcompile steps AdamW in a host thread beside the next step's jobs
                          (RoundPipe's step is asynchronous too); system "rpcompile-overlapped"
  rpcompile_delayed=1     Config(optimizer_mode="delayed"): like overlapped, but the next step
                          does not wait for the optimizer (one step of delay, as RoundPipe's
                          default asynchronous step); system "rpcompile-delayed"
  rpcompile_peer=1        Config(peer_transfers=True): boundary activations go device to device
                          where peer access exists; system "rpcompile-p2p"
  rpcompile_threads=1     Config(workers="threads"): one worker thread per device (the default on one
                          GPU; on several, processes are)
  rpcompile_processes=1   Config(workers="processes"): one worker process per device; system
                          "rpcompile-delayed-proc" (with rpcompile_delayed=1)
  rpcompile_data_parallel=1  Config(data_parallel=True): replicas, each device running the one-device
                          plan over its share of the microbatches; system "rpcompile-delayed-dp"
                          (with rpcompile_delayed=1 and rpcompile_threads=1: worker threads)
  rpcompile_pipeline=1    Config(data_parallel=False): the pipeline, never replicas; system
                          "rpcompile-delayed-pipe" (with rpcompile_delayed=1)
  rpcompile_worker_switch_ms=X  an instrument: worker processes' interpreter switch interval
  rpcompile_split_microbatches=0|1  Config(split_microbatches=False|True): never split the microbatches
                          finer, or into any count estimated faster (the default: on GPUs, into one fused job a device)
  rpcompile_max_jobs=J    Config(max_jobs=J): at most J stage jobs per step
  rpcompile_host_budget_gib=X  Config(host_memory_budget=X GiB): the host memory the first train plan may take
  rpcompile_inductor=JSON Config(inductor_options=JSON), e.g. '{"cpp_wrapper": true}'
  rpcompile_call=1        each step is the differentiable call, as a plain PyTorch loop trains:
                          `cm(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()`
                          (exact mode: the call has no attached optimizer); system "rpcompile-call"
  rpcompile_trace_dir=D   write the last step's spans (cm.last_trace) to D/<system>_<gpus>g.json
                          and as a Chrome trace beside it (.chrome.json), for where each device waits;
                          the last three steps on one clock (runner.recent_traces) to <...>.recent.json,
                          with the optimizer's work on the devices beside them (Note [optimizer spans])
With --device cpu the same runs on CPU "devices" (threads), for the tests.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from ..common import GiB, Trainer, adamw_kwargs, build_model, count_params, pinned_tensors, process_tree_memory


def _on(options: dict, key: str) -> bool:
    return str(options.get(key, "0")).strip().lower() in ("1", "true", "yes", "on")


def config_options(spec, config_cls) -> tuple:
    """(Config keyword arguments, notes) that spec.options ask for. A field is passed only when
    its option is given, so an rpcompile whose Config lacks it still runs the other systems; an
    option whose field is missing is an error that says so."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kwargs, notes = {}, []
    if _on(spec.options, "rpcompile_overlapped"):
        kwargs["optimizer_mode"] = "overlapped"
        notes.append("Config(optimizer_mode='overlapped')")
    if _on(spec.options, "rpcompile_delayed"):
        kwargs["optimizer_mode"] = "delayed"
        notes.append("Config(optimizer_mode='delayed'): gradients applied one step late, as RoundPipe's async step")
    def ask(option, field, value, note):
        if field not in fields:
            raise RuntimeError(f"--option {option} asks for Config({field}={value!r}), but this rpcompile's "
                               f"Config has no {field} field")
        kwargs[field] = value
        notes.append(note)
    if _on(spec.options, "rpcompile_peer"):
        ask("rpcompile_peer=1", "peer_transfers", True, "Config(peer_transfers=True)")
    if _on(spec.options, "rpcompile_processes"):
        ask("rpcompile_processes=1", "workers", "processes", "Config(workers='processes'): one worker process per device")
    if spec.options.get("rpcompile_optimizer_on_devices"):
        share = float(spec.options["rpcompile_optimizer_on_devices"])
        ask("rpcompile_optimizer_on_devices", "optimizer_on_devices", share,
            f"Config(optimizer_on_devices={share}): that share of the optimizer steps on the devices")
    if _on(spec.options, "rpcompile_threads"):
        kwargs["workers"] = "threads"
        notes.append("Config(workers='threads'): one worker thread per device")
    if _on(spec.options, "rpcompile_data_parallel"):
        ask("rpcompile_data_parallel=1", "data_parallel", True,
            "Config(data_parallel=True): a replica of the one-device plan per device")
    if _on(spec.options, "rpcompile_pipeline"):
        ask("rpcompile_pipeline=1", "data_parallel", False, "Config(data_parallel=False): the pipeline, never replicas")
    if spec.options.get("rpcompile_worker_switch_ms"):
        import os
        os.environ["RPCOMPILE_WORKER_SWITCH_MS"] = str(spec.options["rpcompile_worker_switch_ms"])
        notes.append(f"worker processes' switch interval {spec.options['rpcompile_worker_switch_ms']} ms")
    if spec.options.get("rpcompile_split_microbatches") in ("0", "1"):
        split = spec.options["rpcompile_split_microbatches"] == "1"
        ask("rpcompile_split_microbatches", "split_microbatches", split,
            f"Config(split_microbatches={split}): the first train plan splits finer {'where faster' if split else 'never'}")
    if spec.options.get("rpcompile_max_jobs"):
        kwargs["max_jobs"] = int(spec.options["rpcompile_max_jobs"])
        notes.append(f"Config(max_jobs={kwargs['max_jobs']})")
    if spec.options.get("rpcompile_memory_budget_gib"):
        kwargs["memory_budget"] = int(float(spec.options["rpcompile_memory_budget_gib"]) * GiB)
        notes.append(f"Config(memory_budget={spec.options['rpcompile_memory_budget_gib']} GiB)")
    if spec.options.get("rpcompile_host_budget_gib"):
        budget = int(float(spec.options["rpcompile_host_budget_gib"]) * GiB)
        ask("rpcompile_host_budget_gib", "host_memory_budget", budget,
            f"Config(host_memory_budget={spec.options['rpcompile_host_budget_gib']} GiB)")
    if spec.options.get("rpcompile_inductor"):
        import json
        kwargs["inductor_options"] = json.loads(spec.options["rpcompile_inductor"])
        notes.append(f"Config(inductor_options={kwargs['inductor_options']})")
    return kwargs, notes


class RPCompileTrainer(Trainer):
    def __init__(self, spec, rank=0, world=1):
        import rpcompile

        self._planning_error = rpcompile.PlanningError
        on_gpu = spec.device == "cuda"
        # `lora_base=bf16`: the frozen base in bf16 (a LoRA user's from_pretrained(dtype=torch.bfloat16)),
        # the adapters fp32 as get_peft_model leaves them; the base is its own working copy (Note
        # [frozen weights in place] in rpcompile/runtime/weights.py)
        bf16_base = bool(spec.lora) and spec.options.get("lora_base") == "bf16"
        self.model = build_model(spec.spec, dtype=torch.bfloat16 if bf16_base else torch.float32, device="cpu",
                                 init_device="cuda:0" if on_gpu else "cpu",
                                 max_positions=spec.max_positions, seed=spec.seed, lora=spec.lora)
        with torch.no_grad():
            for p in self.model.parameters() if bf16_base else ():
                if p.requires_grad:
                    p.data = p.data.float()
        self.n_params = count_params(self.model)
        devices = [f"cuda:{i}" for i in range(spec.gpus)] if on_gpu else ["cpu"] * spec.gpus
        extra = {}
        if spec.mode == "maxseq" and on_gpu:
            extra["memory_budget"] = int(spec.mem_cap_gib * GiB)    # plan for the capped card
        m = spec.microbatches if spec.mode != "maxseq" else 1
        options, self.notes = config_options(spec, rpcompile.Config)
        self.system, self.trace_dir = spec.system, spec.options.get("rpcompile_trace_dir")
        extra.update(options)
        # overlapped: rpcompile steps the optimizer itself in a host thread, beside the next step
        self.overlapped = extra.get("optimizer_mode") in ("overlapped", "delayed")
        self.call = _on(spec.options, "rpcompile_call")
        if self.call and self.overlapped:
            raise ValueError("--option rpcompile_call=1 trains through loss.backward() and the user's opt.step(): "
                             "exact mode only (drop rpcompile_overlapped / rpcompile_delayed)")
        self.config = rpcompile.Config(devices=devices, num_microbatches=m, dtype=torch.bfloat16, **extra)
        self.cm = rpcompile.compile(self.model, config=self.config)
        self.opt = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(spec), fused=True)
        if self.overlapped:
            self.cm.attach_optimizer(self.opt)
            # with a trace directory, the update's work on the devices too (Note [optimizer spans])
            self.cm.runner.overlapped.trace = bool(self.trace_dir)

    def step(self, ids):
        try:
            if self.call:
                loss = self.cm(input_ids=ids, labels=ids).loss
                loss.backward()
                loss = loss.detach()
            else:
                loss = self.cm.train_step(input_ids=ids, labels=ids)
        except self._planning_error as e:
            # no plan fits the memory budget: for the max-length search that is "out of memory"
            raise torch.OutOfMemoryError(f"rpcompile planning: out of memory budget: {e}") from e
        if not self.overlapped:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return float(loss)

    def finish(self):
        self.cm.synchronize()               # the overlapped optimizer's last step (no-op in exact mode)
        super().finish()

    def recover(self):
        if not self.overlapped:
            self.opt.zero_grad(set_to_none=True)

    def probe_info(self):
        """Plans and captures so far, and the seconds of first calls (compiles) so far."""
        from rpcompile.runtime.warmup import first_calls
        return {"plans": len(self.cm._plans.plans()), "captures": self.cm._plans.captures(),
                "first_call_s": round(sum(sec for _, sec in first_calls), 1)}

    def info(self):
        out = {"notes": list(self.notes),
               "config": {"devices": [str(d) for d in self.config.devices],
                          "num_microbatches": self.config.num_microbatches, "dtype": "bfloat16",
                          "memory_budget": self.config.memory_budget,
                          "optimizer_mode": self.config.optimizer_mode,
                          "peer_transfers": getattr(self.config, "peer_transfers", None)}}
        from rpcompile.runtime.warmup import first_calls
        by_device: dict = {}
        for device, sec in first_calls:       # first calls of stage programs (they compile), per device
            n, total = by_device.get(device, (0, 0.0))
            by_device[device] = (n + 1, total + sec)
        # where the first steps go (the bar's first-steps row): capture and passes per plan, compiles per device
        out["first_calls"] = {d: [n, round(sec, 2)] for d, (n, sec) in sorted(by_device.items())}
        # what each process finished when, in the first steps (Note [setup timeline])
        out["setup_timeline"] = self.cm.setup_timeline
        out["compile_seconds"] = [{k: round(v, 3) for k, v in p.compile_seconds.items()} for p in self.cm._plans.plans()]
        plan = self.cm.plan
        if plan is not None:
            rows = plan.stage_rows()
            out.update(plan=str(plan), stage_jobs=len(rows), plan_est_step_s=float(plan.est_step_time),
                       plan_microbatches=int(plan.num_microbatches),   # (Config.split_microbatches may split finer)
                       # the attached optimizer's share on the devices (Config.optimizer_on_devices, or the plan's)
                       optimizer_share=float(getattr(self.cm.runner, "optimizer_share", 0.0) or 0.0),
                       # the least of it the host's memory needed (Note [host room]): > 0, the host bound the plan
                       host_share_least=float(getattr(plan, "host_share", 0.0)),
                       plan_job_est_s=[float(r["est_time_s"]) for r in rows],
                       # each stage job uploads its weights once per step (DESIGN.md)
                       plan_weight_upload_bytes_per_step=int(sum(r["param_bytes"] for r in rows)),
                       # the plan's: the gradients of the parameters that train, in the host set's dtype
                       # (a LoRA model's adapters alone; before, every parameter's weight bytes)
                       plan_grad_download_bytes_per_step_est=int(plan.host_link_bytes(rows)["grads_down"]))
        out["host_memory_by_process"] = process_tree_memory()   # at the end: the steady state
        memory = getattr(self.cm.runner.executor, "memory", None)
        cuda = [d for d in self.config.devices if torch.device(d).type == "cuda"]
        if memory is None and cuda:   # worker threads: the caching allocators are this process's
            # retries (a cache flush and device sync before a cudaMalloc) and the cudaMalloc/cudaFree
            # counts say whether long jobs pay the allocator (RESULTS.md, sixteenth session)
            out["cuda_allocator"] = {str(d): {k: torch.cuda.memory_stats(d).get(k) for k in (
                "num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")} for d in cuda}
        if cuda:   # this process's pinned blocks of torch's caching host allocator (pin_memory=True):
            # the 1-GPU Llama run held 1.5 GiB of them in one run, 12.0 GiB in another (eighteenth session)
            stats = torch.cuda.host_memory_stats()
            out["cuda_host_allocator"] = {k: v for k, v in stats.items()
                                          if k.split(".")[0] in ("allocated_bytes", "reserved_bytes", "allocations",
                                                                 "num_host_alloc", "num_host_free")}
            out["pinned_tensors"] = pinned_tensors()
        peaks = getattr(self.cm.runner.executor, "worker_device_peaks", None)
        if peaks is not None:   # worker processes: their devices' peaks (this process's allocator saw none)
            out["peak_gpu_workers"] = peaks()
        pinned = getattr(self.cm.runner.executor, "worker_pinned", None)
        if pinned is not None:   # worker processes' caching host allocators (the 2-GPU run with the
            # optimizer on the devices had 5.4 GiB of CUDA host mappings in its workers: RESULTS.md, 21st session)
            out["cuda_host_allocator_workers"] = pinned()
        from rpcompile.runtime import host_buffers   # the runtime's own host buffers, by kind
        allocated, count = host_buffers.snapshot()
        out["host_buffers"] = {kind: [count[kind], allocated[kind]] for kind in sorted(allocated)}
        if host_buffers.register_failures:    # exact buffers the caching allocator pinned instead
            out["host_register_failures"] = dict(host_buffers.register_failures)
        if memory is not None:   # worker processes: the shared files, by the process that made them
            out["shared_files"] = shared_files(memory.directory)
            sets = self.cm.runner.executor.slot_sets     # Note [slot sets]: one per step alive at once
            free = sets.free_sets()
            out["slot_sets"] = {"made": sets.made, "free": len(free),
                                # per set: job -> [chunks, bytes], beside the plan's host act column
                                # (a copy of a job other than the first, Note [replicas]: "job.copy")
                                "jobs": [{(job if not copy else f"{job}.{copy}"): [len(refs), sum(r.shape[0] for r in refs)]
                                          for (_, job, copy), refs in sorted(s.items())} for s in free]}
        opt = self.cm.runner.overlapped
        if opt is not None and opt.timings:   # the host optimizer thread's seconds, median of the last steps
            out["optimizer_s"] = {k: statistics.median(t[k] for t in opt.timings[-8:]) for k in opt.timings[-1]}
        waits = getattr(self.cm.runner.mode, "start_waits", None)
        if waits:   # delayed mode: a step's start waiting for the optimizer step whose weights it reads
            out["optimizer_s"] = {**out.get("optimizer_s", {}), "start_wait_s": statistics.median(waits[-8:]),
                                  "start_wait_max_s": max(waits[-8:])}
        try:
            trace = getattr(self.cm, "last_trace", None)
        except Exception as e:  # noqa: BLE001 - optional figure
            trace, out["trace_error"] = None, f"{type(e).__name__}: {e}"
        if trace:
            out["trace"] = trace_summary(trace)
            recent = self.cm.runner.recent_traces()
            steady = steady_busy(recent) if recent else None
            if steady:   # overlapped steps (delayed mode) share the devices: busy over one period
                out["trace"]["steady"] = steady
            error = getattr(self.cm.runner.overlapped, "trace_error", None)
            if error:   # the optimizer's spans could not be read (Note [optimizer spans])
                out["optimizer_trace_error"] = error
            if self.trace_dir:
                stem = f"{self.system}_{len(self.config.devices)}g"
                out["trace_files"] = _write_trace(trace, self.trace_dir, stem)
                if recent:   # the last steps on one clock, each span with its "step": how steps overlap
                    out["trace_files"] += _write_trace(recent, self.trace_dir, f"{stem}.recent")
        return out


def _write_trace(spans, directory, stem) -> list:
    """The spans as JSON (for trace_hops.py) and as a Chrome trace, in directory."""
    import json
    import os

    from rpcompile.runtime.trace import write_chrome_trace

    os.makedirs(directory, exist_ok=True)
    spans_path, chrome_path = os.path.join(directory, f"{stem}.json"), os.path.join(directory, f"{stem}.chrome.json")
    with open(spans_path, "w") as f:
        json.dump(spans, f, default=str)
    write_chrome_trace(spans, chrome_path)
    return [spans_path, chrome_path]


def shared_files(directory: str) -> dict:
    """Bytes of the shared-memory files of a run (runtime/shared.py names each file
    `<pid>-<n>` after the process that made it): {"main" or "worker <pid>": {"files", "bytes",
    "resident_bytes"}}; the main process makes working copies and gradient buffers, a worker
    the chunks of the slot sets its jobs wrote (Note [slot sets] in runtime/shared.py)."""
    import os
    out: dict = {}
    main = str(os.getpid())
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        pid = name.split("-")[0]
        if not pid.isdigit():     # (the workers' sockets)
            continue
        row = out.setdefault("main" if pid == main else f"worker {pid}", {"files": 0, "bytes": 0, "resident_bytes": 0})
        row["files"] += 1
        row["bytes"] += st.st_size
        row["resident_bytes"] += st.st_blocks * 512
    return out


def steady_busy(spans) -> dict:
    """Busy share of each device over the last whole period of overlapped steps: from the start
    of the second-to-last step's first compute span to the start of the last step's (spans of
    runner.recent_traces(), which carry their "step"), counting every step's compute spans in
    that window; and each device's idle seconds between consecutive steps (what the 39th
    session's gaps.py printed). None with fewer than two steps."""
    keys = _device_keys(spans)
    extents = _step_extents(spans, keys)
    starts: dict = {}                  # step -> its first compute start on any device
    for per in extents.values():
        for k, (a, _) in per.items():
            starts[k] = min(starts.get(k, float("inf")), a)
    if len(starts) < 2:
        return None
    last = max(starts)
    lo, hi = starts[last - 1] if last - 1 in starts else None, starts[last]
    if lo is None or hi <= lo:
        return None
    per_dev: dict = {}
    for sp in spans:
        if sp.get("stream") == "compute":
            s, e = max(lo, float(sp["start_s"])), min(hi, float(sp["end_s"]))
            if e > s:
                per_dev.setdefault(keys[(sp.get("worker"), str(sp.get("device")))], []).append((s, e))
    return {"period_s": hi - lo,
            "compute_busy_frac": {d: _length(_union(iv)) / (hi - lo) for d, iv in sorted(per_dev.items())},
            # per device, from a step's last compute span on it to the next step's first
            "idle_between_steps_s": {d: [per[k + 1][0] - per[k][1] for k in sorted(per) if k + 1 in per]
                                     for d, per in sorted(extents.items())}}


def _step_extents(spans, keys) -> dict:
    """device -> step -> (its first compute start, its last compute end) on that device."""
    extents: dict = {}
    for sp in spans:
        if sp.get("stream") == "compute":
            per = extents.setdefault(keys[(sp.get("worker"), str(sp.get("device")))], {})
            a, b = per.get(sp.get("step", 0), (float("inf"), float("-inf")))
            per[sp.get("step", 0)] = (min(a, float(sp["start_s"])), max(b, float(sp["end_s"])))
    return extents


def trace_summary(spans) -> dict:
    """cm.last_trace (the executed schedule of the last step: span dicts with device, stream,
    name, start_s, end_s, and bytes on transfers) summed per stream and span name (busy seconds,
    counts, bytes) and, under "devices", per device:

      compute_busy_s / compute_busy_frac: union of the compute spans, and its share of the step
          (first span start to last span end over all devices);
      weights_in_s, weights_in_overlapped_s, weights_in_exposed_s: union of the weight uploads,
          split into the part that ran while compute was busy and the part it did not (exposed);
      bytes: total bytes per stream (weights_in, acts_in, out); the per-name totals above tell
          host uploads ("acts_in/fetch") from device-to-device copies ("acts_in/fetch_peer");
      compute_lag_s: over its compute spans on a GPU, the median seconds each start queued behind
          the device's earlier work ("start") and the device ran behind the host once the host
          had issued the span ("end"); both near zero: the launches set the pace (Note [issue
          lag] in rpcompile/runtime/trace.py);

and under "job_compute_s" each stage job's compute seconds (its microbatches summed).

    Only spans the runtime records are counted (a transfer that is not traced is not there)."""
    busy, count, nbytes = {}, {}, {}
    first, last = float("inf"), 0.0
    per_dev: dict = {}                 # device key -> stream -> [(start, end)]
    dev_bytes: dict = {}               # device key -> stream -> bytes
    lags: dict = {}                    # device key -> [(start lag, end lag)] of its issued compute spans
    keys = _device_keys(spans)
    for sp in spans:
        key = f"{sp.get('stream')}/{sp.get('name')}"
        start, end = float(sp.get("start_s", 0.0)), float(sp.get("end_s", 0.0))
        busy[key] = busy.get(key, 0.0) + max(0.0, end - start)
        count[key] = count.get(key, 0) + 1
        first, last = min(first, start), max(last, end)
        dev = keys[(sp.get("worker"), str(sp.get("device")))]
        per_dev.setdefault(dev, {}).setdefault(str(sp.get("stream")), []).append((start, end))
        if sp.get("stream") == "compute" and sp.get("issued_s") is not None and sp.get("issue_s") is not None:
            lags.setdefault(dev, []).append((start - sp["issued_s"], end - sp["issued_s"] - sp["issue_s"]))
        for k, v in sp.items():
            if "bytes" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                nbytes[key] = nbytes.get(key, 0) + v
                streams = dev_bytes.setdefault(dev, {})
                streams[str(sp.get("stream"))] = streams.get(str(sp.get("stream")), 0) + v
    step = max(0.0, last - first) if spans else 0.0
    out = {"spans": len(spans), "step_span_s": step, "busy_s": busy, "count": count}
    if nbytes:
        out["bytes"] = nbytes
    devices = {}
    for dev, streams in sorted(per_dev.items()):
        compute = _union(streams.get("compute", []))
        weights = _union(streams.get("weights_in", []))
        comp_s, w_s = _length(compute), _length(weights)
        overlap = _overlap(weights, compute)
        devices[dev] = {"compute_busy_s": comp_s, "compute_busy_frac": comp_s / step if step > 0 else None,
                        "weights_in_s": w_s, "weights_in_overlapped_s": overlap,
                        "weights_in_exposed_s": max(0.0, w_s - overlap), "bytes": dev_bytes.get(dev, {})}
        if dev in lags:
            devices[dev]["compute_lag_s"] = {"start": statistics.median(a for a, _ in lags[dev]),
                                             "end": statistics.median(b for _, b in lags[dev])}
    out["devices"] = devices
    jobs: dict = {}                    # job index -> compute seconds (all its microbatches)
    for sp in spans:
        if sp.get("stream") == "compute" and sp.get("job") is not None:
            j = str(sp["job"])
            jobs[j] = jobs.get(j, 0.0) + max(0.0, float(sp.get("end_s", 0.0)) - float(sp.get("start_s", 0.0)))
    if jobs:   # beside info.plan_job_est_s: how far the cost model is off, job by job
        out["job_compute_s"] = dict(sorted(jobs.items(), key=lambda kv: int(kv[0])))
    return out


def _device_keys(spans) -> dict:
    """(worker, device) -> the name a device goes by: the device string (cuda:0), or with the
    worker index where several workers share one (CPU "devices": 0:cpu, 1:cpu)."""
    pairs = sorted({(sp.get("worker"), str(sp.get("device"))) for sp in spans}, key=lambda p: (str(p[0]), p[1]))
    shared = {d for d in {p[1] for p in pairs} if sum(1 for p in pairs if p[1] == d) > 1}
    return {(w, d): f"{w}:{d}" if d in shared else d for w, d in pairs}


def _union(intervals) -> list:
    """Sorted, disjoint [start, end) intervals covering the same time as `intervals`."""
    out = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(merged) -> float:
    return sum(e - s for s, e in merged)


def _overlap(a, b) -> float:
    """Seconds two merged interval lists share."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def make_trainer(spec, rank=0, world=1):
    return RPCompileTrainer(spec, rank, world)
