import json, sys
for path in sys.argv[1:]:
    for run in json.load(open(path)):
      for r in run["results"]:
        t = r.get("trace", {})
        print(path.split("/")[-1], r["system"], round(r["tokens_per_s"]), round(r["s_per_step"], 3), [round(x, 3) for x in r["timed_step_s"]],
              "setup", round(r.get("setup_s") or 0, 1), "host GiB", round(r.get("host_rss_peak_bytes", 0) / 2**30, 1))
        print("  steady", t.get("steady"), {k: v.get("compute_lag_s") for k, v in t.get("devices", {}).items()})
        print("  opt", r["info"].get("optimizer_s"))
