"""Per GPU, between consecutive steps of a *.recent.json trace: the last span end of step k (any
stream) and the first compute start of step k+1; also each step's compute span."""
import json, sys
for f in sys.argv[1:]:
    sp = json.load(open(f))
    per = {}
    for s in sp:
        d = per.setdefault(str(s.get("device")), {}).setdefault(s.get("step", 0), {"end": 0.0, "cstart": 1e9, "cend": 0.0, "dl": 0.0})
        d["end"] = max(d["end"], s["end_s"])
        if s["stream"] == "compute":
            d["cstart"] = min(d["cstart"], s["start_s"]); d["cend"] = max(d["cend"], s["end_s"])
        if s["stream"] == "out":
            d["dl"] += s["end_s"] - s["start_s"]
    print(f)
    for dev, steps in sorted(per.items()):
        ks = sorted(steps)
        row = []
        for a, b in zip(ks, ks[1:]):
            row.append(f"s{a}->{b}: compute end->next start {1e3*(steps[b]['cstart']-steps[a]['cend']):.0f} ms, last end->next start {1e3*(steps[b]['cstart']-steps[a]['end']):.0f} ms, dl {1e3*steps[a]['dl']:.0f} ms")
        print(" ", dev, "\n    " + "\n    ".join(row))
