"""Command line of ``rpcompile-finetune``: parse, check, and hand a resolved ``Options`` to
``train.run``. Bad arguments and bad data files end as one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import checkpoint, data, models, report
from .engine import DTYPES
from .errors import RunError, UsageError

PROG = "rpcompile-finetune"
DEFAULT_STEPS, DEFAULT_BATCH, DEFAULT_SEQ_LEN, DEFAULT_SEED = 200, 16, 128, 0


@dataclass
class Options:
    model: str                 # a KNOWN_MODELS name or an absolute checkpoint directory
    data: Path | None          # None: the corpus shipped in the package
    devices: list[str]
    microbatches: int
    batch_size: int
    seq_len: int
    steps: int                 # the total: a resumed run stops there too
    lr: float
    dtype: str | None          # fp32/bf16/fp16; None: the engine's default
    lora: int | None
    save: Path | None
    save_every: int | None
    resume: Path | None
    seed: int
    engine: str
    resume_state: dict | None = None
    optimizer: str = "exact"   # rpcompile's optimizer_mode: exact, overlapped or delayed


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; we want one line
        raise UsageError(message)


def _number(kind, minimum, what):
    """An argparse type: `kind` (int or float) at least `minimum`, finite; `what` says the bound."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value >= minimum or value == float("inf") or (kind is float and value == minimum):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value
    return parse


_positive_int = _number(int, 1, "at least 1")
_seed = _number(int, 0, "0 or more")
_positive_float = _number(float, 0.0, "a positive number")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=textwrap.fill(
            "Fine-tune a causal language model with rpcompile: weights and optimizer state stay in "
            "host memory, the devices run the model's stages in turn. With no arguments: a tiny "
            "Qwen3-style model learns a few chapters of Alice in Wonderland on the CPU in about a "
            "minute.", 88),
        epilog="examples:\n"
               f"  {PROG}\n"
               f"  {PROG} --model qwen3-1.7b --devices cuda:0,cuda:1 --microbatches 4 --seq-len 2048\n"
               f"  {PROG} --model ./my-checkpoint --data train.jsonl --lora 16 --save out/\n"
               f"  {PROG} --resume out/ --steps 400 --save out/",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="NAME|PATH",
                   help="a local HuggingFace checkpoint directory, or one of "
                        f"{', '.join(models.KNOWN_MODELS)} (that shape built with random weights; "
                        "default: tiny)")
    p.add_argument("--data", metavar="PATH", type=Path,
                   help='a text file, or JSONL with a "text" field or "prompt"/"completion" '
                        "per line (default: the built-in corpus)")
    p.add_argument("--devices", metavar="LIST",
                   help="comma-separated, e.g. cpu,cpu or cuda:0,cuda:1; the stage jobs rotate over them "
                        "(default: every visible GPU, else cpu,cpu: two CPU worker threads, so the "
                        "pipeline shows)")
    p.add_argument("--microbatches", metavar="M", type=_positive_int,
                   help="microbatches per step (default: number of devices + 1, at least 2)")
    p.add_argument("--batch-size", metavar="B", type=_positive_int,
                   help=f"rows per optimizer step (default: {DEFAULT_BATCH})")
    p.add_argument("--seq-len", metavar="S", type=_positive_int,
                   help=f"tokens per row (default: {DEFAULT_SEQ_LEN})")
    p.add_argument("--steps", metavar="N", type=_positive_int,
                   help=f"optimizer steps in all, counting those before a --resume (default: {DEFAULT_STEPS}; "
                        "with --resume: the total the resumed run planned)")
    p.add_argument("--lr", metavar="LR", type=_positive_float,
                   help="AdamW learning rate (default: 3e-3 for tiny, 2e-4 with --lora, else 2e-5)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="compute dtype on the devices; master weights stay fp32 (default: fp32 "
                        "on cpu, bf16 on cuda)")
    p.add_argument("--lora", metavar="R", type=_positive_int,
                   help="train a rank-R LoRA adapter on the attention and MLP projections (peft; "
                        "a mixture of experts' experts too); the base stays frozen")
    p.add_argument("--save", metavar="DIR", type=Path,
                   help="write the checkpoint (HuggingFace layout: the model or, with --lora, the "
                        "adapter, plus a transformers tokenizer), loss.png and schedule.png here, "
                        "atomically; a LoRA adapter on a built-in shape gets its base in DIR/base")
    p.add_argument("--save-every", metavar="N", type=_positive_int,
                   help="also save every N steps (needs --save)")
    p.add_argument("--resume", metavar="DIR", type=Path,
                   help="continue the run saved in DIR exactly where it stopped, up to its planned "
                        "--steps or a new total (model, data, seed and batch shape come from the "
                        "checkpoint; its data file must not have changed)")
    p.add_argument("--seed", metavar="N", type=_seed, help=f"random seed (default: {DEFAULT_SEED})")
    p.add_argument("--optimizer", choices=["exact", "overlapped", "delayed"], default="exact",
                   help="when AdamW steps: exact (after each step, results equal plain PyTorch), "
                        "overlapped (in a host thread beside the next step, same results), delayed "
                        "(the next step does not wait: gradients land one step late, as RoundPipe's "
                        "asynchronous step; a --resume starts the delay again) (default: exact)")
    p.add_argument("--engine", choices=["rpcompile", "eager"], default="rpcompile",
                   help=argparse.SUPPRESS)  # eager: a plain-PyTorch stand-in, for testing
    return p


def parse_devices(text: str | None) -> list[str]:
    import torch

    if text is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # Two CPU "devices" (worker threads) without a GPU: the plan then has several stage jobs
        # and the rotation is visible, which is what rpcompile is about.
        return [f"cuda:{i}" for i in range(n)] or ["cpu", "cpu"]
    items = [s.strip().lower() for s in text.split(",")]
    if not all(items):
        raise UsageError(f"--devices {text!r}: expected a comma-separated list such as cpu,cpu or cuda:0,cuda:1")
    devices = []
    for item in items:
        m = re.fullmatch(r"cpu(?::\d+)?|cuda(?::(\d+))?", item)
        if not m:
            raise UsageError(f"--devices {text}: {item!r} is not a device (expected cpu or cuda:N)")
        if item.startswith("cpu"):      # cpu:1 as a run prints its devices: one more CPU device
            devices.append("cpu")
            continue
        if not torch.cuda.is_available():
            raise UsageError(f"--devices {text}: CUDA is not available on this machine (try --devices cpu)")
        index = int(m.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise UsageError(f"--devices {text}: cuda:{index} does not exist "
                             f"({report.plural(torch.cuda.device_count(), 'CUDA device')} visible)")
        devices.append(f"cuda:{index}")
    if len({d.split(":")[0] for d in devices}) > 1:
        raise UsageError(f"--devices {text}: mixes cpu and cuda devices")
    return devices


def parse_args(argv=None) -> Options:
    a = build_parser().parse_args(argv)
    devices = parse_devices(a.devices)
    if a.save_every is not None and a.save is None:
        raise UsageError("--save-every needs --save DIR")
    if a.data is not None and not a.data.is_file():
        raise UsageError(f"--data {a.data}: " + ("not a regular file" if a.data.exists() else "no such file"))

    state, steps_given = None, a.steps
    if a.resume is not None:
        state = checkpoint.read_state(a.resume)
        _reconcile_with_checkpoint(a, state)
        _check_resumed_data(a, state["run"])
    # a resumed run's model was checked when it started (a full fine-tune resumes from the
    # checkpoint itself, so its original directory need not exist any more)
    model = a.model if state else models.check_model_spec(a.model or models.TINY)
    if a.save is not None:
        checkpoint.check_save_target(a.save, a.resume)

    batch_size = a.batch_size or DEFAULT_BATCH
    microbatches = a.microbatches or min(batch_size, max(2, len(devices) + 1))
    if microbatches > batch_size:
        raise UsageError(f"--microbatches {microbatches}: more than --batch-size {batch_size} "
                         f"(every microbatch needs at least one row)")
    if a.seq_len is not None and a.seq_len < 2:
        raise UsageError(f"--seq-len {a.seq_len}: needs at least 2 tokens (one to predict the next)")
    if a.optimizer != "exact" and a.engine == "eager":
        raise UsageError(f"--optimizer {a.optimizer}: only rpcompile steps the optimizer itself; the eager "
                         "stand-in takes --optimizer exact")
    steps = a.steps or DEFAULT_STEPS
    if state is not None and steps <= state["step"] and steps_given is None:
        raise UsageError(f"--resume {a.resume}: that run is complete (step {state['step']} of the "
                         f"{state['run']['steps']} it planned); to train it further, pass --steps with the new "
                         f"total, more than {state['step']} (e.g. --steps {state['step'] + state['run']['steps']})")
    if state is not None and steps <= state["step"]:
        raise UsageError(f"--steps {steps}: the checkpoint in {a.resume} is already at step {state['step']}; "
                         f"--steps counts all steps, so pass more than {state['step']}")
    lr = a.lr or (3e-3 if model == models.TINY and not a.lora else 2e-4 if a.lora else 2e-5)
    return Options(model=model, data=a.data.resolve() if a.data else None, devices=devices,
                   microbatches=microbatches, batch_size=batch_size, seq_len=a.seq_len or DEFAULT_SEQ_LEN,
                   steps=steps, lr=lr, dtype=a.dtype, lora=a.lora,
                   save=a.save.absolute() if a.save else None, save_every=a.save_every,
                   resume=a.resume.absolute() if a.resume else None,
                   seed=DEFAULT_SEED if a.seed is None else a.seed, engine=a.engine, resume_state=state,
                   optimizer=a.optimizer)


def _reconcile_with_checkpoint(a, state: dict) -> None:
    """A resumed run keeps the model, data and batch shape it was saved with: options left out
    are taken from the checkpoint, and one that contradicts it is an error."""
    run = state["run"]
    given = {
        "model": models.check_model_spec(a.model) if a.model else None,
        "lora": a.lora, "seed": a.seed, "seq_len": a.seq_len, "batch_size": a.batch_size,
        "data": str(a.data.resolve()) if a.data else None,
    }
    for key, value in given.items():
        if value is not None and value != run[key]:
            flag = "--" + key.replace("_", "-")
            saved = run[key] if run[key] is not None else {"data": "the built-in corpus", "lora": "no LoRA"}[key]
            raise UsageError(f"{flag} {value}: the checkpoint in {a.resume} was trained with {saved}; "
                             f"a resumed run keeps its model, data and batch shape (leave {flag} out)")
    a.model, a.lora, a.seed = run["model"], run["lora"], run["seed"]
    a.seq_len, a.batch_size = run["seq_len"], run["batch_size"]
    a.data = Path(run["data"]) if run["data"] else None
    a.lr = a.lr or run["lr"]
    a.steps = a.steps or run["steps"]


def _check_resumed_data(a, run: dict) -> None:
    """A resumed run reads the same rows in the same order: its data file must still hold what the
    checkpoint was trained on (size and content, by ``data.file_fingerprint``: before the file is
    read; checkpoints from before the fingerprint was recorded rely on the tokens' one)."""
    if a.data is None:
        return
    if not a.data.is_file():
        raise UsageError(f"--resume {a.resume}: its data file {a.data} is gone; put it back, or "
                         f"{fresh_run_hint(a.resume, run)}")
    saved = run.get("data_file")
    if saved is None:
        return
    try:
        now = data.file_fingerprint(a.data)
    except OSError as e:
        raise UsageError(f"--resume {a.resume}: cannot read its data file {a.data} ({e.strerror or e})") from None
    if now != saved:
        before, after = int(saved.split(":")[0]), int(now.split(":")[0])
        what = (f"{report.plural(before, 'byte')} then, {report.plural(after, 'byte')} now" if before != after
                else "same size, other content")
        raise UsageError(f"--resume {a.resume}: its data file {a.data} changed since the checkpoint was saved "
                         f"({what}); a resumed run continues with the same rows in the same order, so put the "
                         f"original file back, or {fresh_run_hint(a.resume, run)}")


def fresh_run_hint(resume, run: dict) -> str:
    """How to train on other data than a checkpoint's: a new run (no override continues a run on
    different data)."""
    if run.get("lora"):
        return "start a new run (without --resume, with a new --save DIR)"
    return (f"start a new run from the checkpoint's weights: {PROG} --model {resume} --data FILE "
            f"--save NEW_DIR")


def main(argv=None) -> int:
    """Entry point of ``rpcompile-finetune`` and ``python -m rpcompile.finetune``; returns the exit code."""
    from . import train

    try:
        return train.run(parse_args(argv))
    except UsageError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)  # one line
        return 2
    except RunError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

