import json, sys, statistics
for path in sys.argv[1:]:
    for run in json.load(open(path)):
        for r in run["results"]:
            tl = r["info"].get("setup_timeline") or []
            steps = r["timed_step_s"]; med = statistics.median(steps)
            slow = [(i, round(s, 3)) for i, s in enumerate(steps) if s > 1.25 * med]
            gcs = [e for e in tl if "garbage" in e["what"]]
            late = [e for e in gcs if e["t"] > r["setup_s"]]
            print(path.split("/")[-1], r["system"], "tok/s", round(r["tokens_per_s"]), "median", round(med, 3),
                  "max", round(max(steps), 3), "n", len(steps), "setup", round(r["setup_s"], 1))
            print("  slow steps (>1.25x median):", slow)
            print("  gc marks:", len(gcs), "after setup:", [(e["t"], e["where"], e["what"][22:], e["seconds"]) for e in late])
            print("  gc in setup s:", round(sum(e["seconds"] for e in gcs if e["t"] <= r["setup_s"]), 2))
