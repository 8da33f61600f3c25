"""Print, for each harness JSON given, tokens/s, setup seconds, the host figures (counters, PSS where read,
system used) and the seconds of the setup marks the shared-file fill should change (44th session)."""
import json
import sys

MARKS = ("captured", "planned", "workers ready", "flat masters made", "working copies made", "working copies mapped",
         "gradients mapped", "train_step returned")
G = 2 ** 30

for path in sys.argv[1:]:
    for run in json.load(open(path)):
        for r in run["results"]:
            pss = r.get("host_pss_peak_bytes")
            print(f"{path}: {r['system']} {r['status']} {r.get('tokens_per_s') or 0:,.0f} tokens/s, setup {r.get('setup_s') or 0:.1f} s, "
                  f"host peak {r['host_mem_peak_bytes'] / G:.1f} GiB (counters {r['host_rss_peak_bytes'] / G:.1f}, "
                  f"PSS {'-' if pss is None else f'{pss / G:.1f}'}, used {r['host_used_peak_bytes'] / G:.1f}), "
                  f"at launch {r.get('host_at_launch_bytes')}, huge {r.get('anon_huge_peak_bytes')}")
            print("   ", run["meta"]["env"].get("transparent_hugepage"), "peak parts", r.get("host_rss_peak_parts"),
                  "used peak at", r.get("host_used_peak_at_s"), "s; host CPU s over the timed steps", r.get("host_cpu_timed_s"),
                  "over the setup", r.get("host_cpu_setup_s"))
            first = {}
            for e in (r.get("info") or {}).get("setup_timeline") or []:
                key = (e["where"], e["what"])
                if (e["what"] in MARKS or e["what"].startswith("dry run of ")) and key not in first:
                    first[key] = e
            for (where, what), e in first.items():
                print(f"    {e['t']:7.2f}  {where:9s} {what:24s} {e.get('seconds') or 0:6.2f} s")
