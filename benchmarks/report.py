"""The markdown that the harness appends to benchmarks/RESULTS.md, from a run's JSON record.

A run record is {"meta": {...}, "results": [one dict per system]} as the harness writes it;
`render_run` turns one into a heading, a settings line, a table and the stderr tails of the
systems that failed. Pure functions over dicts: no torch.
"""
from __future__ import annotations

import math
from typing import Optional

GiB = 2**30

RESULTS_HEADER = ("# Benchmark results\n\n"
                  "Appended by `python -m benchmarks.harness` (see benchmarks/README.md); newest last. "
                  "tokens/s = tokens per optimizer step / mean seconds of the timed steps.\n")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _num(x, fmt="{:,.0f}") -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def _gib(x) -> str:
    return "" if x is None else f"{x / GiB:.1f} GiB"


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _short(text: Optional[str], n: int = 160) -> str:
    text = (text or "").strip().splitlines()
    line = text[-1] if text else ""
    return line if len(line) <= n else line[: n - 1] + "…"


def _losses(r: dict) -> str:
    losses = r.get("losses") or []
    if not losses:
        return ""
    text = f"{losses[0]:.3f} → {losses[-1]:.3f}" if len(losses) > 1 else f"{losses[0]:.3f}"
    return text if r.get("losses_finite", True) else text + " (non-finite!)"


def _status(r: dict) -> str:
    st = r.get("status", "?")
    if st == "ok" and r.get("partial"):
        return "ok (partial)"
    return st


def _notes(r: dict) -> str:
    notes = list(r.get("notes") or [])
    if r.get("status") not in ("ok",) and r.get("reason"):
        notes.insert(0, _short(r["reason"]))
    return "; ".join(n for n in notes if n)


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}×" if a and b else ""


def render_throughput_table(results: list, reference: str = "rpcompile") -> str:
    ref = next((r.get("tokens_per_s") for r in results if r.get("system") == reference), None)
    cols = ["system", "status", "tokens/s", "s/step", "MFU", "of ceiling", "peak GPU mem", "host mem peak",
            "loss (first → last)", f"{reference} ÷ system", "setup s", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---", "---"] + ["---:"] * 6 + ["---", "---:", "---:", "---"]) + "|"]
    for r in results:
        tps = r.get("tokens_per_s")
        rel = "—" if r.get("system") == reference else ratio(ref, tps)
        row = [r.get("system", "?"), _status(r), _num(tps), _num(r.get("s_per_step"), "{:.3f}"), _pct(r.get("mfu")),
               _pct(r.get("ceiling_share")), _gib(r.get("peak_gpu_alloc_bytes")),
               _gib(r.get("host_mem_peak_bytes", r.get("host_rss_peak_bytes"))),
               _losses(r), rel, _num(r.get("setup_s"), "{:.0f}"), _notes(r)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def render_maxseq_table(results: list, reference: str = "rpcompile") -> str:
    ref = next((r.get("max_seq") for r in results if r.get("system") == reference), None)
    cols = ["system", "status", "max seq len", "longest ok / shortest failed", "probes", "peak GPU mem at max",
            f"{reference} ÷ system", "time s", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---", "---", "---:", "---", "---:", "---:", "---:", "---:", "---"]) + "|"]
    for r in results:
        ms = r.get("max_seq")
        bounds = "" if r.get("maxseq_ok") is None else f"{r.get('maxseq_ok'):,} / {_num(r.get('maxseq_fail')) or '–'}"
        rel = "—" if r.get("system") == reference else ratio(ref, ms)
        row = [r.get("system", "?"), _status(r), "none" if ms == 0 else _num(ms), bounds, _num(len(r["probes"])) if r.get("probes") else "",
               _gib(r.get("peak_gpu_at_max_bytes")), rel, _num(r.get("wall_s"), "{:.0f}"), _notes(r)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def settings_line(meta: dict) -> str:
    s = meta.get("settings", {})
    parts = [f"model {s.get('model')} ({_num(meta.get('n_params'))} parameters)"]
    if meta.get("mode") == "maxseq":
        parts.append(f"one sequence per GPU, memory capped at {s.get('mem_cap_gib')} GiB per GPU, "
                     f"doubling from {_num(s.get('maxseq_start'))} then bisecting in steps of 1,024")
    else:
        parts += [f"seq {_num(s.get('seq_len'))}", f"{_num(s.get('tokens_per_step'))} tokens/step",
                  f"{s.get('microbatches')} microbatches", f"{s.get('steps')} timed steps after {s.get('warmup')} warm-up"]
    parts.append("bf16 compute, fp32 master weights and Adam, SDPA, random token ids as labels")
    if meta.get("ceiling_tokens_per_s"):
        parts.append(f"recompute-inclusive ceiling {_num(meta['ceiling_tokens_per_s'])} tokens/s "
                     f"at {meta.get('peak_tflops_per_gpu', 790):g} TFLOP/s per GPU")
    env = meta.get("env", {})
    parts.append(f"torch {env.get('torch', '?')}, host {env.get('cpu_count', '?')} cores / "
                 f"{_num(env.get('host_mem_bytes', 0) / GiB, '{:.0f}')} GiB")
    return "; ".join(parts) + "."


def render_run(run: dict) -> str:
    meta, results = run.get("meta", {}), run.get("results", [])
    mode = "max sequence length" if meta.get("mode") == "maxseq" else "throughput"
    head = (f"## {meta.get('date', '?')} · {meta.get('card', '?')} × {meta.get('gpus', '?')} · "
            f"{meta.get('settings', {}).get('model', '?')} · {mode}")
    table = render_maxseq_table(results) if meta.get("mode") == "maxseq" else render_throughput_table(results)
    out = [head, "", settings_line(meta), "", table, ""]
    if meta.get("command"):
        out += [f"Command: `{meta['command']}`", ""]
    tails = [r for r in results if r.get("status") not in ("ok", "skipped") and r.get("stderr_tail")]
    if tails:
        out += ["<details><summary>stderr of the systems that did not finish</summary>", ""]
        for r in tails:
            out += [f"**{r.get('system')}** ({r.get('status')}, {r.get('reason', '')[:200]})", "", "```",
                    r["stderr_tail"].rstrip().replace("```", "'''"), "```", ""]
        out += ["</details>", ""]
    return "\n".join(out)


def append_section(existing: Optional[str], section: str) -> str:
    """The RESULTS.md text with `section` appended (the header written on a new file)."""
    base = existing if existing and existing.strip() else RESULTS_HEADER
    return base.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
