import json, sys
for path in sys.argv[1:]:
    for run in json.load(open(path)):
        for r in run["results"]:
            i = r.get("info") or {}
            print(r["system"], r["status"], round(r.get("tokens_per_s") or 0), [round(s, 3) for s in r.get("timed_step_s") or []],
                  "setup", round(r.get("setup_s") or 0, 1), "host GiB", round((r.get("host_mem_peak_bytes") or 0) / 2**30, 1))
            print("  share", i.get("optimizer_share"), "opt", {k: round(v, 3) for k, v in (i.get("optimizer_s") or {}).items()})
            print("  busy", r.get("compute_busy_frac"), "| reason", (r.get("reason") or "")[:300])
            print("  " + "\n  ".join((i.get("plan") or "").splitlines()[:10]))
