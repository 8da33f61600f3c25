"""What the command says about a run while it goes: which stage job ran where (the rotation),
how long a step and the whole run will take, and Ctrl-C (finish the step, then stop)."""
from __future__ import annotations

import re
import signal
import sys
import threading
import time

import torch

HOURS_WARNING_S = 3600.0   # a run expected to take longer than this on CPU gets a warning


# -- the rotation ---------------------------------------------------------------------------

def device_labels(devices: list[str]) -> list[str]:
    """Names of the devices of a plan: several CPU "devices" (worker threads) are cpu:0, cpu:1."""
    return [f"cpu:{i}" if d == "cpu" and devices.count("cpu") > 1 else d for i, d in enumerate(devices)]


def short_modules(text: str) -> str:
    """`model.embed_tokens, model.layers.0-2, model.layers.3 (mlp)` -> `embed_tokens, layers 0-3`:
    the last name of each module, layer ranges merged (a layer a stage holds in part counts)."""
    out: list[str] = []
    ranges: dict = {}           # container -> [first, last, position in out]
    for item in (s.strip() for s in text.split(",")):
        item = re.sub(r"\s*\(.*\)$", "", item)
        m = re.fullmatch(r"(.+?)\.(\d+)(?:-(\d+))?", item)
        if m:
            name, first, last = m.group(1).rsplit(".", 1)[-1], int(m.group(2)), int(m.group(3) or m.group(2))
            r = ranges.get(name)
            if r is not None and r[2] == len(out) - 1 and first <= r[1] + 1:
                r[1] = max(r[1], last)
            else:
                ranges[name] = [first, last, len(out)]
                out.append(name)
            continue
        short = item.split(" ", 1)
        short[0] = short[0].rsplit(".", 1)[-1]
        item = " ".join(short)
        if not out or out[-1] != item:
            out.append(item)
    for name, (first, last, pos) in ranges.items():
        out[pos] = f"{name} {first}" if first == last else f"{name} {first}-{last}"
    return ", ".join(out)


def rotation_line(cm, step: int, devices: list[str]) -> str | None:
    """`step 3: job 0 fwd embed_tokens, layers 0-3 on cpu:0; job 1 fused ... on cpu:1; ...`:
    what each stage job of the last step held and the device it ran on (None: the engine does
    not say)."""
    placements = getattr(cm, "last_placements", None)
    plan = getattr(cm, "plan", None)
    rows = getattr(plan, "stage_rows", None)
    if not placements or not callable(rows):
        return None
    modules = {r["stage"]: short_modules(r.get("modules") or f"{r['first']} .. {r['last']}") for r in rows()}
    labels = device_labels(devices)
    jobs = [f"job {job} {role} {modules.get(stage, f'stage {stage}')} on {labels[d] if d < len(labels) else d}"
            for job, stage, role, d in placements]
    return f"step {step}: " + "; ".join(jobs)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`1 row`, `2 rows`, `1,421 rows` (`nouns`: an irregular plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


# -- time ------------------------------------------------------------------------------------

def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def step_flops(model, tokens: int, seq_len: int, recompute: bool) -> float:
    """FLOPs of one training step, roughly: 2 per parameter and token forward, 2 backward to
    the activations, 2 more for the trained parameters' gradients, a second forward where
    backward stages recompute; attention adds 12 x layers x width x seq_len per token."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (out is None or out.weight is not emb.weight):
        total -= emb.weight.numel()      # a lookup, not a matmul (unless it is the tied LM head too)
    per_token = 2 * total * (3 if recompute else 2) + 2 * trained
    cfg = getattr(model, "config", None)
    layers, heads = getattr(cfg, "num_hidden_layers", 0), getattr(cfg, "num_attention_heads", 0)
    head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(heads, 1))
    per_token += 12 * layers * heads * head_dim * seq_len * (4 / 3 if recompute else 1)
    return float(per_token * tokens)


def cpu_flops_per_s() -> float:
    """This machine's fp32 matmul speed with torch's threads, measured in about 0.3 s: a warm-up
    (a process's first products start its thread pool and are slow), then the median of several
    timings (up to 15 of two 768 x 768 products), so a slow start or another process taking a
    core for a moment does not move the estimate (one timing over all the products did: 60 to
    140 GFLOP/s from run to run on one machine)."""
    n = 768
    a, b = torch.randn(n, n), torch.randn(n, n)
    start, fastest = time.perf_counter(), float("inf")
    for i in range(100):                       # warm-up: at least 2 products and 0.05 s
        t0 = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - t0)
        if i >= 1 and time.perf_counter() - start >= 0.05:
            break
    per_sample = 2 if fastest < 0.01 else 1    # a slow CPU: fewer, single products (< 1 s in all)
    samples = max(5, min(15, int(0.25 / max(fastest * per_sample, 1e-6))))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(per_sample):
            a @ b
        times.append(time.perf_counter() - t0)
    median = sorted(times)[samples // 2]
    return 2 * n**3 * per_sample / max(median, 1e-9)


def too_slow_hint(devices: list[str], total_s: float) -> str | None:
    if devices[0] != "cpu" or total_s < HOURS_WARNING_S:
        return None
    return (f"warning: this run will take about {duration(total_s)} on the CPU. For a first look, lower "
            f"--steps, --batch-size or --seq-len (the time per step is about proportional to batch x seq-len), "
            f"pick a smaller --model, or run on a GPU (--devices cuda:0)")


# -- Ctrl-C ----------------------------------------------------------------------------------

class StopRequest:
    """While active (a `with` block in the main thread): the first Ctrl-C, or a SIGTERM (what a job
    scheduler sends before it kills a job), asks the loop to stop after the step in flight
    (`requested`, `reason` names the signal), a second one stops at once (KeyboardInterrupt)."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, message):
        self.message = message   # message(reason) -> the line printed at the first signal
        self.requested = False
        self.reason = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.requested:
            self._restore()
            raise KeyboardInterrupt
        self.requested, self.reason = True, self.SIGNALS.get(signum, "a signal")
        print(self.message(self.reason), file=sys.stderr, flush=True)

    def _restore(self):
        for signum, previous in self._previous.items():
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, previous if previous is not None else default)
        self._previous = {}

    def __enter__(self):
        # (a process started with a signal ignored, as a shell's background job is with Ctrl-C, keeps ignoring it)
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc):
        self._restore()
        return False
