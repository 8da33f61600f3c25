"""The fine-tuning loop: model + data -> compiled model -> steps -> checkpoints and plots."""
from __future__ import annotations

import random
import sys
import time

import torch

from . import checkpoint, data, models, plots
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
        raise UsageError(f"--data {docs.source}: {len(tokens)} rows of {opts.seq_len} tokens, fewer than "
                         f"--batch-size {opts.batch_size}; lower --batch-size or --seq-len")
    if state and tokens.fingerprint != state["run"]["data_fingerprint"]:
        raise UsageError(f"--resume {opts.resume}: the data ({docs.source}) is not what the checkpoint "
                         f"was trained on (its contents or tokenizer changed)")

    model, origin = _load_model(opts)
    models.check_model_tokenizer(model, tokenizer, opts.model, opts.seq_len)
    model.config.use_cache = False  # no KV cache while training (checkpoint.py saves it as True)
    model.train()
    total, trainable = models.count_params(model)

    dtype = DTYPES[opts.dtype] if opts.dtype else None
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
    print(f"  devices: {','.join(opts.devices)}; batch {opts.batch_size} x {opts.seq_len} tokens in "
          f"{opts.microbatches} microbatches; compute dtype {opts.dtype or 'default'}; AdamW lr {opts.lr:g}"
          f"{'' if opts.optimizer == 'exact' else f' ({opts.optimizer})'}; "
          f"steps {step + 1}..{opts.steps}" + (f" (resumed from {opts.resume})" if state else ""))
    print("  the first step captures and plans the model ...", flush=True)

    run_info = {"model": opts.model, "lora": opts.lora, "seed": opts.seed, "seq_len": opts.seq_len,
                "batch_size": opts.batch_size, "lr": opts.lr, "steps": opts.steps,
                "data": str(opts.data) if opts.data else None, "data_fingerprint": tokens.fingerprint}
    notes_shown: set[str] = set()
    saved_step = state["step"] if state else None

    def save(step: int) -> None:
        nonlocal saved_step
        if stepped_by_rpcompile:
            cm.synchronize()          # the optimizer's pending step, before reading its state
        notes: list[str] = []
        payload = {"step": step, "cursor": sampler.cursor, "losses": list(losses),
                   "optimizer": opt.state_dict(), "rng": _rng_state(), "run": run_info}
        existed = checkpoint.is_checkpoint(opts.save)
        try:
            checkpoint.save_checkpoint(opts.save, model, tokenizer, payload,
                                       extra_writer=lambda d: notes.extend(plots.write_plots(d, losses, cm)))
        except OSError as e:
            keep = "the previous checkpoint there is intact" if existed else "nothing was written there"
            raise RunError(f"saving the step-{step} checkpoint to {opts.save} failed "
                           f"({e.strerror or e}); {keep}") from None
        saved_step = step
        for note in notes:
            if note not in notes_shown:
                notes_shown.add(note)
                (progress.write if progress is not None else print)(f"{PROG}: note: {note}")

    progress = None  # made after the first step, which prints the plan (rpcompile plans at the first call)
    started, first_step, first_step_s, steady_s, steady_tokens = time.perf_counter(), step + 1, None, 0.0, 0
    try:
        while step < opts.steps:
            rows = sampler.next_indices()
            input_ids, labels = tokens.input_ids[rows], tokens.labels[rows]
            t0 = time.perf_counter()
            try:
                loss = cm.train_step(input_ids=input_ids, labels=labels)
            except compiler_errors as e:  # the compiler's own errors name the stage, device, fix
                raise RunError(f"rpcompile could not run step {step + 1}: {type(e).__name__}: {e}") from e
            if not stepped_by_rpcompile:
                opt.step()
                opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            step += 1
            losses.append(float(loss))
            if progress is None:
                first_step_s = dt
                print(f"plan{' (eager stand-in, not rpcompile)' if opts.engine == 'eager' else ''}:")
                print(cm.plan, flush=True)
                progress = Progress(opts.steps, initial=step - 1)
            else:
                steady_s, steady_tokens = steady_s + dt, steady_tokens + input_ids.numel()
            progress.update(step, losses[-1], input_ids.numel() / dt, dt)
            if opts.save and opts.save_every and step % opts.save_every == 0 and step < opts.steps:
                save(step)
    except KeyboardInterrupt:
        if progress is not None:
            progress.close()
            progress = None
        where = f"; the checkpoint in {opts.save} is at step {saved_step}" if saved_step else ""
        print(f"{PROG}: stopped after step {step}{where}", file=sys.stderr)
        raise  # main() ends with exit code 130
    finally:
        if progress is not None:
            progress.close()
    if stepped_by_rpcompile:
        cm.synchronize()
    if opts.save:
        save(step)

    tail = losses[-10:]
    print(f"{PROG}: loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {step} "
          f"(mean of the last {len(tail)}: {sum(tail) / len(tail):.4f})")
    timing = f"  {time.perf_counter() - started:.1f} s in all"
    if steady_tokens:
        timing += (f"; {steady_tokens / steady_s:,.0f} tokens/s, {steady_s / (step - first_step) * 1e3:.0f} ms/step "
                   f"after the first step, which took {first_step_s:.1f} s with capture and planning")
    print(timing)
    if opts.save:
        kind = "LoRA adapter" if opts.lora else "model"
        pictures = "" if plots.NO_MATPLOTLIB in notes_shown else ", loss.png and schedule.png"
        print(f"  saved the {kind}, its optimizer state{pictures} to {opts.save}")
    else:
        print("  nothing saved: pass --save DIR to keep the model, the loss curve and the schedule picture")
    return 0


def _load_model(opts: Options):
    state = opts.resume_state
    if state and not opts.lora:  # a full fine-tune: the checkpoint is the model
        model, _ = models.build_model(str(opts.resume), opts.seed)
        return model, f"resumed at step {state['step']}"
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
