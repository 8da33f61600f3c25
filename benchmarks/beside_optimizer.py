"""What of a traced step's compute ran beside the optimizer's work on the same device (Note
[optimizer spans]), and how much longer those pieces took than the same pieces elsewhere
(runs/optimizer_context/README.md), from the last steps' spans the harness keeps with
`--option rpcompile_trace_dir=D` (benchmarks/sides.sh copies them to $OUT/recent-*.json):

    python -m benchmarks.beside_optimizer D/rpcompile-delayed_1g.recent.json [...]

A piece is keyed by (job, name, its place among its microbatch's pieces); its excess is its
seconds over the median of its key. Printed per device: compute seconds, and the excess summed
over pieces that overlap a `step_on_device` / `masters_down` / `copies_down` span, and over those
that overlap none."""
from __future__ import annotations

import collections
import json
import statistics
import sys

from .systems.rpcompile_runner import _overlap, _union

OPT = ("step_on_device", "masters_down", "copies_down")


def report(spans):
    out = []
    for dev in sorted({s["device"] for s in spans}):
        comp = sorted((s for s in spans if s["device"] == dev and s["stream"] == "compute"), key=lambda s: s["start_s"])
        opt = {n: [s for s in spans if s["device"] == dev and s["name"] == n] for n in OPT}
        covered = {n: _union((s["start_s"], s["end_s"]) for s in opt[n]) for n in OPT}
        place = collections.Counter()
        keyed = collections.defaultdict(list)
        for s in comp:
            k0 = (s.get("step"), s.get("job"), s.get("microbatch"))
            key = (s.get("job"), s["name"], place[k0])
            place[k0] += 1
            keyed[key].append(s)
        med = {k: statistics.median(x["end_s"] - x["start_s"] for x in v) for k, v in keyed.items()}
        rows = collections.defaultdict(lambda: [0, 0.0, 0.0])      # class -> pieces, seconds, excess
        for k, v in keyed.items():
            for s in v:
                d = s["end_s"] - s["start_s"]
                hit = [n for n in OPT if _overlap([(s["start_s"], s["end_s"])], covered[n]) > 0]
                cls = "+".join(hit) or "alone"
                r = rows[cls]
                r[0] += 1
                r[1] += d
                r[2] += d - med[k]
        steps = sorted({s.get("step") for s in comp})
        busy = sum(s["end_s"] - s["start_s"] for s in comp)
        optsec = {n: sum(s["end_s"] - s["start_s"] for s in opt[n]) for n in OPT}
        out.append(f"{dev}: steps {steps}, compute {busy:.3f} s, optimizer spans "
                   + ", ".join(f"{n} {len(opt[n])}x {optsec[n]:.3f} s" for n in OPT))
        for cls, (cnt, sec, exc) in sorted(rows.items()):
            out.append(f"  beside {cls}: {cnt} pieces, {sec:.3f} s, excess over their keys' medians {exc:+.3f} s")
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path)
        for line in report(json.load(open(path))):
            print(line)
