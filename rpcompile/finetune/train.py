"""The fine-tuning loop: model + data -> compiled model -> steps -> checkpoints and plots."""
from __future__ import annotations

import math
import random
import sys
import time

import torch

from . import checkpoint, cli, data, models, plots, report
from .cli import PROG, Options
from .engine import DTYPES, compile_model, engine_errors
from .errors import RunError, UsageError
from .progress import Progress
from .tokenizer import load_tokenizer


def run(opts: Options) -> int:
    state = opts.resume_state
    tokenizer = load_tokenizer(opts.resume) if state else models.tokenizer_for(opts.model)
    docs = data.read_documents(opts.data)
    tokens = data.tokenize(docs, tokenizer, opts.seq_len)
    if len(tokens) < opts.batch_size:
        raise UsageError(f"--data {docs.source}: {report.plural(len(tokens), 'row')} of {opts.seq_len} tokens, "
                         f"fewer than --batch-size {opts.batch_size}; lower --batch-size or --seq-len")
    if state and tokens.fingerprint != state["run"]["data_fingerprint"]:
        raise UsageError(f"--resume {opts.resume}: the data ({docs.source}) is not what the checkpoint was "
                         f"trained on (its contents or tokenizer changed); put the original back, or "
                         f"{cli.fresh_run_hint(opts.resume, state['run'])}")

    model, origin = _load_model(opts)
    models.check_model_tokenizer(model, tokenizer, opts.model, opts.seq_len)
    model.config.use_cache = False  # no KV cache while training (checkpoint.py saves it as True)
    model.train()
    total, trainable = models.count_params(model)

    dtype = DTYPES[opts.dtype] if opts.dtype else None
    if checkpoint.is_peft(model) and opts.engine == "rpcompile":
        from rpcompile import Config
        models.base_in_working_dtype(model, Config(devices=opts.devices, dtype=dtype).compute_dtype)
    cm = compile_model(model, opts.engine, opts.devices, opts.microbatches, dtype, opts.optimizer)
    compiler_errors = engine_errors(opts.engine)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr)
    sampler = data.Sampler(len(tokens), opts.batch_size, opts.seed)
    losses: list[float] = []
    step = 0
    if state:
        opt.load_state_dict(state["optimizer"])
        for group in opt.param_groups:
            group["lr"] = opts.lr
        _set_rng_state(state["rng"])
        step, sampler.cursor, losses = state["step"], state["cursor"], list(state["losses"])
    stepped_by_rpcompile = opts.optimizer != "exact"   # overlapped / delayed: rpcompile steps AdamW
    if stepped_by_rpcompile:
        cm.attach_optimizer(opt)

    lora = f", LoRA rank {opts.lora}" if opts.lora else ""
    print(f"{PROG}: model {opts.model} ({type(_base(model)).__name__}, {total / 1e6:.2f}M params, "
          f"{trainable / 1e6:.2f}M trained{lora}; {origin})")
    print(f"  data: {tokens.description}; tokenizer: {tokenizer.name}")
    print(f"  devices: {', '.join(report.device_labels(opts.devices))}; batch {opts.batch_size} x {opts.seq_len} "
          f"tokens in {report.plural(opts.microbatches, 'microbatch', 'microbatches')}; "
          f"compute dtype {opts.dtype or 'default'}; AdamW lr {opts.lr:g}"
          f"{'' if opts.optimizer == 'exact' else f' ({opts.optimizer})'}; "
          f"steps {step + 1}..{opts.steps}" + (f" (resumed from {opts.resume})" if state else ""))
    _estimate_before_first_step(opts, model, opts.steps - step)
    print("  the first step captures and plans the model ...", flush=True)

    run_info = {"model": opts.model, "lora": opts.lora, "seed": opts.seed, "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "lr": opts.lr, "steps": opts.steps,
                "data": str(opts.data) if opts.data else None, "data_fingerprint": tokens.fingerprint,
                "data_file": docs.file_fingerprint}
    notes_shown: set[str] = set()
    saved_step = state["step"] if state else None
    # a LoRA adapter on a built-in shape's random weights: the base goes beside it (checkpoint.py)
    saves_base = bool(opts.lora) and models.is_known_name(opts.model)

    def say(line: str, file=None) -> None:
        if progress is not None and file is None:
            progress.write(line)
        else:
            print(line, file=file or sys.stdout, flush=True)

    saving = None   # the step being saved, while a save runs

    def save(step: int) -> None:
        nonlocal saved_step, saving
        saving = step
        if stepped_by_rpcompile:
            cm.synchronize()          # the optimizer's pending step, before reading its state
        if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
            # (the loss is finite until the step after the update that broke the weights)
            raise RunError(_diverged(step, None, opts, saved_step, stepped_by_rpcompile))
        notes: list[str] = []
        payload = {"step": step, "cursor": sampler.cursor, "losses": list(losses),
                   "optimizer": opt.state_dict(), "rng": _rng_state(), "run": run_info}
        existed = checkpoint.is_checkpoint(opts.save)
        try:
            checkpoint.save_checkpoint(opts.save, model, tokenizer, payload,
                                       extra_writer=lambda d: notes.extend(plots.write_plots(d, losses, cm)),
                                       save_base=saves_base)
        except Exception as e:     # (a full disk: OSError from a file, RuntimeError from torch.save, safetensors')
            keep = "the previous checkpoint there is intact" if existed else "nothing was written there"
            why = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RunError(f"saving the step-{step} checkpoint to {opts.save} failed ({why[:300]}); {keep}") from None
        saved_step, saving = step, None
        for note in notes:
            if note not in notes_shown:
                notes_shown.add(note)
                say(f"{PROG}: note: {note}")

    def on_stop(reason: str) -> str:
        if saving is not None:
            return (f"\n{PROG}: {reason}: finishing the save of step {saving} to {opts.save}. Press Ctrl-C "
                    f"again to stop at once (the checkpoint there stays as it was).")
        what = (f"then saving the checkpoint to {opts.save}" if opts.save
                else "then stopping; nothing will be saved (no --save)")
        return (f"\n{PROG}: {reason}: finishing step {step + 1}, {what}. "
                f"Press Ctrl-C again to stop at once{', without saving it' if opts.save else ''}.")

    progress = None  # made after the first step, which prints the plan (rpcompile plans at the first call)
    started, first_step, first_step_s, steady_s, steady_tokens = time.perf_counter(), step + 1, None, 0.0, 0
    stop = report.StopRequest(on_stop)
    try:
        with stop:
            while step < opts.steps and not stop.requested:
                rows = sampler.next_indices()
                batch = tokens.batch(rows)
                t0 = time.perf_counter()
                try:
                    loss = cm.train_step(**batch)
                except compiler_errors as e:  # the compiler's own errors name the stage, device, fix
                    raise RunError(f"rpcompile could not run step {step + 1}: {type(e).__name__}: {e}") from e
                if not math.isfinite(float(loss)):
                    raise RunError(_diverged(step + 1, float(loss), opts, saved_step, stepped_by_rpcompile))
                if not stepped_by_rpcompile:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                step += 1
                losses.append(float(loss))
                n_tokens = batch["input_ids"].numel()
                if progress is None:
                    first_step_s = dt
                    print(f"plan{' (eager stand-in, not rpcompile)' if opts.engine == 'eager' else ''}:")
                    print(cm.plan, flush=True)
                    rotation = _after_first_step(cm, opts, step, dt)
                    progress = Progress(opts.steps, initial=step - 1)
                else:
                    steady_s, steady_tokens = steady_s + dt, steady_tokens + n_tokens
                    if step == first_step + 1:
                        _after_second_step(cm, opts, step, dt, say, rotation)
                progress.update(step, losses[-1], n_tokens / dt, dt)
                if opts.save and opts.save_every and step % opts.save_every == 0 and step < opts.steps:
                    save(step)
            interrupted = stop.requested and step < opts.steps
            if progress is not None:
                progress.close()
                progress = None
            if stepped_by_rpcompile:
                cm.synchronize()
            if opts.save and step > (saved_step or 0):
                save(step)      # a first Ctrl-C now lets the save finish
    except KeyboardInterrupt:   # a second Ctrl-C: stop now
        if progress is not None:
            progress.close()
            progress = None
        kept = (f"the checkpoint in {opts.save} is at step {saved_step}" if saved_step
                else "nothing was saved")
        where = f"while saving step {saving}" if saving is not None else f"during step {step + 1}"
        print(f"{PROG}: stopped {where}; {kept}", file=sys.stderr)
        raise  # main() ends with exit code 130
    finally:
        if progress is not None:
            progress.close()
            progress = None

    if losses:
        tail = losses[-10:]
        print(f"{PROG}: loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {len(losses)} "
              f"(mean of the last {len(tail)}: {sum(tail) / len(tail):.4f})")
    timing = f"  {time.perf_counter() - started:.1f} s in all"
    if steady_tokens:
        timing += (f"; {steady_tokens / steady_s:,.0f} tokens/s, {steady_s / (step - first_step) * 1e3:.0f} ms/step "
                   f"after the first step, which took {first_step_s:.1f} s with capture and planning")
    print(timing)
    if opts.save and saved_step == step:
        kind = "LoRA adapter" if opts.lora else "model"
        pictures = "" if plots.NO_MATPLOTLIB in notes_shown else ", loss.png and schedule.png"
        base = (f", and the adapter's base (the random-init {opts.model} it trained on) to "
                f"{opts.save / checkpoint.BASE_DIR}"
                if saves_base else "")
        print(f"  saved the {kind} at step {step}, its tokenizer, optimizer state{pictures} to {opts.save}{base}")
    elif not opts.save:
        print("  nothing saved: pass --save DIR to keep the model, the loss curve and the schedule picture")
    if interrupted:
        if opts.save and saved_step == step:
            print(f"{PROG}: stopped after step {step} of {opts.steps} ({stop.reason}); the checkpoint in {opts.save} is "
                  f"at step {step}. Continue with: {PROG} --resume {opts.save} --save {opts.save}", file=sys.stderr)
        else:
            print(f"{PROG}: stopped after step {step} of {opts.steps} ({stop.reason}); nothing was saved, so this "
                  f"progress is lost (pass --save DIR to keep a run you may stop)", file=sys.stderr)
        return 130 if stop.reason == "Ctrl-C" else 143     # (as the shell reports a process the signal ended)
    return 0


def _diverged(step: int, loss, opts: Options, saved_step, stepped_by_rpcompile: bool) -> str:
    """The line a loss (or, with loss None, weights) that is not finite stops the run with: such a
    step is neither applied (exact mode) nor saved, so a checkpoint of a diverged model never
    replaces a good one."""
    kept = (f"the checkpoint in {opts.save} is at step {saved_step}" if opts.save and saved_step
            else "nothing was saved" if opts.save else "nothing to save (no --save)")
    applied = ("" if not stepped_by_rpcompile or loss is None
               else f" (with --optimizer {opts.optimizer} its gradients may have reached the model; not saved)")
    what = (f"the weights after step {step} are not finite (its loss was)" if loss is None
            else f"the loss is {loss} at step {step}")
    return f"{what}: training diverged{applied}; stopped, {kept}. Try a lower --lr (now {opts.lr:g})"


def _estimate_before_first_step(opts: Options, model, remaining: int) -> None:
    """On CPU: the step's FLOPs at this machine's measured matmul speed (a lower bound: the
    model's other ops and the pipeline's hand-overs come on top)."""
    if opts.devices[0] != "cpu":
        return
    recompute = opts.engine == "rpcompile" and len(opts.devices) > 1
    flops = report.step_flops(model, opts.batch_size * opts.seq_len, opts.seq_len, recompute)
    rate = report.cpu_flops_per_s()
    per_step = flops / rate
    print(f"  expected: at least {report.duration(per_step)} per step, {report.duration(per_step * remaining)} for "
          f"{report.plural(remaining, 'step')}, plus capture and planning in the first step (a rough lower bound: "
          f"{flops / 1e9:,.1f} GFLOP a step at this CPU's measured {rate / 1e9:.0f} GFLOP/s, which varies with "
          f"what else the machine runs)")
    hint = report.too_slow_hint(opts.devices, per_step * remaining)
    if hint:
        print(f"{PROG}: {hint}", flush=True)


def _after_first_step(cm, opts: Options, step: int, dt: float):
    """The rotation of the first step, the time it took and what the cost model expects."""
    line = report.rotation_line(cm, step, opts.devices)
    if line:
        print(line)
    remaining = opts.steps - step
    est = getattr(getattr(cm, "plan", None), "est_step_time", None)
    text = f"step {step} took {report.duration(dt)}, with capture and planning"
    if est and remaining:
        text += (f"; the cost model expects {report.duration(est)} for each later step "
                 f"({remaining} more: about {report.duration(est * remaining)})")
    print(text, flush=True)
    return line.split(": ", 1)[1] if line else None


def _after_second_step(cm, opts: Options, step: int, dt: float, say, rotation) -> None:
    """The measured time of a step without capture, and the rotation again if its offset moved."""
    line = report.rotation_line(cm, step, opts.devices)
    if line and line.split(": ", 1)[1] != rotation:
        say(line)
    remaining = opts.steps - step
    if remaining:
        say(f"step {step} took {report.duration(dt)}: the {remaining} remaining step{'s' * (remaining != 1)} "
            f"should take about {report.duration(dt * remaining)}")
        hint = report.too_slow_hint(opts.devices, dt * remaining)
        if hint:
            say(f"{PROG}: {hint}")


def _load_model(opts: Options):
    state = opts.resume_state
    if state and not opts.lora:  # a full fine-tune: the checkpoint is the model
        model, _ = models.build_model(str(opts.resume), opts.seed)
        return model, f"resumed at step {state['step']}"
    saved_base = opts.resume / checkpoint.BASE_DIR if state else None
    if saved_base is not None and models.is_known_name(opts.model) and (saved_base / "config.json").is_file():
        # LoRA on a built-in shape: its base as saved beside the adapter (checkpoint.py)
        model, _ = models.build_model(str(saved_base), opts.seed)
        origin = f"{opts.model} as saved in {saved_base}"
    else:
        model, origin = models.build_model(opts.model, opts.seed)
    if state:  # LoRA: the same base again, then the saved adapter
        return models.load_lora(model, opts.resume), f"base {origin}, adapter resumed at step {state['step']}"
    if opts.lora:
        model = models.apply_lora(model, opts.lora)
    return model, origin


def _base(model):
    return model.get_base_model() if checkpoint.is_peft(model) else model


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
