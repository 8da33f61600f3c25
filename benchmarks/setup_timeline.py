"""Where an rpcompile run's first steps went, from its run file (Note [setup timeline]).

    python -m benchmarks.setup_timeline benchmarks/runs/<run>.json [--system rpcompile-delayed] [--gaps 12]

Prints each process's marks (main process, worker k) in time order, side by side on one clock,
then the longest gaps between consecutive marks of a process: the stretches the setup spent
waiting or in work that marks nothing, which is where to look next.
"""
from __future__ import annotations

import argparse
import json
import sys


def load(path: str, system: str) -> list:
    """The setup timeline of `system`'s result in a run file (the harness's JSON)."""
    with open(path) as f:
        data = json.load(f)
    runs = data if isinstance(data, list) else [data]
    for run in reversed(runs):
        for r in run.get("results", []):
            if r.get("system") == system:
                return (r.get("info") or {}).get("setup_timeline") or []
    raise SystemExit(f"{path}: no result of system {system!r} with a setup timeline")


def gaps(timeline: list, most: int) -> list:
    """The `most` longest stretches between consecutive marks of one process:
    [(seconds, where, from what, to what, at t)]."""
    last: dict = {}
    out = []
    for m in timeline:
        prev = last.get(m["where"])
        if prev is not None:
            out.append((round(m["t"] - prev["t"], 3), m["where"], prev["what"], m["what"], prev["t"]))
        last[m["where"]] = m
    return sorted(out, reverse=True)[:most]


def render(timeline: list, most: int = 12) -> str:
    lines = [f"{'t (s)':>8}  {'where':<10} {'what':<48} {'took (s)':>8}"]
    for m in timeline:
        took = "" if m.get("seconds") is None else f"{m['seconds']:.2f}"
        lines.append(f"{m['t']:8.2f}  {m['where']:<10} {m['what'][:48]:<48} {took:>8}")
    lines.append("")
    lines.append(f"longest gaps between a process's marks (the {most} longest):")
    for sec, where, a, b, t in gaps(timeline, most):
        lines.append(f"{sec:8.2f} s  {where:<10} after {a!r} (t={t:.2f}) until {b!r}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_file")
    ap.add_argument("--system", default="rpcompile-delayed")
    ap.add_argument("--gaps", type=int, default=12, help="how many of the longest gaps to list")
    a = ap.parse_args(argv)
    print(render(load(a.run_file, a.system), a.gaps))


if __name__ == "__main__":
    main(sys.argv[1:])
