"""Tests of the fine-tuning command (rpcompile/finetune).

The end-to-end tests run the command in-process through ``main([...])`` with the default
engine, ``rpcompile.compile``. ``RPCOMPILE_FINETUNE_TEST_ENGINE=eager`` runs them on the
plain-PyTorch stand-in instead (the default engine is always the one meant).
"""
from __future__ import annotations

import errno
import importlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rpcompile.finetune import checkpoint, cli, data, models, plots, train
from rpcompile.finetune.cli import main
from rpcompile.finetune.tokenizer import ByteTokenizer

ENGINE = os.environ.get("RPCOMPILE_FINETUNE_TEST_ENGINE", "rpcompile")
SMALL = ["--seq-len", "32", "--batch-size", "4", "--devices", "cpu"]  # CPU fp32 on any machine
REPO = Path(__file__).resolve().parents[1]


def run(*args, engine=ENGINE) -> int:
    return main([*map(str, args), "--engine", engine])


@pytest.fixture
def captured(monkeypatch):
    """The model each run trained (the host parameters rpcompile updates in place)."""
    seen = []

    def compile_and_keep(model, *args, **kwargs):
        seen.append(model)
        return real(model, *args, **kwargs)

    real = train.compile_model
    monkeypatch.setattr(train, "compile_model", compile_and_keep)
    return seen


EXACT_STEPS = 6


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    """One exact-mode run of EXACT_STEPS steps (SMALL, ENGINE), saved: (checkpoint directory, the
    model it trained), shared by the tests that compare a run against it (nothing changes it)."""
    out = tmp_path_factory.mktemp("exact") / "ckpt"
    seen = []
    real = train.compile_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "compile_model", lambda model, *a, **k: seen.append(model) or real(model, *a, **k))
        assert run("--steps", EXACT_STEPS, "--save", out, *SMALL) == 0
    return out, seen[0]


def losses_of(directory) -> list[float]:
    return checkpoint.read_state(directory)["losses"]


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# -- end to end, default engine ----------------------------------------------------------

def test_default_run_loss_falls_and_checkpoint_reloads(tmp_path, captured, capsys):
    out = tmp_path / "ckpt"
    assert run("--steps", 12, "--seq-len", 64, "--save", out) == 0
    printed = capsys.readouterr().out
    assert "plan" in printed and "loss" in printed and "tokens/s" in printed
    if ENGINE == "rpcompile" and not torch.cuda.is_available():
        # the default shows the pipeline: two CPU devices, several stage jobs, the rotation
        assert "devices: cpu:0, cpu:1" in printed
        rotation = next(line for line in printed.splitlines() if line.startswith("step 1: job 0 fwd "))
        jobs = rotation.split("; ")
        assert len(jobs) >= 4 and " on cpu:0" in rotation and " on cpu:1" in rotation, rotation
        assert "layers" in rotation and "fused" in rotation and "bwd" in rotation
        assert "model.layers." in printed and "stage jobs per step" in printed
        assert "expected: at least" in printed and "step 2 took" in printed

    losses = losses_of(out)
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 1.0, losses  # from ~ln(259) = 5.56 towards byte statistics

    trained = captured[0]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([list(b"Alice was beginning to get very tired of sitting")])
    assert torch.equal(logits(trained, ids), logits(reloaded, ids))
    with safe_open(out / "model.safetensors", "pt") as f:  # state_dict() names, tied head once
        assert set(f.keys()) == set(trained.state_dict()) - {"lm_head.weight"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / "loss.png").stat().st_size > 0 and (out / "schedule.png").stat().st_size > 0


@pytest.mark.parametrize("full", [
    lambda f: OSError(errno.ENOSPC, "No space left on device", f),
    # what torch.save and safetensors raise on a full disk: a traceback before
    lambda f: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos: No space left on device"),
], ids=["oserror", "runtimeerror"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, capsys, full):
    # (imported before the patch: a module imported under it binds the dying save_file for good,
    # and a later test's save_pretrained died with it)
    importlib.import_module("transformers.modeling_utils")
    out = tmp_path / "ckpt"
    real_save_file, calls = safetensors.torch.save_file, []

    def save_file_that_dies(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) < 2:
            return real_save_file(tensors, filename, metadata=metadata)
        blob = safetensors.torch.save(tensors, metadata=metadata)
        Path(filename).write_bytes(blob[: len(blob) // 2])  # half the file, then the disk is full
        raise full(filename)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_that_dies)
    assert run("--steps", 4, "--save-every", 2, "--save", out, *SMALL) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "No space left" in errors[0] and "intact" in errors[0], err
    assert "Traceback" not in err
    assert len(calls) == 2

    assert checkpoint.read_state(out)["step"] == 2
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # loads: complete and unharmed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left


def test_resume_continues_exactly(tmp_path, captured, exact_run):
    straight, straight_model = exact_run             # 6 steps without a break
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    assert run("--steps", 3, "--save", first, *SMALL) == 0
    assert checkpoint.read_state(first)["step"] == 3
    assert run("--resume", first, "--steps", EXACT_STEPS, "--save", resumed, "--devices", "cpu") == 0

    expected, got = losses_of(straight), losses_of(resumed)
    assert len(expected) == len(got) == EXACT_STEPS
    assert got == pytest.approx(expected, rel=0, abs=1e-6)
    a, b = straight_model.state_dict(), captured[1].state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    # a resumed run keeps its data and batch shape: a contradicting option is refused
    assert main(["--resume", str(first), "--seq-len", "64"]) == 2


def test_lora_saves_adapter_the_peft_way(tmp_path, captured):
    from peft import PeftModel

    out = tmp_path / "adapter"
    assert run("--lora", 4, "--steps", 3, "--save", out, *SMALL) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()

    base, _ = models.build_model("tiny", seed=0)
    fresh = {k: v.clone() for k, v in base.state_dict().items()}
    reloaded = PeftModel.from_pretrained(base, out)
    ids = torch.tensor([list(b"Curiouser and curiouser!")])
    assert torch.equal(logits(captured[0], ids), logits(reloaded, ids))
    trained_base = captured[0].get_base_model().state_dict()  # frozen: LoRA left it as it was
    frozen = {k.replace(".base_layer", ""): v for k, v in trained_base.items() if "lora_" not in k}
    assert frozen.keys() == fresh.keys() and all(torch.equal(frozen[k], fresh[k]) for k in fresh)


def test_checkpoint_tokenizer_loads_with_auto_tokenizer(exact_run):
    """A built-in shape's checkpoint holds a transformers tokenizer encoding as the run trained
    (AutoTokenizer loaded a 1-token stand-in from the model type before)."""
    from transformers import AutoTokenizer

    tok, byte = AutoTokenizer.from_pretrained(exact_run[0]), ByteTokenizer()
    assert len(tok) == byte.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (byte.bos_token_id, byte.eos_token_id,
                                                                      byte.pad_token_id)
    text = "Alice: \u00e9\u00e8 \u2014 <|eos|>\n  ok"
    assert tok(text)["input_ids"] == [byte.bos_token_id] + byte.encode(text)   # BOS + the bytes, as trained
    assert tok(text, add_special_tokens=False)["input_ids"] == byte.encode(text)
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    # and a run from the checkpoint (--model DIR, --resume DIR) still uses the byte tokenizer itself
    assert isinstance(models.tokenizer_for(str(exact_run[0])), ByteTokenizer)


def test_lora_in_bf16_holds_its_base_in_bf16(tmp_path, captured):
    """--lora where the devices work in bf16 (the default on GPUs; --dtype bf16 here): rpcompile's
    frozen base is cast to bf16 once and read in place, its own working copy (Note [frozen weights
    in place]): the fresh base rounded to bf16, the adapters fp32 and trained; the saved adapter
    reloads onto the saved base with the logits of the run's model."""
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "adapter"
    assert run("--lora", 4, "--steps", 3, "--dtype", "bf16", "--save", out, *SMALL) == 0
    model = captured[0]
    fresh, _ = models.build_model("tiny", seed=0)
    base = {n.replace(".base_layer", ""): p for n, p in model.get_base_model().named_parameters() if "lora_" not in n}
    want = torch.bfloat16 if ENGINE == "rpcompile" else torch.float32
    assert base.keys() == dict(fresh.named_parameters()).keys()
    assert all(base[n].dtype == want and torch.equal(base[n], p.detach().to(want)) for n, p in fresh.named_parameters())
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    ids = torch.tensor([list(b"Curiouser and curiouser!")])
    assert torch.equal(logits(model, ids), logits(AutoPeftModelForCausalLM.from_pretrained(out, dtype=want), ids))


def test_lora_adapter_on_a_built_in_shape_loads_with_its_base(tmp_path, captured):
    """The adapter of a built-in shape names a base that loads: the random-init base saved in
    DIR/base (it named `rpcompile-finetune:tiny` before, which nothing can load). A save into the
    checkpoint a resumed run continues links that base's weights instead of writing them again."""
    from peft import AutoPeftModelForCausalLM, PeftConfig

    out = tmp_path / "adapter"
    assert run("--lora", 4, "--steps", 2, "--save", out, *SMALL) == 0
    assert PeftConfig.from_pretrained(out).base_model_name_or_path == str(out / "base")
    ids = torch.tensor([list(b"Curiouser and curiouser!")])
    assert torch.equal(logits(captured[0], ids), logits(AutoPeftModelForCausalLM.from_pretrained(out), ids))
    weights = (out / "base" / "model.safetensors").stat().st_ino

    # (the eager stand-in resumes it: saving and loading are the same, without a second capture)
    assert run("--resume", out, "--steps", 3, "--save", out, "--devices", "cpu", engine="eager") == 0
    assert (out / "base" / "model.safetensors").stat().st_ino == weights      # the same file, linked
    assert torch.equal(logits(captured[1], ids), logits(AutoPeftModelForCausalLM.from_pretrained(out), ids))


def test_lora_on_a_mixture_of_experts_adapts_its_experts(tmp_path):
    """--lora on a transformers MoE adapts the stacked expert weights too (peft target_parameters,
    captured by Note [LoRA on parameters]): it trains pipelined, and the saved adapter reloads
    onto a fresh base with the same logits."""
    import rpcompile
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def base():
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  moe_intermediate_size=16, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                  num_experts=4, num_experts_per_tok=2, max_position_embeddings=32))

    assert models.expert_parameters(base()) == ["experts.down_proj", "experts.gate_up_proj"]
    model = models.apply_lora(base(), 4)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in trainable) and any(".q_proj." in n for n in trainable)
    assert all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    cm = rpcompile.compile(model, config=rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        cm.train_step(input_ids=ids, labels=ids)
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in trainable.items() if ".experts." in n)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = models.load_lora(base(), tmp_path / "adapter")
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)


def test_ctrl_c_with_save_finishes_the_step_saves_and_resumes(tmp_path):
    """SIGINT (Ctrl-C) to the command as a user runs it: the step in flight finishes, the
    checkpoint is written atomically, the command says where; the checkpoint resumes."""
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "rpcompile.finetune", "--steps", "1000", "--save", str(out),
                             "--engine", ENGINE, *SMALL], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # as from a terminal (run in the background, pytest's children ignore SIGINT)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:          # the first step (capture and plan) is done
            if line.startswith("step 1 took"):
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Ctrl-C: finishing step" in stderr and "Traceback" not in stderr
    step = checkpoint.read_state(out)["step"]
    assert step >= 1 and f"the checkpoint in {out} is at step {step}" in stderr
    assert f"--resume {out}" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]   # no half-written sibling

    resumed = tmp_path / "resumed"
    assert run("--resume", out, "--steps", step + 2, "--save", resumed) == 0
    before, after = losses_of(out), losses_of(resumed)
    assert len(after) == step + 2 and after[:step] == before


def test_ctrl_c_without_save_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    real = train.compile_model

    def interrupted_at_step_2(*args, **kwargs):
        cm = real(*args, **kwargs)
        step = cm.train_step
        calls = []

        def train_step(**batch):
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)   # Ctrl-C while step 2 runs
            return step(**batch)

        cm.train_step = train_step
        return cm

    monkeypatch.setattr(train, "compile_model", interrupted_at_step_2)
    # as in a terminal (pytest run in the background ignores SIGINT: the command then keeps ignoring it)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run("--steps", 50, *SMALL) == 130
        err = capsys.readouterr().err
        assert "finishing step 2" in err and "stopped after step 2 of 50" in err
        assert "nothing was saved" in err and "--save" in err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # handler put back
    finally:
        signal.signal(signal.SIGINT, outer)


def test_sigterm_finishes_the_step_and_saves(tmp_path, monkeypatch, capsys):
    """SIGTERM (what a job scheduler sends before it kills a job) as a first Ctrl-C: the step in
    flight finishes and is saved (before, the run ended at once, nothing saved, nothing said)."""
    real = train.compile_model

    def terminated_at_step_2(*args, **kwargs):
        cm = real(*args, **kwargs)
        step, calls = cm.train_step, []

        def train_step(**batch):
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGTERM)
            return step(**batch)

        cm.train_step = train_step
        return cm

    monkeypatch.setattr(train, "compile_model", terminated_at_step_2)
    out = tmp_path / "ckpt"
    assert run("--steps", 50, "--save", out, *SMALL) == 143
    err = capsys.readouterr().err
    assert "SIGTERM: finishing step 2" in err and "stopped after step 2 of 50 (SIGTERM)" in err
    assert checkpoint.read_state(out)["step"] == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL      # handler put back


def test_a_diverged_loss_stops_the_run_before_it_is_saved(tmp_path, capsys):
    """A loss that is not finite stops the run with one line, before the step is applied or
    saved: a checkpoint of NaN weights replaced the good one before."""
    out = tmp_path / "ckpt"
    assert run("--lr", "1e9", "--steps", 8, "--save-every", 1, "--save", out, *SMALL) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "training diverged" in errors[0] and "--lr" in errors[0], err
    state = checkpoint.read_state(out)
    assert f"is at step {state['step']}" in errors[0]
    assert all(math.isfinite(x) for x in state["losses"]) and len(state["losses"]) == state["step"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_save_refuses_another_runs_checkpoint_unless_resumed(tmp_path, capsys, exact_run):
    """--save over another run's checkpoint without --resume replaced it without a word."""
    done, _ = exact_run
    assert run("--steps", 2, "--save", done, *SMALL) == 2
    err = capsys.readouterr().err
    assert f"holds the checkpoint of another run (step {EXACT_STEPS}); continue it with --resume {done}" in err
    assert checkpoint.read_state(done)["step"] == EXACT_STEPS


def test_devices_as_a_run_prints_them():
    assert cli.parse_devices("cpu:0,cpu:1") == ["cpu", "cpu"]


def test_a_local_model_without_its_tokenizer_is_refused(tmp_path, capsys):
    """A local checkpoint with no tokenizer trained on byte ids, which mean other tokens to it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(tmp_path)
    assert run("--model", tmp_path, "--steps", 1, *SMALL) == 2
    err = capsys.readouterr().err
    assert "no tokenizer there" in err and "Traceback" not in err
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert run("--model", tmp_path, "--steps", 1, *SMALL) == 2
    assert "its tokenizer does not load" in capsys.readouterr().err


def test_a_byte_order_mark_is_not_text(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\n{"text": "world"}\n')
    assert data.read_documents(path).texts == ["hello", "world"]


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it():
    from rpcompile.finetune.report import StopRequest

    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest(lambda: "stopping") as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert not stop.requested and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with StopRequest(lambda: "stopping") as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_rpcompile_losses_match_eager(tmp_path, exact_run):
    assert run("--steps", EXACT_STEPS, "--save", tmp_path / "e", *SMALL, engine="eager") == 0
    eager, compiled = losses_of(tmp_path / "e"), losses_of(exact_run[0])
    if ENGINE != "rpcompile":   # the shared run is the default engine's (tests/test_finetune.py's docstring)
        assert run("--steps", EXACT_STEPS, "--save", tmp_path / "r", *SMALL, engine="rpcompile") == 0
        compiled = losses_of(tmp_path / "r")
    assert len(compiled) == len(eager) == EXACT_STEPS
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_optimizer_modes(tmp_path, captured, exact_run):
    """--optimizer overlapped trains exactly as exact; delayed lands each step's gradients one
    step late (same first two losses as a run from the same start, then its own curve)."""
    for mode in ("overlapped", "delayed"):
        assert run("--steps", EXACT_STEPS, "--save", tmp_path / mode, "--optimizer", mode, *SMALL) == 0
    exact, overlapped, delayed = (losses_of(d) for d in (exact_run[0], tmp_path / "overlapped", tmp_path / "delayed"))
    assert len(exact) == EXACT_STEPS and overlapped == pytest.approx(exact, rel=0, abs=1e-6)
    a, b = exact_run[1].state_dict(), captured[0].state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    assert delayed[0] == pytest.approx(exact[0], rel=0, abs=1e-6)        # both at the initial weights
    assert all(torch.isfinite(torch.tensor(delayed))) and delayed[1] != pytest.approx(exact[1], rel=0, abs=1e-6)
    state = checkpoint.read_state(tmp_path / "delayed")["optimizer"]["state"]
    assert all(int(s["step"]) == EXACT_STEPS for s in state.values())     # every step was applied
    assert main(["--optimizer", "delayed", "--engine", "eager"]) == 2


# -- bad arguments and data: one line, exit code 2 -----------------------------------------

def _bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"\n')
    return path


@pytest.mark.parametrize("args, expected", [
    (lambda t: ["--data", t / "missing.txt"], "no such file"),
    (lambda t: ["--devices", "gpu0"], "not a device"),
    (lambda t: ["--devices", "cpu,,cpu"], "comma-separated"),
    (lambda t: ["--devices", "cuda:7"], "cuda"),
    (lambda t: ["--data", _bad_jsonl(t)], "bad.jsonl:2: not valid JSON"),
    (lambda t: ["--model", "qwen9-1t"], "not a known model"),
    (lambda t: ["--microbatches", "8", "--batch-size", "4"], "--microbatches 8"),
    (lambda t: ["--steps", "0"], "--steps"),
    (lambda t: ["--save-every", "2"], "needs --save"),
    (lambda t: ["--resume", t], "not an rpcompile checkpoint"),
])
def test_bad_arguments_give_one_line_and_exit_2(tmp_path, capsys, args, expected):
    assert main([str(a) for a in args(tmp_path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rpcompile-finetune: error:"), err
    assert expected in lines[0] and "Traceback" not in err and out == ""


def test_resume_refuses_a_changed_data_file(tmp_path, capsys):
    """--resume checks its data file's size and content (not its mtime) before reading it: one
    line saying what changed and how to go on. Before, a file of the same size with other text was
    refused only after tokenizing, saying neither; a shorter one was blamed on --batch-size."""
    path, out = tmp_path / "text.txt", tmp_path / "ckpt"
    original = "Down, down, down. Would the fall never come to an end? " * 4
    path.write_text(original)
    assert run("--data", path, "--steps", 1, "--save", out, *SMALL) == 0
    capsys.readouterr()

    os.utime(path, (0, 0))      # the same content: resumes (parse_args only, nothing trains here)
    assert cli.parse_args(["--resume", str(out), "--steps", "2"]).data == path.resolve()
    for changed, what in [(original.replace("Down", "Dawn"), "same size, other content"),
                          (original[:60], f"{len(original):,} bytes then, 60 bytes now")]:
        path.write_text(changed)
        assert main(["--resume", str(out), "--steps", "2"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"its data file {path.resolve()} changed since the checkpoint was saved" in lines[0]
        assert what in lines[0] and "put the original file back" in lines[0], lines
        assert f"--model {out} --data FILE --save NEW_DIR" in lines[0]      # how to train on it instead
    path.unlink()
    assert main(["--resume", str(out), "--steps", "2"]) == 2
    assert "its data file" in capsys.readouterr().err


def test_bare_resume_of_a_complete_run_says_what_to_do(capsys, exact_run):
    """--resume DIR without --steps continues to the steps the run planned; when it has done
    them the message said `--steps 6: ...` about an option the user never gave."""
    done, _ = exact_run
    assert main(["--resume", str(done)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rpcompile-finetune: error: --resume {done}: that run is complete "
                          f"(step {EXACT_STEPS} of the {EXACT_STEPS} it planned)"), err
    assert "pass --steps with the new total" in err and f"more than {EXACT_STEPS}" in err
    assert main(["--resume", str(done), "--steps", str(EXACT_STEPS)]) == 2    # given: about --steps
    assert f"--steps {EXACT_STEPS}: the checkpoint" in capsys.readouterr().err


def test_counts_of_one_are_singular(tmp_path, capsys):
    """`1 row`, `1 microbatch`, `1 prompt/completion pair`, `1 step` (it printed `1 rows` and
    `1 microbatches`)."""
    import re

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "Q: 2+2?", "completion": " 4"}) + "\n")
    assert run("--data", path, "--steps", 1, "--seq-len", 16, "--batch-size", 1, "--devices", "cpu") == 0
    printed = capsys.readouterr().out
    assert "1 prompt/completion pair -> 1 row of 16 tokens" in printed and "1 padded row," in printed
    assert "in 1 microbatch;" in printed and "for 1 step," in printed
    # (the plan's own text is rpcompile's, not the command's)
    ours = printed.split("\nplan:\n")[0] + "".join(line for line in printed.splitlines(True)
                                                   if line.startswith(("step ", "rpcompile-finetune")))
    assert not re.search(r"(?<![\d.,])1 (rows|microbatches|steps|documents|pairs|padded rows)\b", ours), ours
    from rpcompile.finetune.engine import _EagerPlan
    assert "  1 microbatch  " in str(_EagerPlan("cpu", 1, torch.float32, 10))


def test_bad_data_from_the_shell(tmp_path):
    """As a user sees it: ``python -m rpcompile.finetune`` prints one line on stderr, exits 2."""
    proc = subprocess.run([sys.executable, "-m", "rpcompile.finetune", "--data", str(_bad_jsonl(tmp_path))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "not valid JSON" in proc.stderr


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--lora" in capsys.readouterr().out


# -- the pieces --------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Ou est ma chatte? \u00e9\u00e8 \u2014 ok"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256 and tok.vocab_size == 259


def test_cpu_speed_estimate_ignores_a_slow_start_and_hiccups(monkeypatch):
    """The matmul speed behind the CPU estimate, on a fake clock: the first products are slow (a
    process's thread pool starting), and now and then one is (another process took the core).
    Neither moves it; one timing over all the products read a third of the speed."""
    from types import SimpleNamespace

    from rpcompile.finetune import report

    clock, calls, flops = [0.0], [0], []

    def matmul(a, b):
        calls[0] += 1
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        clock[0] += 0.060 if calls[0] <= 2 else 0.080 if calls[0] % 5 == 0 else 0.010
        return a

    monkeypatch.setattr(report, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    rate = report.cpu_flops_per_s()
    assert rate == pytest.approx(flops[0] / 0.010, rel=1e-6)
    assert clock[0] < 1.0     # what it costs at startup


def test_prompt_completion_masks_the_prompt(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Q: 2+2?", "completion": " 4"}) + "\n\n"
                    + json.dumps({"text": "plain"}) + "\n")
    docs = data.read_documents(path)
    assert docs.texts == ["plain"] and docs.pairs == [("Q: 2+2?", " 4")]
    rows = data.tokenize(docs, ByteTokenizer(), seq_len=16)
    pair_ids, pair_labels = rows.input_ids[-1].tolist(), rows.labels[-1].tolist()
    n_prompt = 1 + len("Q: 2+2?")  # BOS + prompt
    assert pair_labels[:n_prompt] == [data.IGNORE] * n_prompt
    assert pair_labels[n_prompt:n_prompt + 3] == [ord(" "), ord("4"), ByteTokenizer.eos_token_id]
    assert pair_ids[n_prompt + 3:] == [ByteTokenizer.pad_token_id] * (16 - n_prompt - 3)
    assert set(pair_labels[n_prompt + 3:]) == {data.IGNORE}


def _padded_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: what follows {i}?" + " hm" * (i % 4),
                                        "completion": f" {i + 1}, then {i + 2}." * (1 + i % 2)}) + "\n"
                            for i in range(12)))
    return path


def test_padded_rows_get_an_attention_mask(tmp_path):
    rows = data.tokenize(data.read_documents(_padded_pairs(tmp_path)), ByteTokenizer(), seq_len=48)
    pad = rows.input_ids == ByteTokenizer.pad_token_id
    assert rows.has_padding and pad.any(1).any() and not pad.any(1).all()   # short rows padded, long ones cut
    assert torch.equal(rows.attention_mask, (~pad).long())    # 0 exactly on the padding
    assert "padded rows" in rows.description
    batch = rows.batch(torch.tensor([0, 3]))
    assert torch.equal(batch["attention_mask"], rows.attention_mask[[0, 3]])
    packed = data.tokenize(data.read_documents(None), ByteTokenizer(), seq_len=32)
    assert not packed.has_padding and set(packed.batch(torch.tensor([0]))) == {"input_ids", "labels"}


def test_attention_mask_reaches_the_model_and_losses_match_eager(tmp_path, monkeypatch):
    path, seen = _padded_pairs(tmp_path), {}
    real = train.compile_model

    def keep(model, engine, *args, **kwargs):
        if engine == "eager":   # a hook sees what the model is called with (rpcompile captures it instead)
            def hook(module, args, kwargs):
                seen.setdefault("eager", kwargs.get("attention_mask"))

            model.register_forward_pre_hook(hook, with_kwargs=True)
        cm = real(model, engine, *args, **kwargs)
        seen[engine + " cm"] = cm
        return cm

    monkeypatch.setattr(train, "compile_model", keep)
    small = ["--seq-len", "48", "--batch-size", "4", "--devices", "cpu,cpu", "--steps", "3"]
    assert run("--data", path, "--save", tmp_path / "e", *small, engine="eager") == 0
    assert run("--data", path, "--save", tmp_path / "r", *small, engine="rpcompile") == 0
    assert seen["eager"] is not None and (seen["eager"] == 0).any()
    inputs = [n.name for n in seen["rpcompile cm"].plan.gm.graph.nodes
              if n.op == "placeholder" and n.meta.get("rp_kind") == "input"]
    assert any("attention_mask" in name for name in inputs), inputs
    eager, compiled = losses_of(tmp_path / "e"), losses_of(tmp_path / "r")
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_sampler_position_is_one_integer():
    a = data.Sampler(10, 4, seed=3)
    straight = [a.next_indices().tolist() for _ in range(6)]  # crosses epochs
    b = data.Sampler(10, 4, seed=3)
    first = [b.next_indices().tolist() for _ in range(2)]
    c = data.Sampler(10, 4, seed=3, cursor=b.cursor)
    assert first + [c.next_indices().tolist() for _ in range(4)] == straight
    assert sorted(sum(straight[:5], [])[:10]) == list(range(10))  # an epoch sees every row once


def test_atomic_save_without_renameat2(tmp_path, monkeypatch):
    """The portable path: rename the old one aside, rename the new one in, and recover the
    old one if a crash falls between the two renames."""
    model, _ = models.build_model("tiny", seed=0)
    out = tmp_path / "ckpt"
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    checkpoint.save_checkpoint(out, model, ByteTokenizer(), {"step": 1})
    checkpoint.save_checkpoint(out, model, ByteTokenizer(), {"step": 2})
    assert checkpoint.read_state(out)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    real_rename, renames = os.rename, []

    def crash_on_second_rename(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process dies between the two renames
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)
    monkeypatch.setattr(checkpoint.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(out, model, ByteTokenizer(), {"step": 3})
    monkeypatch.setattr(os, "rename", real_rename)
    monkeypatch.setattr(checkpoint.os, "rename", real_rename)
    # the in-process rollback already put it back; a hard kill would leave .ckpt.old-*: recover()
    assert checkpoint.read_state(out)["step"] == 2


def test_recover_puts_back_the_previous_checkpoint(tmp_path):
    model, _ = models.build_model("tiny", seed=0)
    out = tmp_path / "ckpt"
    checkpoint.save_checkpoint(out, model, ByteTokenizer(), {"step": 5})
    os.rename(out, tmp_path / ".ckpt.old-dead")  # as a kill between the fallback renames leaves it
    (tmp_path / ".ckpt.tmp-1-dead").mkdir()       # and a half-written new one, never trusted
    assert checkpoint.read_state(out)["step"] == 5
    checkpoint.save_checkpoint(out, model, ByteTokenizer(), {"step": 6})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["--save", str(tmp_path)]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_schedule_picture_from_a_pipeline_trace(tmp_path):
    """Two CPU devices, a fwd, a fused and a bwd job over two microbatches, with transfers and
    waits: drawn with labelled bars and a legend (the picture itself is looked at by hand)."""
    trace, t = [], 0.0
    for job, role, worker in ((0, "fwd", 0), (1, "fused", 1), (2, "bwd", 0)):
        for mb in range(2):
            common = {"device": "cpu", "worker": worker, "job": job, "stage": job, "role": role, "microbatch": mb}
            trace.append({**common, "stream": "acts_in", "name": "fetch", "start_s": t, "end_s": t + 0.001})
            trace.append({**common, "stream": "compute", "name": role, "start_s": t + 0.001, "end_s": t + 0.01})
            trace.append({**common, "stream": "out", "name": "offload", "start_s": t + 0.01, "end_s": t + 0.011})
            t += 0.011
        trace.append({**common, "stream": "host", "name": "wait", "microbatch": None, "start_s": t, "end_s": t + 0.002})

    class Traced:
        plan, last_trace = None, trace

    assert plots.write_plots(tmp_path, [3.0, 2.5, 2.0], Traced()) == []
    assert (tmp_path / "schedule.png").stat().st_size > 10_000


def test_plots_without_trace_and_without_matplotlib(tmp_path, monkeypatch):
    class Plan:
        stages = [{"name": "fwd 0", "est_time_s": 1.0}, {"name": "bwd 0", "est_time_s": 3.0}]

    class NoTrace:
        plan, last_trace = Plan(), None

    assert plots.write_plots(tmp_path, [3.0, 2.0, 1.5], NoTrace()) == [plots.NO_TRACE]
    assert (tmp_path / "schedule.png").is_file() and (tmp_path / "loss.png").is_file()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert plots.write_plots(tmp_path, [1.0], NoTrace()) == [plots.NO_MATPLOTLIB]


@pytest.mark.parametrize("name, billions", [
    ("qwen3-0.6b", 0.596), ("qwen3-1.7b", 1.721), ("qwen3-4b", 4.022), ("qwen3-8b", 8.191),
    ("qwen3-14b", 14.768), ("qwen3-32b", 32.762), ("llama-3.1-8b", 8.030), ("llama-3.2-1b", 1.236),
])
def test_known_shapes_have_their_published_sizes(name, billions):
    from transformers import AutoConfig

    kwargs = dict(models.KNOWN_MODELS[name])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.002)
