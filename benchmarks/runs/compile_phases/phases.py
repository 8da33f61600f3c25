"""Print, for each harness JSON given (a list of runs, as ../harness_walk/s45c.sh writes) or run file, each
side's tokens/s, setup, host peak, the workers' dry runs and first calls, and each worker's compile seconds by
phase at its last dry run (Note [compile seconds by phase], rpcompile/runtime/timeline.py)."""
import json
import re
import sys

G = 2 ** 30
PHASE = re.compile(r"compile seconds so far: (.*) \((\d+) calls\)")


def results(path):
    data = json.load(open(path))
    for run in data if isinstance(data, list) else [data]:
        yield from run["results"]


for path in sys.argv[1:]:
    for r in results(path):
        info = r.get("info") or {}
        print(f"{path}: {r['system']} {r['status']} {r.get('tokens_per_s') or 0:,.0f} tokens/s, setup {r.get('setup_s') or 0:.1f} s "
              f"(build {r.get('build_s') or 0:.1f}, warm-up {r.get('warmup_s') or 0:.1f}), host peak {r['host_mem_peak_bytes'] / G:.1f} GiB")
        timeline = info.get("setup_timeline") or []
        last, order = {}, []
        for e in timeline:
            what = e["what"]
            m = PHASE.match(what)
            if m:
                key = (e["where"], m.group(1))
                if key not in last:
                    order.append(key)
                last[key] = (e["seconds"], int(m.group(2)))
            elif (what.startswith(("dry run of ", "piece ", "call alone", "captured", "planned", "train_step returned",
                                  "compile pool", "compile stack", "program "))
                  and (e["where"], what) not in last):
                last[(e["where"], what)] = None
                print(f"    {e['t']:7.2f}  {e['where']:9s} {what[:70]:70s} {e.get('seconds') or 0:6.2f} s")
        for where in sorted({w for w, _ in order}):
            rows = sorted(((last[k][0], k[1], last[k][1]) for k in order if k[0] == where), reverse=True)
            print(f"  {where}: " + "; ".join(f"{name} {s:.2f} s ({n})" for s, name, n in rows[:18]))
