"""Run records read back from the raw throughput tables of benchmarks/RESULTS.md.

The harness appended those tables (report.render_run) before runs were kept as files; reading
them lets `python -m benchmarks.bar` judge the runs made so far. A section is

    ## 2026-11-26 10:17 UTC · NVIDIA H200 × 4 · qwen3-1.7b · throughput

    model qwen3-1.7b (1,720,574,976 parameters); seq 2,048; 65,536 tokens/step; ...; 8 timed steps ...

    | system | status | tokens/s | ... | host mem peak | ... | setup s | notes |
    ...
    Command: `python -m benchmarks.harness ...`

and becomes {"meta": ..., "results": [...]} with what a table shows: status, tokens/s, s/step,
host memory (to the 0.1 GiB the table rounds to), setup seconds, compute busy per device (from
the notes) and the timed steps of the settings line. A table has no per-step times, so the
results carry no timed_step_s. Only throughput sections are read.
"""
from __future__ import annotations

import re
from typing import Optional

GiB = 2**30

HEADING = re.compile(r"^## (\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC) · (.+) × (\d+) · (\S+) · throughput\s*$")
BUSY = re.compile(r"compute busy \(last step\) ((?:[\w:.]+ \d+(?:\.\d+)?%(?:, )?)+)")


def _number(text: str) -> Optional[float]:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def _cells(line: str) -> list:
    """The cells of a markdown table row; a pipe written as \\| stays inside its cell."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def parse_settings(line: str) -> tuple:
    """(settings, n_params) from the line under a heading (report.settings_line)."""
    settings, n_params = {}, None
    m = re.search(r"model (\S+) \(([\d,]+) parameters\)", line)
    if m:
        settings["model"], n_params = m.group(1), int(m.group(2).replace(",", ""))
    for key, pattern in (("seq_len", r"seq ([\d,]+)"), ("tokens_per_step", r"([\d,]+) tokens/step"),
                         ("microbatches", r"(\d+) microbatches"), ("steps", r"(\d+) timed steps")):
        m = re.search(pattern, line)
        if m:
            settings[key] = int(m.group(1).replace(",", ""))
    m = re.search(r"timed steps after (\d+)", line)
    if m:
        settings["warmup"] = int(m.group(1))
    return settings, n_params


def compute_busy(notes: str) -> dict:
    """{device: share} from a "compute busy (last step) cuda:0 50%, cuda:1 37%" note."""
    m = BUSY.search(notes or "")
    if not m:
        return {}
    pairs = (p.rsplit(" ", 1) for p in m.group(1).split(", ") if p.strip())
    return {dev: float(pct.rstrip("%")) / 100 for dev, pct in pairs}


def _result(row: dict, steps: Optional[int]) -> dict:
    status = row.get("status", "?")
    r = {"system": row.get("system", "?"), "status": status.split(" ")[0], "notes": [row.get("notes", "")]}
    if status == "ok (partial)":
        r["partial"] = True
    for key, col in (("tokens_per_s", "tokens/s"), ("s_per_step", "s/step"), ("setup_s", "setup s")):
        value = _number(row.get(col, ""))
        if value is not None:
            r[key] = value
    m = re.match(r"([\d.]+) GiB", row.get("host mem peak", ""))
    if m:
        r["host_mem_peak_bytes"] = float(m.group(1)) * GiB
    busy = compute_busy(row.get("notes", ""))
    if busy:
        r["compute_busy_frac"] = busy
    if r["status"] == "ok" and not r.get("partial") and steps is not None:
        r["timed_steps_done"] = steps          # a finished run did every timed step of the settings
    return r


def parse_results_md(text: str, source: str = "RESULTS.md") -> list:
    """Every throughput section of a RESULTS.md text as a run record, in file order."""
    runs, run, header, table_done = [], None, None, False
    for line in text.splitlines():
        m = HEADING.match(line)
        if m:
            date, card, gpus, model = m.groups()
            run = {"meta": {"date": date, "card": card.strip(), "gpus": int(gpus), "mode": "throughput",
                            "settings": {"model": model}, "source": source}, "results": []}
            runs.append(run)
            header, table_done = None, False
            continue
        if line.startswith("## ") or line.startswith("# "):
            run = None                         # another kind of section: not ours to read
            continue
        if run is None:
            continue
        meta = run["meta"]
        if line.startswith("model ") and "parameters" in line and "n_params" not in meta:
            settings, n_params = parse_settings(line)
            meta["settings"].update(settings)
            meta["n_params"] = n_params
        elif line.startswith("|") and not table_done:
            cells = _cells(line)
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-:"):     # the |---|---:| rule
                row = dict(zip(header, cells))
                run["results"].append(_result(row, meta["settings"].get("steps")))
        elif header is not None:
            table_done = True                  # what follows (stderr tails) is not the table
        if line.startswith("Command: `"):
            meta["command"] = line[len("Command: `"):].rstrip("`")
    return runs


def load_results_md(path: Optional[str]) -> list:
    """The runs of the RESULTS.md at `path`; none where there is no such file."""
    if not path:
        return []
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    return parse_results_md(text, source=path)
