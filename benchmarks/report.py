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


def reference_system(results: list) -> str:
    """"rpcompile" if it ran, else the first rpcompile system of the run: what ratio columns divide."""
    systems = [r.get("system") for r in results]
    return "rpcompile" if "rpcompile" in systems else next(
        (s for s in systems if str(s).startswith("rpcompile")), "rpcompile")


def render_throughput_table(results: list, reference: Optional[str] = None) -> str:
    """The markdown table of a throughput run; the ratio column divides the reference's tokens/s
    (default: "rpcompile" if it ran, else the first rpcompile system of the run) by each system's."""
    reference = reference or reference_system(results)
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


def loss_parity(results: list, reference: str = "eager", rtol: float = 2.0**-7) -> tuple:
    """(name of the reference system, {system: parity}) for a loss-curve run.

    The reference is `reference` if it recorded losses, else the first system that did. For every
    system with losses, over the steps both recorded: the largest |loss - reference loss| and the
    step (1-based) it happens at, the largest relative difference, whether all its losses are
    finite, and `within_tol`: finite, every step done, and |Δ| <= rtol · |reference loss| at every
    step. Note [bf16 tolerance]: the systems round differently (eager: fp32 weights under bf16
    autocast; rpcompile: bf16 working copies; RoundPipe: a bf16 model), each rounding a value to
    bf16 carries a relative error up to 2^-8, and the loss is a mean over many tokens, so its
    differences stay well under 2^-8 relative at step 1; the default 2^-7 leaves room for the
    trajectories drifting apart over the steps (Adam normalises each update, so a small gradient
    difference can change an update of a near-zero gradient entirely)."""
    have = [r for r in results if r.get("losses")]
    ref = next((r for r in have if r.get("system") == reference), have[0] if have else None)
    if ref is None:
        return None, {}
    base = ref["losses"]
    out = {}
    for r in have:
        losses = r["losses"]
        n = min(len(losses), len(base))
        finite = all(_isfinite(x) for x in losses)
        diffs = [abs(losses[i] - base[i]) for i in range(n)]
        rels = [abs(losses[i] - base[i]) / abs(base[i]) if base[i] else float("inf") for i in range(n)]
        comparable = all(_isfinite(d) for d in diffs)
        worst = max(range(n), key=lambda i: diffs[i]) if n and comparable else None
        out[r["system"]] = {
            "reference": ref["system"], "steps_compared": n, "steps": len(losses), "all_finite": finite,
            "max_abs_diff": diffs[worst] if worst is not None else None,
            "max_abs_diff_step": worst + 1 if worst is not None else None,
            "max_rel_diff": max(rels) if n and comparable else None,
            "rtol": rtol,
            "within_tol": bool(finite and comparable and n == len(base) == len(losses) and n > 0
                               and all(rel <= rtol for rel in rels)),
        }
    return ref["system"], out


def _isfinite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_columns(n: int) -> list:
    """The steps (1-based) whose loss the loss-curve table shows: the first, a few, the last."""
    return sorted({s for s in (1, 2, 5, 10, 20, n) if 1 <= s <= n})


def render_losscurve_table(results: list, meta: dict) -> str:
    s = meta.get("settings", {})
    n = int(s.get("loss_steps") or max((len(r.get("losses") or []) for r in results), default=0))
    ref, parity = loss_parity(results, s.get("loss_reference", "eager"), s.get("loss_rtol", 2.0**-7))
    shown = loss_columns(n)
    cols = (["system", "status"] + [f"loss @{i}" for i in shown]
            + [f"max |Δ| vs {ref or 'reference'} (step)", "max rel Δ", "all finite", "within tol", "notes"])
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |",
             "|" + "|".join(["---", "---"] + ["---:"] * (len(shown) + 2) + ["---", "---", "---"]) + "|"]
    for r in results:
        losses, p = r.get("losses") or [], parity.get(r.get("system"), {})
        at = [_num(losses[i - 1], "{:.4f}") if i <= len(losses) and _isfinite(losses[i - 1])
              else (str(losses[i - 1]) if i <= len(losses) else "") for i in shown]
        diff = "" if p.get("max_abs_diff") is None else f"{p['max_abs_diff']:.4f} ({p['max_abs_diff_step']})"
        rel = "" if p.get("max_rel_diff") is None else f"{p['max_rel_diff']:.2e}"
        finite = "" if not p else ("yes" if p["all_finite"] else "NO")
        within = "" if not p else ("yes" if p["within_tol"] else "NO")
        if r.get("system") == ref:
            diff, rel, within = "—", "—", "(reference)"
        row = [r.get("system", "?"), _status(r), *at, diff, rel, finite, within, _notes(r)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def losscurve_footer(results: list, meta: dict) -> str:
    """How the tolerance reads, and how far the reference's own loss moved over the steps (a
    difference is only telling when the loss moved more than it)."""
    s = meta.get("settings", {})
    ref, _ = loss_parity(results, s.get("loss_reference", "eager"), s.get("loss_rtol", 2.0**-7))
    rtol = s.get("loss_rtol", 2.0**-7)
    power = f"2^{math.log2(rtol):.0f}; " if rtol > 0 and math.log2(rtol).is_integer() else ""
    text = (f"within tol: every step's |loss - {ref or 'reference'} loss| <= {rtol:.3g} x |{ref or 'reference'} loss| "
            f"({power}bf16 rounds to 2^-8 relative), all losses finite, all steps done.")
    base = next((r.get("losses") for r in results if r.get("system") == ref), None)
    if base and len(base) > 1 and all(_isfinite(x) for x in base):
        text += (f" {ref}'s loss moved {base[-1] - base[0]:+.4f} from step 1 to step {len(base)} "
                 f"(largest step-to-step change {max(abs(b - a) for a, b in zip(base, base[1:])):.4f}).")
    return text


def new_length_extra(probes: list) -> str:
    """What a step at a new length costs over a step at a known one: each probe that trained ran
    twice (common._max_seq_search), so probe s - repeat s. The first such probe also captures and
    compiles (shown apart); the rest, as "median (max)". Probes run under cProfile (`--option
    profile_probes=N`) are marked: the profiler slows the probe and not the step it is compared
    with (Qwen3-1.7B on an H200: +8.6 s profiled, +4.1 s not)."""
    done = [p for p in probes if p.get("ok") and p.get("repeat_s") is not None]
    extra = [p["s"] - p["repeat_s"] for p in done]
    if not extra:
        return ""
    text = f"first {extra[0]:.1f}"
    if len(extra) > 1:
        rest = sorted(extra[1:])
        text += f"; then {rest[len(rest) // 2]:.1f} ({rest[-1]:.1f})"
    if any(p.get("profile") for p in done):
        text += ", probes profiled (inflated)"
    return text


def render_maxseq_table(results: list, reference: Optional[str] = None) -> str:
    reference = reference or reference_system(results)
    ref = next((r.get("max_seq") for r in results if r.get("system") == reference), None)
    cols = ["system", "status", "max seq len", "longest ok / shortest failed", "probes", "peak GPU mem at max",
            f"{reference} ÷ system", "new length: s over a known one", "time s", "notes"]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join(["---", "---", "---:", "---", "---:", "---:", "---:", "---", "---:", "---"]) + "|"]
    for r in results:
        ms = r.get("max_seq")
        bounds = "" if r.get("maxseq_ok") is None else f"{r.get('maxseq_ok'):,} / {_num(r.get('maxseq_fail')) or '–'}"
        rel = "—" if r.get("system") == reference else ratio(ref, ms)
        row = [r.get("system", "?"), _status(r), "none" if ms == 0 else _num(ms), bounds, _num(len(r["probes"])) if r.get("probes") else "",
               _gib(r.get("peak_gpu_at_max_bytes")), rel, new_length_extra(r.get("probes") or []),
               _num(r.get("wall_s"), "{:.0f}"), _notes(r)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def settings_line(meta: dict) -> str:
    s = meta.get("settings", {})
    parts = [f"model {s.get('model')} ({_num(meta.get('n_params'))} parameters)"]
    if meta.get("mode") == "losscurve":
        parts += [f"seq {_num(s.get('seq_len'))}", f"{_num(s.get('tokens_per_step'))} tokens/step",
                  f"{s.get('microbatches')} microbatches",
                  f"{s.get('loss_steps')} optimizer steps from step 1 (no warm-up), the same initial weights "
                  f"(seed {s.get('seed', 0)}) and batches for every system, AdamW lr {s.get('lr', 1e-5):g}"]
    elif meta.get("mode") == "maxseq":
        parts.append(f"one sequence per GPU, memory capped at {s.get('mem_cap_gib')} GiB per GPU, "
                     f"doubling from {_num(s.get('maxseq_start'))} then bisecting in steps of {_num(s.get('maxseq_step', 1024))}")
    else:
        parts += [f"seq {_num(s.get('seq_len'))}", f"{_num(s.get('tokens_per_step'))} tokens/step",
                  f"{s.get('microbatches')} microbatches",
                  f"{s.get('steps')} timed steps after {_warmup_text(s)} warm-up"]
    parts.append("bf16 compute, fp32 master weights and Adam, SDPA, random token ids as labels")
    if meta.get("ceiling_tokens_per_s"):
        parts.append(f"recompute-inclusive ceiling {_num(meta['ceiling_tokens_per_s'])} tokens/s "
                     f"at {meta.get('peak_tflops_per_gpu', 790):g} TFLOP/s per GPU")
    env = meta.get("env", {})
    parts.append(f"torch {env.get('torch', '?')}, host {env.get('cpu_count', '?')} cores / "
                 f"{_num(env.get('host_mem_bytes', 0) / GiB, '{:.0f}')} GiB")
    return "; ".join(parts) + "."


def _warmup_text(s: dict) -> str:
    """"2", or "2 (rpcompile: 4)" where systems warm up differently (harness.default_warmup)."""
    by = s.get("warmup_by_system") or {}
    if not by or len(set(by.values())) <= 1:
        return str(s.get("warmup") if not by else next(iter(by.values())))
    common = max(set(by.values()), key=list(by.values()).count)
    other = ", ".join(f"{k}: {v}" for k, v in by.items() if v != common)
    return f"{common} ({other})"


def render_run(run: dict) -> str:
    meta, results = run.get("meta", {}), run.get("results", [])
    mode = {"maxseq": "max sequence length", "losscurve": "loss parity"}.get(meta.get("mode"), "throughput")
    head = (f"## {meta.get('date', '?')} · {meta.get('card', '?')} × {meta.get('gpus', '?')} · "
            f"{meta.get('settings', {}).get('model', '?')} · {mode}")
    if meta.get("mode") == "maxseq":
        table = render_maxseq_table(results)
    elif meta.get("mode") == "losscurve":
        table = render_losscurve_table(results, meta) + "\n\n" + losscurve_footer(results, meta)
    else:
        table = render_throughput_table(results)
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
