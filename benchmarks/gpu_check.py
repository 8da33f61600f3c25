"""GPU checks for the lent machine: parity with eager on CUDA, and a Qwen3-1.7B-shaped speed run.

    python benchmarks/gpu_check.py parity --out $OUT/parity.json
    python benchmarks/gpu_check.py parity --workers processes --data-parallel --budget 4GiB --out $OUT/p.json
        (copies in worker processes, NCCL sums; 4GiB: one job a copy, its sum beside the next step)
    python benchmarks/gpu_check.py speed --gpus 1 --steps 3 --out $OUT/speed.json
    python benchmarks/gpu_check.py lmhead --out $OUT/lmhead.json
    python benchmarks/gpu_check.py peaks --seq-len 65536 --budget 24GiB --out $OUT/peaks.json
    python benchmarks/gpu_check.py call --out $OUT/call.json
    python benchmarks/gpu_check.py users --out $OUT/users.json
    python benchmarks/gpu_check.py zoo --cases ctrl,gemma3_vlm --out $OUT/zoo.json

Writes JSON (and prints it). Not a test: CI has no GPU.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import rpcompile  # noqa: E402


def tiny_qwen3(tied=True, layers=4):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg)


def qwen3_1_7b():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cpu"):
        return Qwen3ForCausalLM(cfg)


def batch(n, seq, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 2] = -100
    return {"input_ids": ids, "labels": labels}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _load(model, values):
    """Set model's parameters to values (a list in parameters() order)."""
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)


def parity(args):
    """tiny Qwen3 against eager on CUDA: 1 and 2 GPUs, eager / Inductor stages, the peer path
    (Config.peer_transfers), the overlapped optimizer and the delayed one on 2 GPUs (against
    eager run as the delayed recurrence: step t's gradient at the parameters of step t - 1)."""
    res = {}
    if args.on_devices:
        from rpcompile.runtime.flat import FlatMasters
        FlatMasters.BLOCK = args.on_devices_block
    dev = "cuda:0"
    two = min(2, torch.cuda.device_count())
    variants = [(1, False, False, "exact"), (1, True, False, "exact"), (two, False, False, "exact"),
                (two, True, False, "exact")]
    if two == 2:
        variants += [(2, False, True, "exact"), (2, True, True, "overlapped"), (2, True, False, "delayed")]
    if args.quick:   # the 2-GPU runtime paths only, eager stage compute
        variants = [(two, False, False, "exact"), (two, False, True, "exact"), (two, False, True, "overlapped"),
                    (two, False, False, "delayed")]
    variants = [v + ("threads",) for v in variants]
    if args.workers == "processes":   # worker processes (no peer path there), with Inductor too
        variants = [v[:4] + ("processes",) for v in variants if not v[2]] + [
            (two, True, False, "delayed", "processes"), (two, True, False, "overlapped", "processes")]
    if args.data_parallel:   # replicas (Note [replicas]); on one GPU, two copies share it
        variants = [(2, inductor, False, mode, args.workers) for inductor in (False, True)
                    for mode in ("exact", "overlapped", "delayed")]
    if args.modes:
        variants = [v for v in variants if v[3] in args.modes.split(",")]
    if args.no_inductor:
        variants = [v for v in variants if not v[1]]
    if not variants:   # (--workers processes --no-inductor --modes delayed once checked nothing, silently)
        raise SystemExit("gpu_check parity: these options leave no variant to check")
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for gpus, inductor, peer, mode, workers in dict.fromkeys(variants):
            model = tiny_qwen3()
            ref = copy.deepcopy(model).to(dev)
            ondev = args.on_devices if mode != "exact" else 0.0
            cfg = rpcompile.Config(devices=[f"cuda:{i % torch.cuda.device_count()}" for i in range(gpus)],
                                   num_microbatches=3, dtype=dtype, data_parallel=args.data_parallel or None,
                                   # (the devices' share of the optimizer takes ~12 B/param of the budget)
                                   memory_budget=args.budget or ("32MiB" if ondev else "6MiB"), compile_stages=inductor,
                                   peer_transfers=peer, optimizer_mode=mode, workers=workers,
                                   optimizer_on_devices=ondev)   # (0.0: every update on the host, not the plan's choice)
            cm = rpcompile.compile(model, cfg)
            # SGD with momentum by default: parameters after steps measure rpcompile, not AdamW's
            # lr-sized steps from the noise of near-zero gradients
            make_opt = ((lambda ps: torch.optim.AdamW(ps, lr=1e-3)) if args.optimizer == "adamw" else
                        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))
            opt, opt_ref = make_opt(model.parameters()), make_opt(ref.parameters())
            if mode != "exact":
                cm.attach_optimizer(opt)
            losses, ref_losses, grad_err, peer_fetches = [], [], None, 0
            previous = [p.detach().clone() for p in ref.parameters()]   # delayed: step t - 1's parameters
            for step in range(4):
                b = batch(6, 64, 512, seed=step)
                loss = cm.train_step(**b)
                if peer:   # (cm.last_trace waits for the step's backward: delayed steps would not overlap)
                    peer_fetches += sum(s["name"] == "fetch_peer" for s in cm.last_trace)
                bd = {k: v.to(dev) for k, v in b.items()}
                if mode == "delayed":   # the gradient at the previous step's parameters
                    current = [p.detach().clone() for p in ref.parameters()]
                    _load(ref, previous)
                with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                    lr_ = ref(**bd).loss
                lr_.backward()
                if mode == "delayed":
                    _load(ref, current)
                    previous = current
                if step == 0 and mode == "exact":
                    grad_err = max(rel(p.grad, q.grad.cpu()) for p, q in zip(model.parameters(), ref.parameters()))
                losses.append(loss.item())
                ref_losses.append(lr_.item())
                if mode == "exact":
                    opt.step(), opt.zero_grad()
                opt_ref.step(), opt_ref.zero_grad()
            cm.synchronize()
            perr = max(rel(p.detach(), q.detach().cpu()) for p, q in zip(model.parameters(), ref.parameters()))
            key = (f"{dtype_name}_gpus{gpus}_{'inductor' if inductor else 'eager'}"
                   f"{'_peer' if peer else ''}{'' if mode == 'exact' else '_' + mode}"
                   f"{'_processes' if workers == 'processes' else ''}{'_replicas' if cm.plan.replicas > 1 else ''}"
                   f"{f'_ondev{ondev:g}' if ondev else ''}")
            res[key] = {"stages": len(cm.plan.stages), "microbatches": cm.plan.num_microbatches,   # (Note [finer microbatches])
                        "losses": losses, "eager_losses": ref_losses,
                        "max_rel_grad_err_step0": grad_err, "max_rel_param_err_step4": perr, "optimizer": args.optimizer,
                        "peer_fetches": peer_fetches}
            print(key, json.dumps(res[key]), flush=True)
    return res


def call(args):
    """The differentiable call on CUDA: cm(**b).loss.backward() against eager (gradients at step 0,
    parameters after 3 SGD steps), in fp32 and bf16 (eager under autocast), on GPU 0 as two
    devices (copies of the chain on one GPU, each job handing over on its device, where the
    call's backward once found no host copy of the forward's boundaries); then calls whose
    outputs are dropped undifferentiated: each frees its step (GraphRunner.call_forward), so no
    StepState stays and the device memory they took comes back."""
    import gc

    from rpcompile.runtime.job import StepState
    res = {}
    dev = "cuda:0"
    gpus = max(2, torch.cuda.device_count())   # (one GPU: two jobs' devices on it)
    for (dtype_name, dtype), workers in [(d, w) for d in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                                         for w in ("threads", "processes")]:
        model = tiny_qwen3(tied=False)
        ref = copy.deepcopy(model).to(dev)
        cm = rpcompile.compile(model, rpcompile.Config(
            devices=[f"cuda:{i % torch.cuda.device_count()}" for i in range(gpus)], num_microbatches=3,
            memory_budget="6MiB", workers=workers, dtype=dtype))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        losses, grad_err = [], None
        for step in range(3):
            b = batch(6, 64, 512, seed=step)
            loss = cm(**b).loss
            loss.backward()
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                lr_ = ref(**{k: v.to(dev) for k, v in b.items()}).loss
            lr_.backward()
            if step == 0:
                grad_err = max(rel(p.grad, q.grad.cpu()) for p, q in zip(model.parameters(), ref.parameters()))
            losses.append((loss.item(), lr_.item()))
            opt.step(), opt.zero_grad(), opt_ref.step(), opt_ref.zero_grad()
        cm.synchronize()
        perr = max(rel(p.detach(), q.detach().cpu()) for p, q in zip(model.parameters(), ref.parameters()))
        gc.collect()
        steps = lambda: sum(type(o) is StepState for o in gc.get_objects())   # noqa: E731
        before, cuda_before = steps(), torch.cuda.memory_allocated(0)
        for seed in range(5):   # differentiable calls never differentiated
            out = cm(**batch(6, 64, 512, seed=10 + seed))
            assert out.loss.requires_grad
            del out
        cm.synchronize()
        key = f"{dtype_name}_{workers}"
        res[key] = {"stages": len(cm.plan.stages), "replicas": cm.plan.replicas, "losses": losses,
                    "max_rel_grad_err_step0": grad_err, "max_rel_param_err_step3": perr,
                    "steps_left_after_5_dropped_calls": steps() - before,
                    "cuda0_allocated_delta_bytes": torch.cuda.memory_allocated(0) - cuda_before}
        print(key, json.dumps(res[key]), flush=True)
        del cm
    return res


def _against_eager(make_model, batches, cfg, via, dev="cuda:0", tight=False):
    """Train make_model() with rpcompile (`via`: "step" for train_step, "call" for
    cm(**b).loss.backward(), "backend" for torch.compile(backend=rpcompile.backend(cfg))) and a
    copy eagerly on `dev`, 3 SGD-with-momentum steps: the largest loss difference, the gradients'
    largest difference at step 0 relative to the largest gradient (as tests/parity.py), and the
    parameters' after the steps relative to the largest parameter."""
    if tight:   # 20% above the smallest budget a plan fits (the PlanningError of a 1-byte budget says)
        import re
        try:
            _against_eager(make_model, batches[:1], dataclasses.replace(cfg, memory_budget=1), via, dev)
        except Exception as e:
            smallest = re.search(r"the smallest budget a plan fits is [\d.]+ GiB \((\d+) bytes\)", str(e))
            if smallest is None:     # (not the PlanningError: the model's own failure)
                raise
            cfg = dataclasses.replace(cfg, memory_budget=int(1.2 * int(smallest.group(1))))
        torch._dynamo.reset()
    model = make_model()
    ref = copy.deepcopy(model).to(dev)
    if via == "backend":
        compiled = torch.compile(model, backend=rpcompile.backend(cfg), dynamic=True)
    else:
        cm = rpcompile.compile(model, cfg)
    trained = [p for p in model.parameters() if p.requires_grad]
    ref_trained = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref_trained, lr=0.1, momentum=0.9)
    loss_err, grad_err = 0.0, None
    for step, b in enumerate(batches):
        if via == "step":
            loss = cm.train_step(**b)
        else:
            loss = (compiled if via == "backend" else cm)(**b).loss
            loss.backward()
        lr_ = ref(**{k: v.to(dev) for k, v in b.items()}).loss
        lr_.backward()
        loss_err = max(loss_err, abs(loss.item() - lr_.item()))
        if step == 0:     # (a parameter the loss does not reach has no gradient: zeros)
            grads = [(torch.zeros_like(p) if p.grad is None else p.grad,
                      torch.zeros_like(p) if q.grad is None else q.grad.cpu()) for p, q in zip(trained, ref_trained)]
            scale = max(e.abs().max().item() for _, e in grads)
            grad_err = max((g - e).abs().max().item() for g, e in grads) / scale
        opt.step(), opt.zero_grad(), opt_ref.step(), opt_ref.zero_grad()
    scale = max(q.abs().max().item() for q in ref_trained)
    perr = max((p.detach() - q.detach().cpu()).abs().max().item() for p, q in zip(trained, ref_trained)) / scale
    plan = None if via == "backend" else cm.plan
    return {"loss_abs_err": loss_err, "grad_err_rel_largest": grad_err, "param_err_rel_largest": perr,
            "memory_budget": cfg.memory_budget, "stage_jobs": None if plan is None else len(plan.stages),
            "replicas": None if plan is None else plan.replicas}


def users(args):
    """What users run, on CUDA, fp32, against eager (_against_eager): a Mixture-of-Experts model
    (and one whose loss adds its load-balancing loss, on padded rows), a padded batch with its
    attention mask, torch.compile with the rpcompile backend, a LoRA
    adapter (peft, where installed), each on one GPU given once (a one-device plan) and twice
    (two devices' jobs on it), with train_step and with the differentiable call. (Without a GPU:
    the same on CPU devices, to try the check.)"""
    from models import checkpointing_on, qwen3
    from test_batching import padded_batch
    from test_moe import qwen3_moe
    res = {}

    def lora():
        from peft import LoraConfig, get_peft_model
        return get_peft_model(tiny_qwen3(tied=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))

    def dora():
        from peft import LoraConfig, get_peft_model
        return get_peft_model(tiny_qwen3(tied=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                                 use_dora=True, init_lora_weights=False))

    def lora_checkpointing():     # enable_input_require_grads' hook (Note [model's own checkpointing])
        from peft import LoraConfig, get_peft_model
        base = tiny_qwen3(tied=False)
        checkpointing_on(base)
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    def moe_lora():   # the experts' 3-D parameters and the router through target_parameters (Note [LoRA on parameters])
        from peft import LoraConfig, get_peft_model
        return get_peft_model(qwen3_moe(4), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    from test_loss_terms import _qwen3_moe
    cases = {"moe": (lambda: qwen3_moe(4), [batch(6, 16, 64, seed=s) for s in range(3)]),
             # its loss adds the load-balancing loss (times 0: eager's whole-batch one differs from
             # the microbatches') to the cross-entropy (Note [cross-entropy terms])
             "moe_aux": (lambda: _qwen3_moe(0.0), [padded_batch(6, 16, side, seed=s)
                                                   for s, side in enumerate(("right", "left", "one_token"))]),
             "padded": (lambda: qwen3(tied=False), [padded_batch(6, 16, side, seed=s)
                                                     for s, side in enumerate(("right", "left", "one_token"))]),
             # transformers' loss over num_items_in_batch, a 0-d tensor (Note [sums over a batch count])
             "num_items": (lambda: qwen3(tied=False), [dict(padded_batch(6, 16, side, seed=s),
                                                            num_items_in_batch=torch.tensor(40 + s))
                                                       for s, side in enumerate(("right", "left", "one_token"))]),
             "tiny_qwen3": (lambda: tiny_qwen3(tied=False), [batch(6, 64, 512, seed=s) for s in range(3)]),
             "lora": (lora, [batch(6, 64, 512, seed=s) for s in range(3)]),
             "moe_lora": (moe_lora, [batch(6, 16, 64, seed=s) for s in range(3)]),
             "dora": (dora, [batch(6, 64, 512, seed=s) for s in range(3)]),
             "lora_checkpointing": (lora_checkpointing, [batch(6, 64, 512, seed=s) for s in range(3)])}
    for name, (make, batches) in cases.items():
        if args.cases and name not in args.cases.split(","):
            continue
        for gpus in (1, 2):
            for via in ("step", "call", "backend") if name == "tiny_qwen3" else ("step", "call"):
                if args.via and via not in args.via.split(","):
                    continue
                key = f"{name}_{gpus}dev_{via}{'_processes' if args.workers == 'processes' else ''}"
                dev = "cuda:0" if torch.cuda.is_available() else "cpu"
                cfg = rpcompile.Config(devices=[dev] * gpus, num_microbatches=3, dtype=torch.float32,
                                       memory_budget=args.budget or 1, workers=args.workers)
                torch._dynamo.reset()
                try:
                    res[key] = _against_eager(make, batches, cfg, via, dev, tight=not args.budget)
                except Exception as e:   # (peft missing, or a failure: recorded, the next case runs)
                    res[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
                print(key, json.dumps(res[key]), flush=True)
    return res


def changes(args):
    """The 75th and 76th sessions' fixes on CUDA (fp32, Inductor stage compute as GPUs default to, two
    workers' jobs on one GPU, threads then processes), the tests' own runs with the devices
    changed: gradients held in .grad left alone by the attached optimizer (tests/test_overlapped.py:
    parameters against a run without them, relative to the largest parameter; .grad unchanged),
    and the delayed recurrence through requires_grad changes and a frozen parameter written in
    place (tests/test_delayed.py: losses, and parameters relative to the largest)."""
    from test_delayed import requires_grad_changes_run
    from test_overlapped import HELD_OPTIMIZERS, held_gradients_run
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    cfg = dict(devices=[dev, dev], dtype=torch.float32, workers=args.workers)
    res = {}

    def largest_rel(model, ref):
        scale = max(q.abs().max().item() for q in ref.parameters())
        return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) / scale
    for mode in ("overlapped", "delayed"):
        for opt in HELD_OPTIMIZERS:
            key = f"held_{mode}_{opt}_{args.workers}"
            try:
                plain, _ = held_gradients_run(mode, HELD_OPTIMIZERS[opt], False, **cfg)
                model, held = held_gradients_run(mode, HELD_OPTIMIZERS[opt], True, **cfg)
                res[key] = {"param_err_rel_largest": largest_rel(model, plain),
                            "grad_unchanged": all(torch.equal(p.grad, held[n]) for n, p in model.named_parameters())}
            except Exception as e:
                res[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
            print(key, json.dumps(res[key]), flush=True)
    for far in (False, True):     # (76th session) Note [buffer values a recompute starts from]
        key = f"buffer_updated_then_read{'_far' if far else ''}_{args.workers}"
        try:
            from test_parity import buffer_updated_then_read_run
            cm = buffer_updated_then_read_run(args.workers, far, devices=cfg["devices"], dtype=torch.float32)
            res[key] = {"parity": "loss, gradients every step and parameters within train_both's tolerances",
                        "jobs": [st.kind for st in cm.plan.stages]}
        except Exception as e:
            res[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
        print(key, json.dumps(res[key]), flush=True)
    key = f"requires_grad_changes_{args.workers}"
    try:
        losses, ref_losses, model, ref = requires_grad_changes_run(**cfg)
        res[key] = {"loss_abs_err": [abs(a.item() - b.item()) for a, b in zip(losses, ref_losses)],
                    "param_err_rel_largest": largest_rel(model, ref)}
    except Exception as e:
        res[key] = {"error": f"{type(e).__name__}: {e}"[:600]}
    print(key, json.dumps(res[key]), flush=True)
    return res


def trainer(args):
    """rpcompile.trainer.RPTrainer on CUDA devices (fp32) against eager Trainer on the host
    (tests/test_trainer.py's run and checks: losses, grad norms, gradients and parameters over 4
    steps), and its refusal of TrainingArguments that would put the model on the GPU."""
    import tempfile
    from test_trainer import OwnStep, Rows, WeightedLoss, arguments, assert_same_training, logged, train
    from models import qwen3
    from rpcompile.trainer import RPTrainer
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    cfg = rpcompile.Config(devices=[dev, dev], num_microbatches=2, dtype=torch.float32, workers=args.workers)
    out, res = tempfile.mkdtemp(), {}
    # (77th session) a subclass's compute_loss: Note [compute_loss of your own]; (78th) its own
    # training_step and prediction_step: Note [steps of your own]
    for case, mixin in (("", None), ("own_compute_loss_", WeightedLoss), ("own_training_step_", OwnStep)):
        try:
            rp = train(f"{out}/{case}rp", True, config=cfg, mixin=mixin)
            eager = train(f"{out}/{case}eager", False, mixin=mixin)
            res[case + "losses"], res[case + "eager_losses"] = logged(rp[0], "loss"), logged(eager[0], "loss")
            res[case + "param_err_rel_largest"] = max((p - q).abs().max().item() for p, q in zip(
                rp[1].parameters(), eager[1].parameters())) / max(q.abs().max().item() for q in eager[1].parameters())
            assert_same_training(rp, eager)
            res[case + "parity"] = "test_trainer's checks hold"
        except Exception as e:
            res[case + "parity"] = f"{type(e).__name__}: {e}"[:600]
    try:
        RPTrainer(model=qwen3(), args=arguments(f"{out}/gpu", use_cpu=False), train_dataset=Rows(), rp_config=cfg)
        res["without_use_cpu"] = "not refused"
    except Exception as e:
        res["without_use_cpu"] = f"{type(e).__name__}: {e}"[:400]
    print(json.dumps(res), flush=True)
    return res


def loop(args):
    """tests/test_training_loop.py's tests against eager (those that build their Config with its
    `_config`) with CUDA devices: fp32, two workers' jobs on one GPU, and with --on-devices that
    share of the attached optimizer's update on the GPU (FlatMasters.BLOCK --on-devices-block, so
    that the tiny model's masters spread over the GPU and the host). --cases: pytest's -k."""
    import pytest
    import test_training_loop
    from rpcompile.runtime.flat import FlatMasters
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    FlatMasters.BLOCK = args.on_devices_block

    def on_cuda(mode="exact", workers="threads", **kw):
        share = {"optimizer_on_devices": args.on_devices} if mode != "exact" and args.on_devices else {}
        # (beside the masters and state on the device, the jobs fit 300KiB no more)
        budget = args.budget or ("6MiB" if share else "300KiB")
        return rpcompile.Config(devices=[dev, dev], num_microbatches=2, memory_budget=budget, optimizer_mode=mode,
                                workers=workers, dtype=torch.float32, **share, **kw)
    test_training_loop._config = on_cuda
    here = os.path.dirname(os.path.abspath(__file__))
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", os.path.join(here, "..", "tests", "test_training_loop.py"),
                      "-k", args.cases or "not dropout and not eval_mode"])
    return {"devices": [dev, dev], "on_devices": args.on_devices, "cases": args.cases, "pytest_exit": int(rc)}


def zoo(args):
    """tests/zoo.py's transformers families (--cases, comma-separated) on CUDA against eager
    (_against_eager: fp32, two workers' jobs on one GPU, under a tight budget), through
    train_step, the differentiable call and the torch.compile backend (dynamic=True)."""
    from zoo import BY_NAME
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    res = {}
    for name in args.cases.split(","):
        case = BY_NAME[name]
        for via in ("step", "call", "backend"):
            cfg = rpcompile.Config(devices=[dev, dev], num_microbatches=3, dtype=torch.float32, workers=args.workers)
            torch._dynamo.reset()
            try:
                res[f"{name}_{via}"] = _against_eager(case.build, [case.batch(s) for s in range(3)], cfg, via, dev,
                                                      tight=via != "backend")
            except Exception as e:
                res[f"{name}_{via}"] = {"error": f"{type(e).__name__}: {e}"[:600]}
            print(name, via, json.dumps(res[f"{name}_{via}"]), flush=True)
    return res


def speed(args):
    gpus = args.gpus
    seq, tokens, M = args.seq_len, args.tokens, args.microbatches
    n = tokens // seq
    out = {"card": torch.cuda.get_device_name(0), "gpus": gpus, "seq_len": seq, "tokens_per_step": tokens,
           "microbatches": M}
    systems = args.systems.split(",")
    if "rpcompile" in systems:
        model = qwen3_1_7b()
        cfg = rpcompile.Config(devices=[f"cuda:{i}" for i in range(gpus)], num_microbatches=M,
                               dtype=torch.bfloat16, compile_stages=args.inductor,
                               optimizer_mode="overlapped" if args.overlapped else "exact",
                               memory_budget=args.budget)
        cm = rpcompile.compile(model, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        if args.overlapped:
            cm.attach_optimizer(opt)
            opt = _NoStep()
        times, losses = [], []
        for step in range(args.steps + 1):
            b = batch(n, seq, 151936, seed=step)
            for i in range(gpus):
                torch.cuda.reset_peak_memory_stats(i)
            t0 = time.time()
            if step == 1:
                t_timed = t0
            loss = cm.train_step(**b)
            t1 = time.time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.time()
            times.append((t1 - t0, t2 - t1))
            losses.append(loss.item())
            print(f"rpcompile step {step}: compute {t1 - t0:.2f}s optimizer {t2 - t1:.2f}s loss {loss.item():.4f}",
                  flush=True)
            if step == 0:
                print(cm.plan, flush=True)
            if step == 1 and args.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    cm.train_step(**b)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
                opt.zero_grad(set_to_none=True)
        cm.synchronize()
        timed = times[1:]
        # Start of the first timed step to the end of the last one's optimizer work.
        step_s = (time.time() - t_timed) / len(timed)
        out["rpcompile"] = {"tokens_per_s": tokens / step_s, "step_s": step_s,
                            "train_step_s": sum(a for a, _ in timed) / len(timed),
                            "optimizer_s": sum(b for _, b in timed) / len(timed), "losses": losses,
                            "stages": len(cm.plan.stages), "inductor": args.inductor,
                            "peak_gpu_gib": max(torch.cuda.max_memory_allocated(i) for i in range(gpus)) / 2**30}
        del cm, model, opt
    if "eager" in systems:
        model = qwen3_1_7b().to("cuda:0")
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        times, losses = [], []
        mb = n // M
        for step in range(args.steps + 1):
            b = batch(n, seq, 151936, seed=step)
            torch.cuda.reset_peak_memory_stats(0)
            torch.cuda.synchronize()
            t0 = time.time()
            total = 0.0
            for i in range(M):
                ids = b["input_ids"][i * mb:(i + 1) * mb].cuda()
                lab = b["labels"][i * mb:(i + 1) * mb].cuda()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=lab).loss / M
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.time() - t0)
            losses.append(total)
            print(f"eager step {step}: {times[-1]:.2f}s loss {total:.4f}", flush=True)
        step_s = sum(times[1:]) / len(times[1:])
        out["eager"] = {"tokens_per_s": tokens / step_s, "step_s": step_s, "losses": losses,
                        "peak_gpu_gib": torch.cuda.max_memory_allocated(0) / 2**30}
        del model, opt
    return out


class _NoStep:
    """Stands in for the optimizer the overlapped mode steps itself."""

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


class _Head(torch.nn.Module):
    """Qwen3-1.7B's LM head and transformers' causal-LM loss, alone: the head's own memory."""

    def __init__(self, hidden=2048, vocab=151936):
        super().__init__()
        self.vocab = vocab
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels):
        from transformers.loss.loss_utils import ForCausalLMLoss
        return ForCausalLMLoss(self.lm_head(hidden_states), labels, self.vocab)


def _stage_compute_s(trace, num_jobs):
    """Per stage job: seconds of its compute spans (all microbatches) in the traced step."""
    per = {}
    for s in trace:
        if s["stream"] == "compute":
            per[s["stage"]] = per.get(s["stage"], 0.0) + s["end_s"] - s["start_s"]
    return [round(per.get(i, 0.0) * 1e3, 1) for i in range(num_jobs)]


def lmhead(args):
    """The head with and without the split pass: (1) peak GPU memory of the head alone for one
    microbatch (fwd + bwd, one fused job); (2) estimated and measured stage-job times of the
    whole Qwen3-1.7B model under a memory budget that cuts it into several jobs."""
    out = {}
    seq, n, M = args.seq_len, args.tokens // args.seq_len, args.microbatches
    budget = args.budget or "30GiB"
    shards_used = None
    for shards in (0, None):
        key = "unsplit" if shards == 0 else "split"
        model = qwen3_1_7b()
        cfg = rpcompile.Config(devices=["cuda:0"], num_microbatches=M, dtype=torch.bfloat16, lm_head_shards=shards,
                               memory_budget=budget, compile_stages=args.inductor)
        cm = rpcompile.compile(model, cfg)
        note = None
        try:
            cm.train_step(**batch(n, seq, 151936))
        except rpcompile.PlanningError as e:
            # The planner counts the unsplit head's fp32 logits: it may need more than the
            # budget; measure it at the smallest budget that fits, and say so.
            note = f"no plan under {budget}: planned at min_budget {e.min_budget / 2**30:.2f} GiB"
            cfg.memory_budget = e.min_budget
            cm = rpcompile.compile(model, cfg)
        for step in range(2):   # the second step is measured
            torch.cuda.reset_peak_memory_stats(0)
            t0 = time.time()
            loss = cm.train_step(**batch(n, seq, 151936))
            dt = time.time() - t0
        rows = cm.plan.stage_rows()
        est = [r["est_time_s"] for r in rows]
        meas = _stage_compute_s(cm.last_trace, len(rows))
        if shards is None:
            shards_used = max((max(r["lm_head_shards"]) + 1 for r in rows if r["lm_head_shards"]), default=0)
        out[key] = {"loss": loss.item(), "step_s": dt, "budget": str(budget), "note": note,
                    "peak_gpu_gib": torch.cuda.max_memory_allocated(0) / 2**30,
                    "kinds": [r["kind"] for r in rows],
                    "stage_est_ms": [round(e * 1e3, 1) for e in est], "stage_measured_ms": meas,
                    "shards": [r["lm_head_shards"] for r in rows],
                    "max_over_mean_est": max(est) / (sum(est) / len(est)),
                    "max_over_mean_measured": max(meas) / (sum(meas) / len(meas))}
        print(key, json.dumps(out[key]), flush=True)
        del cm, model
    # The head alone, one microbatch of tokens (n // M sequences), one fused job.
    tokens = (n // M) * seq
    for shards in (0, shards_used or 5):
        key = f"head_only_k{shards}"
        head = _Head()
        cfg = rpcompile.Config(devices=["cuda:0"], num_microbatches=1, dtype=torch.bfloat16, lm_head_shards=shards,
                               compile_stages=False)
        cm = rpcompile.compile(head, cfg)
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n // M, seq, 2048, generator=g)
        labels = torch.randint(0, 151936, (n // M, seq), generator=g)
        for step in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(0)
            base = torch.cuda.memory_allocated(0)
            loss = cm.train_step(hidden_states=h, labels=labels)
            torch.cuda.synchronize()
        out[key] = {"tokens": tokens, "loss": loss.item(), "stages": len(cm.plan.stages),
                    "peak_gpu_gib": (torch.cuda.max_memory_allocated(0) - base) / 2**30,
                    "logits_bf16_gib": tokens * 151936 * 2 / 2**30}
        print(key, json.dumps(out[key]), flush=True)
        del cm, head
    return out


def peaks(args):
    """Issue 12's memory figures: --model (Qwen3-1.7B by default) on one GPU, one sequence of
    --seq-len tokens, the card capped at --budget (set_per_process_memory_fraction) and the
    planner given the same budget; per stage job its planned memory, the live peak of its traced
    graph (runtime.fake.live_peak), the measured peak (torch.cuda.max_memory_allocated over the
    job, reset as it starts: the prefetch of the next job's weights counts, as in the plan) and
    the most memory the allocator reserved meanwhile; after an out-of-memory error, the
    allocator's figures at that moment (reserved but free: fragmentation)."""
    from rpcompile.config import parse_bytes
    from rpcompile.runtime import executor, worker
    from rpcompile.runtime.fake import live_peak, trace_job
    budget = parse_bytes(args.budget or "24GiB")
    total = torch.cuda.get_device_properties(0).total_memory
    from benchmarks.common import build_model, get_model
    spec = get_model(args.model)
    model = build_model(spec, init_device="cuda:0", max_positions=args.seq_len)   # drawn before the cap
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), 0)
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cuda:0"], num_microbatches=1, dtype=torch.bfloat16,
                                                   optimizer_mode="delayed", memory_budget=budget))
    cm.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
    measured, reserved, real = {}, {}, executor.run_job

    def run_job(step, job_index, *a, **k):
        torch.cuda.reset_peak_memory_stats(0)
        real(step, job_index, *a, **k)
        if step.error is None:      # after a failure (an OOM) jobs stop early: no figure
            measured[job_index] = max(measured.get(job_index, 0), torch.cuda.max_memory_allocated(0))
            reserved[job_index] = max(reserved.get(job_index, 0), torch.cuda.max_memory_reserved(0))
    executor.run_job = worker.run_job = run_job       # both callers (inline and worker threads)
    out = {"seq_len": args.seq_len, "budget_gib": budget / 2**30, "steps": []}
    for step in range(args.steps):
        t0 = time.time()
        try:
            loss = cm.train_step(**batch(1, args.seq_len, spec.vocab, seed=step))
            cm.synchronize()
            out["steps"].append({"loss": float(loss), "s": time.time() - t0})
        except Exception as e:    # an OOM: which job (the StageError says), and the figures so far
            out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            out["at_failure_gib"] = {"allocated": torch.cuda.memory_allocated(0) / 2**30,
                                     "reserved": torch.cuda.memory_reserved(0) / 2**30,
                                     "peak_allocated": torch.cuda.max_memory_allocated(0) / 2**30}
            print(json.dumps({k: out[k] for k in ("error", "at_failure_gib")}), flush=True)
            break
    executor.run_job = worker.run_job = real
    plan = cm.plan
    if plan is not None:
        rows = []
        for k, st in enumerate(plan.stages):
            traced, where = live_peak(trace_job(cm, k, device="cpu"))
            rows.append({"job": k, "kind": st.kind, "planned_gib": plan.stage_plan.job_memory[k] / 2**30,
                         "traced_gib": traced / 2**30, "traced_at": where,
                         "measured_gib": measured[k] / 2**30 if k in measured else None,
                         "reserved_gib": reserved[k] / 2**30 if k in reserved else None})
            print(json.dumps(rows[-1]), flush=True)
        out.update(jobs=rows, plan=str(plan))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["parity", "speed", "lmhead", "peaks", "call", "users", "changes", "trainer",
                                           "loop", "zoo"])
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--systems", default="rpcompile,eager")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--quick", action="store_true", help="parity: 2-GPU runtime paths only, no Inductor")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--workers", default="threads", choices=["threads", "processes"],
                    help="parity, users, changes: Config.workers")
    ap.add_argument("--overlapped", action="store_true")
    ap.add_argument("--data-parallel", action="store_true",
                    help="parity: replicas (Config.data_parallel) on two GPUs, or two copies on one")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                    help="parity: SGD with momentum (lr 0.1), or AdamW (lr 1e-3) as before the 55th session")
    ap.add_argument("--modes", default="", help="parity: only these optimizer modes (comma-separated)")
    ap.add_argument("--no-inductor", action="store_true", help="parity: eager stage compute only")
    ap.add_argument("--on-devices", type=float, default=0.0,
                    help="parity: Config.optimizer_on_devices for the overlapped and delayed modes")
    ap.add_argument("--on-devices-block", type=int, default=1 << 15,
                    help="parity: FlatMasters.BLOCK with --on-devices (small, so that the tiny model's "
                         "masters spread over both devices and the host)")
    ap.add_argument("--budget", default=None, help="the device memory budget (parity: 6MiB, several jobs a copy)")
    ap.add_argument("--model", default="qwen3-1.7b", help="peaks: a model of benchmarks/common.py MODELS")
    ap.add_argument("--cases", default="", help="users: only these cases (comma-separated: moe,moe_aux,padded,num_items,tiny_qwen3,lora,"
                    "moe_lora,dora,lora_checkpointing); loop: pytest's -k; zoo: tests/zoo.py names")
    ap.add_argument("--via", default="", help="users: only these ways in (comma-separated: step,call,backend)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hang-s", type=float, default=0, help="dump every thread's stack and exit after this long")
    args = ap.parse_args()
    if args.hang_s:
        import faulthandler
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
    res = {"parity": parity, "speed": speed, "lmhead": lmhead, "peaks": peaks, "call": call, "users": users,
           "changes": changes, "trainer": trainer, "loop": loop, "zoo": zoo}[args.what](args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
