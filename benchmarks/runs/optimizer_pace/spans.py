import json, collections, statistics, sys
for f in sys.argv[1:]:
    sp = json.load(open(f))
    c = collections.defaultdict(list)
    for s in sp:
        c[(s['stream'], s['name'], str(s.get('device')))].append(1e3 * (s['end_s'] - s['start_s']))
    print(f.split('/')[-2:], {f"{k[0]}:{k[1]}:{k[2][-1]}": round(statistics.median(v), 1) for k, v in sorted(c.items())})
