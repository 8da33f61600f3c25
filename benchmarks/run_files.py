"""Harness runs kept as files in the repository: one JSON per harness invocation in benchmarks/runs/.

A run file holds the record the harness writes ({"meta": {...}, "results": [...]}), named by
when the run started (UTC), the card, the GPU count and the model, so `ls` sorts it by time and
`python -m benchmarks.bar` reads committed data. The loader also takes the harness's `--json`
files (a list of runs), so those can be dropped into the directory as they come back.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs")


def started_stamp(meta: dict) -> str:
    """20261126T101703Z from meta's started_utc, or 20261126T1017Z from its date (older records
    carry only the minute)."""
    started = meta.get("started_utc")
    if started:
        return re.sub(r"[-:]", "", started)
    m = re.match(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2})", meta.get("date") or "")
    return "".join(m.groups()[:3]) + "T" + "".join(m.groups()[3:]) + "Z" if m else "undated"


def _slug(text) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(text)).strip("-") or "unknown"


def run_file_name(meta: dict) -> str:
    """<started>_<card>_x<gpus>_<model>[_lora<R>][_<mode>].json, e.g.
    20261126T101703Z_NVIDIA-H200_x4_qwen3-1.7b.json."""
    mode, settings = meta.get("mode") or "throughput", meta.get("settings") or {}
    name = f"{started_stamp(meta)}_{_slug(meta.get('card'))}_x{meta.get('gpus')}_{_slug(settings.get('model'))}"
    lora = (settings.get("options") or {}).get("lora")
    return name + (f"_lora{_slug(lora)}" if lora else "") + ("" if mode == "throughput" else f"_{mode}") + ".json"


def write_run(directory: str, run: dict) -> str:
    """Write `run` to its file in `directory` (replacing the file of the same run: the harness
    rewrites it after every system) and return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, run_file_name(run.get("meta") or {}))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(run, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_runs(directory: Optional[str]) -> list:
    """Every run in the *.json files of `directory` (a file holds one run or a list of runs), each
    with meta["source"] set to its file; a missing directory has none. A file that does not parse
    is an error: committed data that cannot be read should not pass silently."""
    if not directory or not os.path.isdir(directory):
        return []
    runs = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        with open(path) as f:
            data = json.load(f)
        for run in data if isinstance(data, list) else [data]:
            if isinstance(run, dict) and isinstance(run.get("meta"), dict):
                run["meta"]["source"] = os.path.relpath(path)
                runs.append(run)
    return runs
