"""Issue 16's bar (multi-GPU scaling), row by row, from the runs the harness recorded.

    python -m benchmarks.bar [--runs benchmarks/runs] [--results benchmarks/RESULTS.md] [--strict]

Reads the run files of --runs (`harness --record`) and the raw throughput tables of --results
(runs made before run files existed; a run in both is read from its file), and prints one row
per bar item, per model and GPU count where it applies: the figure, the bar, whether it holds,
misses or was not measured, and the run it comes from. Each row takes the newest run that
counts (throughput, Qwen3-1.7B or Llama-3.1-8B, seq 2048, on GPUs) and has the row's figure;
a result whose host lost its CPU to steal is left out and named (Note [stolen host]).
A ratio of two systems is taken only within one run (one harness invocation on one host);
scaling pairs a 4-GPU run with a 1-GPU run of the same tokens per step on the same card.
Exit status 0 (it is a report); --strict exits 1 when a row misses.
"""
from __future__ import annotations

import argparse
import operator
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from .results_md import load_results_md
from .run_files import DEFAULT_DIR, load_runs

GiB = 2**30
MODELS = ("qwen3-1.7b", "llama3.1-8b")
MODEL_ALIASES = {"llama-3.1-8b": "llama3.1-8b"}
SEQ_LEN = 2048
MICROBATCHES = 4           # every comparison recorded so far (a run with other M is an experiment)
GPU_COUNTS = (1, 2, 4)
DELAYED, ROUNDPIPE = "rpcompile-delayed", "roundpipe"
# rpcompile in delayed mode with either kind of workers (threads, or one process per GPU); in a
# run with both, the rows read the faster
DELAYED_SYSTEMS = (DELAYED, "rpcompile-delayed-proc", "rpcompile-delayed-threads")
EXACT_MODES = {"rpcompile": "exact", "rpcompile-overlapped": "overlapped"}
EXACT_BARS = ((1, "≥", operator.ge), (4, ">", operator.gt))      # no slower on 1 GPU, faster on 4

RATIO_BAR = 1.5            # rpcompile-delayed tokens/s over RoundPipe's, one run
SCALING_BAR = 3.6          # rpcompile-delayed tokens/s at 4 GPUs over at 1 GPU
BUSY_BAR = 0.85            # compute busy share of every GPU at 4 GPUs
BUSY_GPUS = 4
SLOWEST_BAR = 1.25         # slowest timed step over the median
HOST_BYTES_BAR = 20        # host memory peak per parameter, delayed mode
SETUP_BAR_S = 60           # capture, plan and compile at 4 GPUs, Qwen3-1.7B
TIMED_STEPS_BAR = 8
# Note [stolen host]: a result whose host gave more than this share of its CPU seconds over the
# timed steps or over the setup to steal (its virtual cores ran something else) measures the
# host, not rpcompile: an A/B's second side (46th session, 2 H200s, Llama-3.1-8B) lost 105.7 of
# 1,580 CPU-s (6.7%) to steal; its host AdamW stepped 2.79 s a step against 1.99-2.11 s, and it
# made 18,193 tokens/s against 20,869-21,060 in the day's three other 2-GPU runs (steal 0.7-2.4
# CPU-s in every other run, at most 0.2%). No row reads such a result; the printout names it.
STEAL_BAR = 0.02
# An rpcompile result whose plan the host's memory bound (Note [host room]: the optimizer's share
# on the devices raised for a small host, the jobs cut again beside it) measures that host, not
# the scaling the bar asks about (the sixty-first session's one-GPU Llama-3.1-8B on a 125.8 GiB
# host, 10,105 tokens/s against 11,489 on a 251.8 GiB one, would have made the 1 -> 4 row hold).
# No row reads such a result; the printout names it.


def host_bound(result: dict) -> bool:
    """Whether the host's memory bound the plan of this result (harness info host_share_least)."""
    return ((result.get("info") or {}).get("host_share_least") or 0) > 0
# harness options that only observe a run; any other (a share of the optimizer set, a switch
# interval) makes it an experiment, not the system a user gets
OBSERVING_OPTIONS = {"rpcompile_trace_dir", "profile_probes"}

# The issue's reference figures for the exact modes, {(model, system, gpus): tokens/s}. RESULTS.md
# records none, so those rows say "no reference" rather than invent one; evaluate() takes them.
EXACT_REFERENCE: dict = {}
# The tree the issue measured ("today"). A run that also ran a mode's system at that tree, named
# f"{system}@{ISSUE_TREE}" (the harness of `git archive ISSUE_TREE`, its results renamed and merged
# into the run file), is its own reference: the same host, the same call.
ISSUE_TREE = "ad79f4b"

HOLDS, MISSES, NOT_MEASURED, NO_REFERENCE = "holds", "misses", "not measured", "no reference"


@dataclass
class Row:
    item: str
    model: str
    gpus: str
    figure: str
    bar: str
    verdict: str
    sources: tuple = ()        # ((run, (systems used from it)), ...)


# --- what a run says ---------------------------------------------------------------------------
def model_of(run: dict) -> str:
    name = str((run["meta"].get("settings") or {}).get("model", "")).lower()
    return MODEL_ALIASES.get(name, name)


def gpus_of(run: dict):
    return run["meta"].get("gpus")


def tokens_of(run: dict):
    return (run["meta"].get("settings") or {}).get("tokens_per_step")


def card_of(run: dict) -> str:
    return run["meta"].get("card") or "?"


def sort_key(run: dict) -> tuple:
    # the date has the minute; started_utc (newer records) the second
    return run["meta"].get("date") or "", run["meta"].get("started_utc") or ""


def counts(run: dict, model: str) -> bool:
    """A run the bar reads: throughput, the model, seq 2048, 4 microbatches, on GPUs, with the
    systems as a user gets them (no --option but those that only observe)."""
    meta = run["meta"]
    settings = meta.get("settings") or {}
    return (meta.get("mode", "throughput") == "throughput" and model_of(run) == model
            and settings.get("seq_len") == SEQ_LEN and settings.get("microbatches", MICROBATCHES) == MICROBATCHES
            and card_of(run) not in ("CPU", "no GPU", "?")
            and set(settings.get("options") or {}) <= OBSERVING_OPTIONS)


def finished(run: dict, system: str) -> Optional[dict]:
    """The system's result if it finished every timed step with a throughput, else None
    (DELAYED: the faster of DELAYED_SYSTEMS that finished)."""
    names = DELAYED_SYSTEMS if system == DELAYED else (system,)
    done = [r for r in run.get("results") or [] if r.get("system") in names and r.get("status") == "ok"
            and not r.get("partial") and r.get("tokens_per_s") and (stolen(r) or 0) <= STEAL_BAR
            and not host_bound(r)]
    return max(done, key=lambda r: r["tokens_per_s"]) if done else None


STOLEN_SPANS = (("host_cpu_timed_s", "the timed steps"), ("host_cpu_setup_s", "the setup"))


def _steal_shares(result: dict) -> dict:
    """{span: the share of the host's CPU seconds over it taken by steal} for each span the
    harness recorded (Note [stolen host])."""
    out = {}
    for key, span in STOLEN_SPANS:
        cpu = result.get(key) or {}
        total = sum(cpu.values())
        if total:
            out[span] = cpu.get("steal", 0) / total
    return out


def stolen(result: dict) -> Optional[float]:
    """The largest share of the host's CPU taken by steal over a span the harness recorded;
    None where it recorded none."""
    return max(_steal_shares(result).values(), default=None)


def stolen_text(result: dict) -> str:
    span, share = max(_steal_shares(result).items(), key=lambda x: x[1])
    return f"steal took {share:.1%} of the host's CPU over {span}"


def stolen_lines(runs: list) -> list:
    """A line for each result of a run the bar would read that it leaves out (steal, a plan the
    host's memory bound)."""
    def why(r):
        if (stolen(r) or 0) > STEAL_BAR:
            return f"{stolen_text(r)} (> {STEAL_BAR:.0%})"
        if host_bound(r):
            least = r["info"]["host_share_least"]
            return f"the host's memory bound its plan (a share of at least {least:g} of the optimizer on the GPUs)"
        return None
    return [f"left out, {why(r)}: {r.get('system')}, {label(run)}"
            for run in runs if any(counts(run, m) for m in MODELS)
            for r in run.get("results") or [] if why(r)]


def label(run: dict) -> str:
    meta = run["meta"]
    where = " (RESULTS.md)" if str(meta.get("source", "")).endswith(".md") else ""
    return f"{meta.get('date', '?')}, {card_of(run)} × {gpus_of(run)}{where}"


def merge(recorded: list, imported: list) -> list:
    """Both lists, newest first; a RESULTS.md table of a run that also has its file is dropped."""
    def key(run):
        m = run["meta"]
        return m.get("date"), m.get("card"), m.get("gpus"), model_of(run), m.get("mode", "throughput")
    seen = {key(r) for r in recorded}
    return sorted(recorded + [r for r in imported if key(r) not in seen], key=sort_key, reverse=True)


def pick(runs: list, model: str, gpus: int, systems: tuple, figure: Callable) -> tuple:
    """(run, figure) of the newest run at `gpus` where every one of `systems` finished and
    figure(run) is not None; else (newest run where they finished, None); else (None, None)."""
    fallback = None
    for run in runs:
        if not counts(run, model) or gpus_of(run) != gpus or not all(finished(run, s) for s in systems):
            continue
        value = figure(run)
        if value is not None:
            return run, value
        fallback = fallback or run
    return fallback, None


# --- formatting ---------------------------------------------------------------------------------
def _tps(x) -> str:
    return f"{x:,.0f}"


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _missing(run: Optional[dict], what: str) -> str:
    return f"{what} not recorded" if run else "no run"


def _row(item, model, gpus, run, systems, value, fmt: Callable, bar: str, ok: Callable, what: str) -> Row:
    """A row of one run: the figure if there is one, else why not."""
    if value is None:
        return Row(item, model, str(gpus), _missing(run, what), bar, NOT_MEASURED, ((run, systems),) if run else ())
    return Row(item, model, str(gpus), fmt(value), bar, HOLDS if ok(value) else MISSES, ((run, systems),))


# --- the bar, item by item ----------------------------------------------------------------------
def workload_row(runs: list, model: str) -> Row:
    """The same tokens per step at every GPU count (seq 2048 is what makes a run count)."""
    chosen = {n: pick(runs, model, n, (DELAYED,), tokens_of)[0] for n in GPU_COUNTS}
    tokens = {n: tokens_of(r) for n, r in chosen.items() if r}
    figure = ", ".join(f"{_gpus(n)} {_tps(tokens[n]) if n in tokens else '—'}" for n in GPU_COUNTS) + " tokens/step"
    if len(set(tokens.values())) > 1:
        verdict = MISSES
    else:
        verdict = HOLDS if len(tokens) == len(GPU_COUNTS) else NOT_MEASURED
    sources = tuple((r, (DELAYED,)) for r in chosen.values() if r)
    return Row("workload: seq 2048, same tokens/step at 1, 2, 4 GPUs", model, "1, 2, 4", figure,
               "one tokens/step", verdict, sources)


def _both_tokens_per_s(run: dict) -> tuple:
    return finished(run, DELAYED)["tokens_per_s"], finished(run, ROUNDPIPE)["tokens_per_s"]


def roundpipe_rows(runs: list, model: str) -> list:
    """Both systems from one run: a ratio across runs would compare hosts and days too."""
    rows = []
    for n in GPU_COUNTS:
        run, value = pick(runs, model, n, (DELAYED, ROUNDPIPE), _both_tokens_per_s)
        rows.append(_row("rpcompile-delayed ÷ RoundPipe, same run", model, n, run, (DELAYED, ROUNDPIPE), value,
                         lambda v: f"{v[0] / v[1]:.2f}× ({_tps(v[0])} / {_tps(v[1])} tokens/s)",
                         f"≥ {RATIO_BAR}×", lambda v: v[0] / v[1] >= RATIO_BAR, "ratio"))
    return rows


def scaling_row(runs: list, model: str) -> Row:
    """The newest 4-GPU run that has a 1-GPU run of the same tokens per step on the same card."""
    item, bar = "scaling 1 → 4 GPUs (rpcompile-delayed)", f"≥ {SCALING_BAR}×"
    for four in runs:
        if not (counts(four, model) and gpus_of(four) == 4 and finished(four, DELAYED)):
            continue
        one = next((r for r in runs if counts(r, model) and gpus_of(r) == 1 and finished(r, DELAYED)
                    and tokens_of(r) == tokens_of(four) and card_of(r) == card_of(four)), None)
        if one:
            t4, t1 = finished(four, DELAYED)["tokens_per_s"], finished(one, DELAYED)["tokens_per_s"]
            return Row(item, model, "1 → 4", f"{t4 / t1:.2f}× ({_tps(t4)} / {_tps(t1)} tokens/s)", bar,
                       HOLDS if t4 / t1 >= SCALING_BAR else MISSES, ((four, (DELAYED,)), (one, (DELAYED,))))
    return Row(item, model, "1 → 4", "no pair of runs (same card, same tokens/step)", bar, NOT_MEASURED)


def _busy(run: dict) -> Optional[dict]:
    return finished(run, DELAYED).get("compute_busy_frac") or None


def busy_row(runs: list, model: str) -> Row:
    run, value = pick(runs, model, BUSY_GPUS, (DELAYED,), _busy)

    def fmt(b):
        missing = BUSY_GPUS - len(b)   # a GPU with no compute span in the step was idle all of it
        return (f"{100 * _lowest(b):.0f}% lowest (" + ", ".join(f"{d} {100 * f:.0f}%" for d, f in b.items())
                + (f", {missing} GPU(s) not in the trace: 0%" if missing > 0 else "") + ")")
    return _row("compute busy on every GPU (last step, rpcompile-delayed)", model, BUSY_GPUS, run, (DELAYED,), value, fmt,
                f"≥ {100 * BUSY_BAR:.0f}%", lambda b: _lowest(b) >= BUSY_BAR, "compute busy")


def _lowest(busy: dict) -> float:
    return 0.0 if len(busy) < BUSY_GPUS else min(busy.values())


def _timed_step_s(run: dict) -> Optional[tuple]:
    """(timed step seconds, the end's drain or None). The last timed step includes the drain:
    the wait at the end for the asynchronous optimizer's last step, a cost of stopping, not a
    swing between steps; so the row compares the steps with the drain taken out of the last one
    and prints the drain beside."""
    r = finished(run, DELAYED)
    steps = r.get("timed_step_s")
    if not steps:
        return None
    drain = r.get("drain_s")
    return (list(steps[:-1]) + [steps[-1] - drain] if drain else list(steps)), drain


def _slowest_text(value) -> str:
    s, drain = value
    text = f"{max(s) / statistics.median(s):.2f} ({max(s):.3f} s / median {statistics.median(s):.3f} s"
    return text + (f"; the end's drain of {drain:.3f} s kept out of the last step)" if drain else ")")


def slowest_rows(runs: list, model: str) -> list:
    rows = []
    for n in GPU_COUNTS:
        run, value = pick(runs, model, n, (DELAYED,), _timed_step_s)
        rows.append(_row("slowest timed step ÷ median (rpcompile-delayed)", model, n, run, (DELAYED,), value,
                         _slowest_text, f"≤ {SLOWEST_BAR}",
                         lambda v: max(v[0]) <= SLOWEST_BAR * statistics.median(v[0]), "per-step times"))
    return rows


def _host_bytes(run: dict) -> Optional[tuple]:
    """(host memory peak, bytes per parameter) of the delayed system; None for a run whose peak
    came from counters that counted forked processes' shared pages once per process (harness.py
    from its counters, 44th session, until Note [forked processes' anonymous pages]) and stood
    above the host's used memory: a compile pool's workers could have made it."""
    r = finished(run, DELAYED)
    n_params = r.get("n_params") or run["meta"].get("n_params")
    peak = r.get("host_mem_peak_bytes")
    if (r.get("host_rss_peak_parts") and not r.get("host_rss_forks_once")
            and (r.get("host_rss_peak_bytes") or 0) > (r.get("host_used_peak_bytes") or 0)):
        return None
    return (peak, peak / n_params) if peak and n_params else None


def host_memory_rows(runs: list, model: str) -> list:
    rows = []
    for n in GPU_COUNTS:
        run, value = pick(runs, model, n, (DELAYED,), _host_bytes)
        fmt = lambda v: f"{v[1]:.1f} B/param ({v[0] / GiB:.1f} GiB)"
        rows.append(_row("host memory peak per parameter (rpcompile-delayed)", model, n, run, (DELAYED,), value, fmt,
                         f"≤ {HOST_BYTES_BAR} B/param", lambda v: v[1] <= HOST_BYTES_BAR, "host memory"))
    return rows


def exact_rows(runs: list, model: str, reference: dict) -> list:
    """Exact (rpcompile) and overlapped modes against the issue's tree in the same run, else
    against the issue's reference figures."""
    rows = []
    for system, mode in EXACT_MODES.items():
        for n, word, beats in EXACT_BARS:
            at_issue = f"{system}@{ISSUE_TREE}"
            run, pair = pick(runs, model, n, (system, at_issue),
                             lambda r: (finished(r, system)["tokens_per_s"], finished(r, at_issue)["tokens_per_s"]))
            if pair is not None:          # the issue's tree in the same run
                (value, ref), systems = pair, (system, at_issue)
                bar = f"{word} {ISSUE_TREE}'s {_tps(ref)} tokens/s, same run"
            else:
                ref, systems = reference.get((model, system, n)), (system,)
                bar = f"{word} reference" + (f" {_tps(ref)} tokens/s" if ref else "")
                run, value = pick(runs, model, n, systems, lambda r: finished(r, system)["tokens_per_s"])
            row = _row(f"{mode} mode ({system}) tokens/s against the issue's reference", model, n, run, systems,
                       value, lambda v: f"{_tps(v)} tokens/s", bar, lambda v: ref is not None and beats(v, ref),
                       "tokens/s")
            if value is not None and ref is None:
                row.verdict = NO_REFERENCE
            rows.append(row)
    return rows


def _optimizer_share(run: dict) -> Optional[tuple]:
    """(host optimizer work per step, step seconds): the optimizer thread's own seconds (clip,
    step, refresh; not its wait for the gradients), medians of the last steps."""
    r = finished(run, DELAYED)
    opt = (r.get("info") or {}).get("optimizer_s")
    if not opt or not r.get("s_per_step"):
        return None
    return opt["clip_s"] + opt["step_s"] + opt["refresh_s"], r["s_per_step"]


def optimizer_rows(runs: list, model: str) -> list:
    rows = []
    for n in GPU_COUNTS:
        run, value = pick(runs, model, n, (DELAYED,), _optimizer_share)
        rows.append(_row("host optimizer seconds per step ÷ step seconds (rpcompile-delayed)", model, n, run,
                         (DELAYED,), value, lambda v: f"{v[0] / v[1]:.2f} ({v[0]:.3f} s / {v[1]:.3f} s)", "< 1",
                         lambda v: v[0] < v[1], "optimizer seconds"))
    return rows


def setup_row(runs: list, model: str) -> Row:
    run, value = pick(runs, model, 4, (DELAYED,), lambda r: finished(r, DELAYED).get("setup_s"))
    return _row("first steps at 4 GPUs: capture, plan, compile (setup s, rpcompile-delayed)", model, 4, run,
                (DELAYED,), value, lambda v: f"{v:.0f} s", f"≤ {SETUP_BAR_S} s", lambda v: v <= SETUP_BAR_S, "setup s")


def timed_steps_rows(rows: list) -> list:
    """At least 8 timed steps in every run another row used, for each system it used there."""
    used: dict = {}
    for row in rows:
        for run, systems in row.sources if row.verdict != NOT_MEASURED else ():   # runs a figure came from
            used.setdefault(id(run), (run, set()))[1].update(systems)
    out = []
    for run, systems in sorted(used.values(), key=lambda p: sort_key(p[0]), reverse=True):
        done = {s: (finished(run, s) or {}).get("timed_steps_done") for s in sorted(systems)}
        known = [v for v in done.values() if v is not None]
        if len(known) < len(done):
            figure, verdict = "timed steps not recorded", NOT_MEASURED
        else:
            figure = f"{min(known)} ({', '.join(sorted(systems))})"
            verdict = HOLDS if min(known) >= TIMED_STEPS_BAR else MISSES
        out.append(Row("timed steps after warm-up, every run used above", model_of(run), str(gpus_of(run)), figure,
                       f"≥ {TIMED_STEPS_BAR}", verdict, ((run, tuple(sorted(systems))),)))
    return out


def evaluate(runs: list, reference: Optional[dict] = None) -> list:
    """Every row of the bar from `runs` (run records, any order)."""
    reference = EXACT_REFERENCE if reference is None else reference
    runs = sorted(runs, key=sort_key, reverse=True)
    rows = []
    for model in MODELS:
        rows.append(workload_row(runs, model))
        rows += roundpipe_rows(runs, model)
        rows.append(scaling_row(runs, model))
        rows.append(busy_row(runs, model))
        rows += slowest_rows(runs, model)
        rows += host_memory_rows(runs, model)
        rows += optimizer_rows(runs, model)
        rows += exact_rows(runs, model, reference)
        if model == "qwen3-1.7b":          # the bar sets the first-steps time for Qwen3-1.7B
            rows.append(setup_row(runs, model))
    return rows + timed_steps_rows(rows)


# --- the printout --------------------------------------------------------------------------------
def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def render(rows: list, header: str = "") -> str:
    lines = [header, ""] if header else []
    lines += ["| bar item | model | GPUs | figure | bar | verdict | run |", "|---|---|---:|---|---|---|---|"]
    for r in rows:
        run = "; ".join(label(run) for run, _ in r.sources) or "—"
        lines.append("| " + " | ".join(_cell(c) for c in (r.item, r.model, r.gpus, r.figure, r.bar,
                                                             f"**{r.verdict}**" if r.verdict == MISSES else r.verdict,
                                                             run)) + " |")
    tally = {v: sum(1 for r in rows if r.verdict == v) for v in (HOLDS, MISSES, NOT_MEASURED, NO_REFERENCE)}
    lines += ["", ", ".join(f"{verdict}: {n}" for verdict, n in tally.items())]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=DEFAULT_DIR, help="directory of run files (harness --record)")
    p.add_argument("--results", default=os.path.join(os.path.dirname(DEFAULT_DIR), "RESULTS.md"),
                   help="RESULTS.md whose raw throughput tables are read too ('' for none)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row misses")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    recorded, imported = load_runs(args.runs), load_results_md(args.results)
    runs = merge(recorded, imported)
    rows = evaluate(runs)
    header = (f"Issue 16's bar from {len(runs)} runs: {len(recorded)} run files in {os.path.relpath(args.runs)}, "
              f"{len(runs) - len(recorded)} tables of {os.path.relpath(args.results) if args.results else '(none)'}")
    print(render(rows, header))
    for line in stolen_lines(runs):
        print(line)
    return 1 if args.strict and any(r.verdict == MISSES for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
