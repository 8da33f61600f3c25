"""Where a step's time goes between stage jobs, from a span file the rpcompile runner wrote
(`--option rpcompile_trace_dir=D`): per job, its device, compute start/end per microbatch, and
the hop of each microbatch (previous job's compute end -> this job's compute start).

    python -m benchmarks.trace_hops D/rpcompile-delayed_4g.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from .systems.rpcompile_runner import trace_summary


def summarize(spans: list) -> str:
    compute = defaultdict(dict)   # job -> mb -> (start, end, worker)
    issue = defaultdict(float)    # job -> host seconds enqueueing its compute
    for s in spans:
        if s["stream"] == "compute" and s.get("job") is not None:
            issue[s["job"]] += s.get("issue_s") or 0.0
    for s in spans:
        # (a replicated job's sum of the copies' gradients is the job's, of no microbatch)
        if s["stream"] == "compute" and s.get("job") is not None and s.get("microbatch") is not None:
            job, mb = s["job"], s["microbatch"]
            prev = compute[job].get(mb)
            start = s["start_s"] if prev is None else min(prev[0], s["start_s"])
            end = s["end_s"] if prev is None else max(prev[1], s["end_s"])
            compute[job][mb] = (start, end, s.get("worker"))
    lines = ["job worker  first start  last end  compute s  issue s  hop ms per microbatch (prev job's end -> start)"]
    hops = []
    for job in sorted(compute):
        mbs = compute[job]
        busy = sum(e - s for s, e, _ in mbs.values())
        h = []
        for mb, (s, _, _) in sorted(mbs.items()):
            prev = compute.get(job - 1, {}).get(mb)
            if prev is not None:
                h.append((s - prev[1]) * 1e3)
        hops += h
        w = next(iter(mbs.values()))[2]
        lines.append(f"{job:3d} {w!s:>6} {min(s for s, _, _ in mbs.values()):12.3f} "
                     f"{max(e for _, e, _ in mbs.values()):9.3f} {busy:10.3f} {issue[job]:8.3f}  " + " ".join(f"{x:6.1f}" for x in h))
    first = min(s for mbs in compute.values() for s, _, _ in mbs.values())
    last = max(e for mbs in compute.values() for _, e, _ in mbs.values())
    busy = trace_summary(spans)["devices"]
    lines.append(f"compute span {last - first:.3f} s; compute busy per device "
                 + ", ".join(f"{d}: {v['compute_busy_s']:.3f} s" for d, v in busy.items()))
    if hops:
        hops.sort()
        lines.append(f"hops: {len(hops)}, median {hops[len(hops) // 2]:.1f} ms, max {hops[-1]:.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(path)
            print(summarize(json.load(f)))
